"""Where the time of a context-parallel call goes on device 0 of W: jaxcp's allgather (GDN or
KDA) under JAX's profiler, its GPU kernels grouped by name.

    python -m benchmarks.profile.cp --op kda --T 32768 --H 64 --D 128 --devices 2
    python -m benchmarks.profile.cp --op gdn --layout zigzag --nseq 10 --out gdn_zigzag.md

The call is ``benchmarks.bench.cp``'s: its inputs (sharded along T over the W devices, in the
CP layout's order) and its shard_map'd op, jitted as the forward and, separately, the
forward+backward. Each runs WARMUP times, then --calls times queued back to back under
``jax.profiler.trace``. Of the trace's first GPU plane (device 0), per pass: each kernel
name's time and count per call and its share of the call's span; the span (first kernel
start to last kernel end over the traced calls, per call), the busy time (the union of the
kernels' intervals on all streams), the idle time (span - busy) and the collectives' time
(the union of the intervals of kernels named all-gather, allgather or nccl). Without GPUs
(JAX on fake CPU devices, as in ``benchmarks.bench.cp``) the calls run and the script says
in one line that the trace has no GPU kernels.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import tempfile
import time
from typing import NamedTuple

from benchmarks.bench import cp

WARMUP = 3
GPU_PLANE = "/device:GPU:"
STREAM_LINE = "Stream #"
COLLECTIVE = ("all-gather", "allgather", "nccl")   # matched in lower case
SEQUENCES = {1: "single", 10: "packed"}           # --nseq -> benchmarks.bench.cp.layouts


class Kernel(NamedTuple):
    """One kernel (or copy) on a GPU stream: [start_ns, end_ns)."""
    name: str
    start_ns: float
    end_ns: float


class Summary(NamedTuple):
    """Per call, ms: span (first kernel start to last kernel end), busy (union of the kernel
    intervals), idle (span - busy), collective (union of the collective kernels' intervals)."""
    span: float
    busy: float
    idle: float
    collective: float


def device_kernels(profile) -> list[Kernel]:
    """The kernels of the first GPU plane (/device:GPU:N, the least N) from its stream lines
    ("Stream #..."; not the derived ones such as "XLA Ops", which repeat them); empty where
    the profile has no GPU plane."""
    planes = [p for p in profile.planes if p.name.startswith(GPU_PLANE)]
    if not planes:
        return []
    plane = min(planes, key=lambda p: int(p.name.removeprefix(GPU_PLANE)))
    return [Kernel(ev.name, ev.start_ns, ev.end_ns) for line in plane.lines
            if line.name.startswith(STREAM_LINE) for ev in line.events]


def union_ns(kernels) -> float:
    """The length of the union of the kernels' intervals (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for _, start, end in sorted(kernels, key=lambda k: k.start_ns):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def is_collective(name: str) -> bool:
    return any(part in name.lower() for part in COLLECTIVE)


def summarize(kernels: list[Kernel], calls: int) -> Summary:
    """``Summary`` of the kernels of `calls` calls, per call."""
    per_call = lambda ns: ns / calls / 1e6
    span = per_call(max(k.end_ns for k in kernels) - min(k.start_ns for k in kernels))
    busy = per_call(union_ns(kernels))
    collective = per_call(union_ns([k for k in kernels if is_collective(k.name)]))
    return Summary(span, busy, span - busy, collective)


def by_name(kernels: list[Kernel]) -> list[tuple[str, float, int]]:
    """(name, total ns, count) per kernel name, the most time first."""
    totals: dict[str, list] = {}
    for name, start, end in kernels:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    return sorted(((n, ns, c) for n, (ns, c) in totals.items()), key=lambda row: -row[1])


def markdown(title: str, kernels: list[Kernel], calls: int, wall_ms: float) -> str:
    """A pass's section: the ``Summary`` line, then per kernel name its ms and count per call
    and its share of the call's span."""
    s = summarize(kernels, calls)
    lines = [f"## {title}", "",
             f"Per call, of {calls} traced calls: span {s.span:.3f} ms (first kernel start to "
             f"last kernel end), busy {s.busy:.3f} ms (kernels of all streams, overlaps once), "
             f"idle {s.idle:.3f} ms, collectives {s.collective:.3f} ms (kernels named "
             f"{', '.join(COLLECTIVE)}); host wall {wall_ms:.3f} ms.", "",
             "| kernel | ms per call | count per call | share of the call |",
             "|---|---|---|---|"]
    for name, ns, count in by_name(kernels):
        lines.append(f"| `{name}` | {ns / calls / 1e6:.3f} | {count / calls:g} | "
                     f"{ns / calls / 1e6 / s.span:.1%} |")
    return "\n".join(lines) + "\n"


def traced(fn, xs, calls: int, directory: str) -> float:
    """fn(*xs) WARMUP times, then `calls` times queued back to back under
    ``jax.profiler.trace(directory)``; returns the host's wall ms per traced call."""
    import jax

    for _ in range(WARMUP):
        jax.block_until_ready(fn(*xs))
    with jax.profiler.trace(directory):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*xs) for _ in range(calls)])
        wall = time.perf_counter() - t0
    return 1e3 * wall / calls


def load_profile(directory: str):
    """The ProfileData of the one .xplane.pb that ``jax.profiler.trace`` wrote under it."""
    from jax.profiler import ProfileData

    path, = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    return ProfileData.from_file(path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile.cp",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="gdn", choices=cp.OPS)
    cp.add_shape_flags(ap)
    ap.add_argument("--layout", default="contiguous", choices=cp.CP_LAYOUTS, help="CP layout")
    ap.add_argument("--nseq", type=int, default=1, choices=sorted(SEQUENCES),
                    help="sequences: one, or the packed set of benchmarks.bench.cp")
    ap.add_argument("--calls", type=int, default=10, help="calls traced per pass")
    ap.add_argument("--backend", default="pallas", choices=["pallas", "xla", "interpret"])
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    args = ap.parse_args(argv)
    cp.check_positive(ap, args, ("T", "H", "D", "calls"))
    return ap, args


def cp_world(ap, args) -> int:
    """W: --devices, or every device JAX sees (ap.error when it sees fewer)."""
    import jax

    W = args.devices or len(jax.devices())
    if W > len(jax.devices()):
        ap.error(f"--devices {W}: JAX sees {len(jax.devices())} devices")
    return W


def write_text(text: str, out: str | None) -> None:
    """text to the file out, or to stdout (out None)."""
    if out:
        with open(out, "w") as f:
            f.write(text)
    else:
        print(text, end="")


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    cp.host_devices(args.devices)
    import jax
    import jax.numpy as jnp

    W = cp_world(ap, args)
    pieces = 2 * W if args.layout == "zigzag" else W
    if args.T % pieces:
        ap.error(f"--T must divide into {pieces} pieces (W = {W}, --layout {args.layout})")
    mesh = cp.seq_mesh(W)
    xs = cp.placed(cp.inputs(args.op, args.T, args.H, args.D), mesh, args.layout)
    cu = jnp.asarray(cp.layouts(args.T, (SEQUENCES[args.nseq],))[0], jnp.int32)
    call = cp.op_call(args.op, cu, args.backend, "allgather", args.layout, mesh)
    traces = {}
    for passes in cp.PASSES:
        with tempfile.TemporaryDirectory() as directory:
            wall = traced(cp.jitted(call, passes), xs, args.calls, directory)
            traces[passes] = device_kernels(load_profile(directory)), wall
    if not all(kernels for kernels, _ in traces.values()):
        print(f"no GPU kernels in the trace (JAX on {jax.devices()[0].platform}): the calls "
              f"ran, there is no kernel table")
        return 0
    text = "\n".join(
        [f"# jaxcp allgather, {args.op.upper()}: device 0 of {W} x "
         f"{jax.devices()[0].device_kind}\n\nT = {args.T}, H = {args.H}, K = V = {args.D}, "
         f"bf16, B = 1, {args.nseq} sequence(s), {args.layout} layout, backend "
         f"{args.backend}.\n"]
        + [markdown(passes, kernels, args.calls, wall)
           for passes, (kernels, wall) in traces.items()])
    write_text(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
