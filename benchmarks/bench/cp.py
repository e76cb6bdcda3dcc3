"""Context-parallel GDN and KDA on W devices: no CP vs allgather / all_to_all / relay, and
FLA's KCP and head all-to-all.

    python -m benchmarks.bench.cp --json docs/benchmarks/cp_w2.json    # on the multi-GPU machine
    python -m benchmarks.bench.cp --cp-layouts contiguous,zigzag --json docs/benchmarks/cp_w2.json
    python -m benchmarks.bench.cp --report docs/benchmarks/cp_w2.json  # cp_w2.md, .png

--ops: the ops timed in the one run (default both), each record names its op. bf16, B = 1,
q/k L2-normalised before the timed calls (jaxcp and FLA alike, as FLA's CP benchmark does;
the norm is not part of the times), g float32 log-sigmoid of normal: [1, T, H] for GDN (one
decay per head), [1, T, H, D] for KDA (one per channel); the inputs of
``benchmarks.bench.kernels.jaxcp_inputs`` and ``benchmarks.fla.inputs``. One sequence and a
packed set of 10 (--layouts). fwd+bwd computes o and then the gradients for a cotangent of
ones, as FLA's ``o.backward(torch.ones_like(o))`` (``benchmarks.timing.forward_backward``).
"none" runs the whole sequence on one device; the CP strategies split it over all W.
--cp-layouts: how the sequence is split (``jaxcp.cp.split``): jaxcp's allgather runs in each
layout, its inputs permuted into the layout's order (``jaxcp.to_layout``) before the timed
calls; all_to_all (which ignores the layout) and relay (contiguous only) run once,
contiguous. FLA's KCP runs zigzag only where its ``build_cp_context`` takes a layout (not
FLA 0.6). Each record names its layout.
rate = (t_none / W) / t (1.0 is a perfect split). FLA (torch) runs first, as W processes
under torchrun (one child for all ops), so that JAX has the GPUs afterwards. Each time is per
call, for calls queued back to back (GPU time): the median of --iters rounds of 4 calls, by
CUDA events for FLA and ``benchmarks.timing.pipelined_ms`` for jaxcp. ``markdown`` is the
records' tables, the page docs/benchmarks/cp*.md (``benchmarks.pages``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from functools import partial

from benchmarks.records import saver


VARLEN = [0, 2960, 5212, 9513, 13567, 17443, 20634, 23521, 26281, 31785, 32768]

LAYOUTS = ("single", "packed")
OPS = ("gdn", "kda")
STRATEGIES = ("allgather", "all_to_all", "relay")
# jaxcp.CP_LAYOUTS, spelled out: jax is imported only once the device flags are set
CP_LAYOUTS = ("contiguous", "zigzag")
PASSES = ("fwd", "fwd+bwd")
AXIS = "seq"
# the least rate (t_none / W) / t of allgather that the target asks for, per pass
TARGET_RATE = {"fwd": 0.80, "fwd+bwd": 0.88}


def layouts(T: int, names=LAYOUTS) -> list[list[int]]:
    """cu_seqlens of the named layouts: "single" (one sequence), "packed" (the set of 10,
    scaled to T)."""
    cus = {"single": [0, T], "packed": [round(c * T / VARLEN[-1]) for c in VARLEN]}
    return [cus[n] for n in names]


def _fla_ms(fn, iters: int, calls: int = 4) -> float:
    """ms per call of fn() on this rank, the slowest rank's: CUDA events around `calls`
    queued calls, the median of `iters` such rounds after 5 warm calls (as
    ``benchmarks.timing.pipelined_ms``)."""
    import statistics
    import torch
    import torch.distributed as dist

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _seq_to_heads(x):
    """[1, T/W, H, ...] on each rank -> [1, T, H/W, ...]: every rank's tokens of my heads."""
    import torch
    import torch.distributed as dist

    W = dist.get_world_size()
    out = [torch.empty_like(p) for p in x.chunk(W, dim=2)]
    dist.all_to_all(out, [p.contiguous() for p in x.chunk(W, dim=2)])
    return torch.cat(out, dim=1)


def _heads_to_seq(x):
    """[1, T, H/W, ...] -> [1, T/W, H, ...]: my tokens of every rank's heads."""
    import torch
    import torch.distributed as dist

    W = dist.get_world_size()
    out = [torch.empty_like(p) for p in x.chunk(W, dim=1)]
    dist.all_to_all(out, [p.contiguous() for p in x.chunk(W, dim=1)])
    return torch.cat(out, dim=2)


def _local_tokens(x, cp_layout: str):
    """This rank's tokens of x [1, T, ...] under the CP layout (``jaxcp.cp.split``):
    contiguous, piece r of W; zigzag, pieces r and 2W - 1 - r of 2W, in that order."""
    import torch
    import torch.distributed as dist

    rank, W = dist.get_rank(), dist.get_world_size()
    if cp_layout == "contiguous":
        return x.chunk(W, dim=1)[rank]
    pieces = x.chunk(2 * W, dim=1)
    return torch.cat([pieces[rank], pieces[2 * W - 1 - rank]], dim=1)


def _kcp_context(cu, cp_layout: str):
    """FLA's KCP context for the global cu_seqlens under the CP layout, or None where its
    ``build_cp_context`` takes no layout (FLA 0.6: contiguous only)."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context

    if cp_layout == "contiguous":
        return build_cp_context(cu, group=dist.group.WORLD)
    try:
        return build_cp_context(cu, group=dist.group.WORLD, layout=cp_layout)
    except TypeError:
        return None


def _fla_call(fla_op, backward: bool, xs, **kw) -> None:
    """o = fla_op(*xs)[0] on fresh leaves, then o.backward(ones) when backward."""
    import torch

    ts = [x.detach().requires_grad_(backward) for x in xs]
    o = fla_op(*ts, **kw)[0]
    if backward:
        o.backward(torch.ones_like(o))


def _fla_head_all_to_all(fla_op, backward: bool, local, cu) -> None:
    """FLA's single-device op on H/W heads of the whole sequence: q, k, v, g, beta exchanged
    from [1, T/W, H] to [1, T, H/W] shards, o exchanged back and, with the backward, the
    cotangent exchanged in and the gradients out (the communication is timed with the op)."""
    import torch

    hs = [_seq_to_heads(x).detach().requires_grad_(backward) for x in local]
    o = fla_op(*hs, cu_seqlens=cu)[0]
    o_local = _heads_to_seq(o.detach())
    if backward:
        o.backward(_seq_to_heads(torch.ones_like(o_local)))
        for x in hs:
            _heads_to_seq(x.grad)


def _fla_op_records(op: str, T: int, H: int, D: int, iters: int, names, cp_layouts):
    """This rank's share of FLA's records of one op, yielded as measured: per sequence layout
    and pass, no CP, KCP per CP layout that FLA takes, and the head all-to-all (when W
    divides H)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from benchmarks import fla

    fla_op = fla.op(op)
    W = dist.get_world_size()
    q, k, v, g, beta = (x.detach() for x in fla.inputs(op, T, H, D))
    full = (F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1), v, g, beta)
    local = {layout: tuple(_local_tokens(x, layout) for x in full)
             for layout in {*cp_layouts, "contiguous"}}
    row = dict(op=op, T=T, H=H, K=D, V=D, device=torch.cuda.get_device_name(), impl="fla")
    for cu_list in layouts(T, names):
        cu = torch.tensor(cu_list, device="cuda", dtype=torch.long)
        contexts = {layout: _kcp_context(cu, layout) for layout in cp_layouts}
        for passes in PASSES:
            backward = passes == "fwd+bwd"
            calls = [("none", "contiguous", 1,
                      partial(_fla_call, fla_op, backward, full, cu_seqlens=cu))]
            calls += [("fla-kcp", layout, W,
                       partial(_fla_call, fla_op, backward, local[layout], cp_context=ctx))
                      for layout, ctx in contexts.items() if ctx is not None]
            if H % W == 0:
                calls.append(("fla-all_to_all", "contiguous", W,
                              partial(_fla_head_all_to_all, fla_op, backward, local["contiguous"],
                                      cu)))
            for strategy, layout, w, fn in calls:
                yield dict(row, strategy=strategy, layout=layout, W=w, nseq=len(cu_list) - 1,
                           **{"pass": passes}, ms=_fla_ms(fn, iters))


def fla_worker(ops, T: int, H: int, D: int, iters: int, names=LAYOUTS,
               cp_layouts=("contiguous",)) -> None:
    """One torchrun rank: FLA's records of every op (``_fla_op_records``); rank 0 prints
    each as a JSON line as soon as it is measured."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    for op in ops:
        for record in _fla_op_records(op, T, H, D, iters, names, cp_layouts):
            if dist.get_rank() == 0:
                print(json.dumps(record), flush=True)
    dist.destroy_process_group()


def host_devices(count: int | None) -> bool:
    """Whether there are GPUs (nvidia-smi is found). Without, JAX is set to run on `count`
    (default 4) fake CPU devices: call before jax is imported."""
    if shutil.which("nvidia-smi"):
        return True
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={count or 4}")
    return False


def gpu_count() -> int:
    """The GPUs nvidia-smi lists."""
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                          text=True).stdout.count("GPU ")


def inputs(op: str, T: int, H: int, D: int) -> tuple:
    """jaxcp's q, k, v, g, beta on one device (``benchmarks.bench.kernels.jaxcp_inputs``, seed
    0): q, k, v [1, T, H, D] bf16 with q and k L2-normalised over D, g float32 [1, T, H]
    (GDN) or [1, T, H, D] (KDA), beta [1, T, H] bf16."""
    from benchmarks.bench.kernels import jaxcp_inputs
    from jaxcp.l2norm import l2_normalize

    q, k, v, g, beta, _ = jaxcp_inputs(op, T, H, D)
    unit = lambda x: l2_normalize(x).astype(x.dtype)
    return unit(q), unit(k), v, g, beta


def seq_mesh(W: int):
    """A one-axis mesh (AXIS) of the first W devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:W]), (AXIS,))


def placed(xs, mesh, cp_layout: str) -> tuple:
    """xs [1, T, ...] in sequence order, permuted into the CP layout's order
    (``jaxcp.to_layout``) and sharded along T over the mesh (device r holds its T / W tokens
    of the layout), as inside a sharded training step: otherwise every call would first
    scatter them from device 0."""
    import jax
    import jaxcp
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P(None, AXIS))
    W = mesh.shape[AXIS]
    return tuple(jax.device_put(jaxcp.to_layout(x, cp_layout, W), sharding) for x in xs)


def op_call(op: str, cu, backend: str, strategy: str = "none", cp_layout: str = "contiguous",
            mesh=None, **op_kw):
    """(q, k, v, g, beta) -> o of jaxcp's op (``benchmarks.bench.kernels.jaxcp_op``) for the
    packed sequences cu: strategy "none" on one device; otherwise with CP over the mesh's
    AXIS, shard_map'd with the inputs and o split along T in cp_layout. op_kw: further
    keyword arguments of the op."""
    import jax
    from jax.sharding import PartitionSpec as P
    from benchmarks.bench.kernels import jaxcp_op

    fn = jaxcp_op(op)
    if strategy == "none":
        return lambda *xs: fn(*xs, cu_seqlens=cu, backend=backend, **op_kw)[0]
    body = lambda *xs: fn(*xs, cu_seqlens=cu, backend=backend, cp_axis=AXIS,
                          cp_strategy=strategy, cp_layout=cp_layout, **op_kw)[0]
    seq = P(None, AXIS)
    return jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq,
                         check_vma=backend != "interpret")


def jitted(call, passes: str):
    """call jitted: "fwd" returns o; "fwd+bwd" o and the cotangents of the five inputs for a
    cotangent of ones (``benchmarks.timing.forward_backward``)."""
    import jax
    from benchmarks.timing import forward_backward

    return jax.jit(call if passes == "fwd" else forward_backward(call, range(5)))


def variants(strategies, cp_layouts) -> list[tuple[str, str]]:
    """The (strategy, CP layout) pairs timed: "none" once; allgather in every layout;
    all_to_all (which ignores the layout) and relay (contiguous only) once, contiguous."""
    return [("none", "contiguous")] + [
        (s, layout) for s in strategies
        for layout in (cp_layouts if s == "allgather" else ("contiguous",))]


def run_jaxcp(ops, T: int, H: int, D: int, W: int, iters: int, strategies, backend,
              done=lambda records: None, names=LAYOUTS, cp_layouts=("contiguous",),
              compile_threads: int = 8) -> list[dict]:
    """jaxcp's records: per op and sequence layout, every ``variants`` pair and pass,
    compiled side by side and timed in turn; done(records) after each."""
    import jax.numpy as jnp
    from benchmarks.timing import time_side_by_side

    mesh = seq_mesh(W)
    device = mesh.devices.flat[0].device_kind
    pairs = variants(strategies, cp_layouts)
    records = []
    for op in ops:
        on_one = inputs(op, T, H, D)
        on_all = {layout: placed(on_one, mesh, layout)
                  for layout in {layout for s, layout in pairs if s != "none"}}
        for cu_list in layouts(T, names):
            cu = jnp.asarray(cu_list, jnp.int32)
            nseq = len(cu_list) - 1
            jobs = [(s, layout, passes, jitted(op_call(op, cu, backend, s, layout, mesh), passes),
                     on_one if s == "none" else on_all[layout])
                    for s, layout in pairs for passes in PASSES]
            times = time_side_by_side([(fn, xs) for *_, fn, xs in jobs], iters, compile_threads)
            for (strategy, layout, passes, _, _), timed in zip(jobs, times):
                label = f"{op} {strategy:10} {layout:10} nseq={nseq:2} {passes:8}"
                if isinstance(timed, Exception):   # reported, not fatal: the other rows run
                    print(f"{label} failed: {type(timed).__name__}: {str(timed)[:300]}",
                          flush=True)
                    continue
                records.append(dict(op=op, strategy=strategy, layout=layout,
                                    W=1 if strategy == "none" else W, T=T, H=H, K=D, V=D,
                                    nseq=nseq, **{"pass": passes}, ms=timed.ms, device=device,
                                    impl=f"jaxcp-{backend}"))
                print(f"{label} {timed.ms:9.3f} ms", flush=True)
                done(records)
    return records


def layout_of(record: dict) -> str:
    """A record's CP layout; records written before the layout was recorded are contiguous."""
    return record.get("layout", "contiguous")


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _share(record: dict | None, none_ms: dict, W: int) -> float | None:
    """t_none / W, a device's share of its implementation's run without CP, for a CP record
    (None for a run without CP, or where that run is missing)."""
    if record is None or record["strategy"] == "none":
        return None
    t_none = none_ms.get((record["impl"], record["nseq"], record["pass"]))
    return t_none / W if t_none else None


def _none_ms(records: list[dict]) -> dict:
    """(impl, nseq, pass) -> ms of the runs without CP."""
    return {(r["impl"], r["nseq"], r["pass"]): r["ms"] for r in records
            if r["strategy"] == "none"}


def _records_table(records: list[dict], W: int) -> list[str]:
    """One op's records, each with its rate and overhead (t - t_none / W)."""
    none = _none_ms(records)
    lines = ["| impl | strategy | layout | sequences | pass | ms | rate | overhead ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        share = _share(r, none, W)
        cells = (("-", "-") if share is None
                 else (f"{share / r['ms']:.0%}", f"{r['ms'] - share:.2f}"))
        lines.append(f"| {r['impl']} | {r['strategy']} | {layout_of(r)} | {r['nseq']} | "
                     f"{r['pass']} | {r['ms']:.2f} | {cells[0]} | {cells[1]} |")
    return lines


def _target_table(records: list[dict], W: int) -> list[str]:
    """One op's target rows, per sequences, pass and CP layout: allgather against FLA's KCP
    and all_to_all (which ignores the layout: its one, contiguous run), and allgather's
    rate."""
    none = _none_ms(records)
    at = {(r["strategy"], layout_of(r), r["nseq"], r["pass"]): r for r in records}
    ms = lambda *key: at[key]["ms"] if key in at else None
    lines = ["| sequences | pass | layout | allgather ms | FLA KCP ms | allgather / KCP (< 1: met) "
             "| all_to_all / allgather (>= 1.3: met) | allgather rate (>= "
             + ", >= ".join(f"{TARGET_RATE[p]:.2f} {p}" for p in PASSES) + ": met) |",
             "|---|---|---|---|---|---|---|---|"]
    for nseq, passes, layout in sorted({(r["nseq"], r["pass"], layout_of(r)) for r in records}):
        ag = ms("allgather", layout, nseq, passes)
        kcp = ms("fla-kcp", layout, nseq, passes)
        a2a = ms("all_to_all", "contiguous", nseq, passes)
        share = _share(at.get(("allgather", layout, nseq, passes)), none, W)
        rate = share / ag if share else None
        lines.append(f"| {nseq} | {passes} | {layout} | {_ms(ag)} | {_ms(kcp)} | "
                     f"{_ratio(ag, kcp)} | {_ratio(a2a, ag)} | {_ms(rate)} |")
    return lines


def ops_of(records: list[dict]) -> list[str]:
    """The ops the records time, in OPS order."""
    return [op for op in OPS if any(r["op"] == op for r in records)]


def markdown(records: list[dict]) -> str:
    """The setting, then per op every record with its rate and overhead against the run
    without CP, and the target table per sequences, pass and CP layout."""
    W = max(r["W"] for r in records)
    first = records[0]
    lines = ["# Context-parallel benchmark", "",
             f"Device: {W} x {first['device']}; T = {first['T']}, H = {first['H']}, "
             f"K = V = {first['K']}, bf16, B = 1, median ms per call.", "",
             "rate = (t_none / W) / t (1.0 is a perfect split); overhead = t - t_none / W: what "
             "CP adds to this device's share of the work (summary, collectives, merge). layout: "
             "how the sequence is split over the devices (contiguous or zigzag).", "",
             "Target: allgather faster than FLA's KCP, >= 1.3x faster than all_to_all, and its "
             "rate >= " + ", >= ".join(f"{TARGET_RATE[p]:.2f} {p}" for p in PASSES) + "."]
    for op in ops_of(records):
        mine = [r for r in records if r["op"] == op]
        lines += ["", f"## {op.upper()}", "", *_records_table(mine, W), "",
                  *_target_table(mine, W)]
    return "\n".join(lines) + "\n"


def add_shape_flags(ap: argparse.ArgumentParser) -> None:
    """--T, --H, --D and --devices, as this benchmark and the CP profiles take them."""
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--devices", type=int, default=None,
                    help="CP size W (default: all GPUs, or 4 fake CPU devices)")


def check_positive(ap: argparse.ArgumentParser, args, flags) -> None:
    """ap.error for any of `flags` (attribute names) below 1, and for a --devices below 1."""
    for flag in flags:
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    if args.devices is not None and args.devices < 1:
        ap.error("--devices must be positive")


def comma_list(ap: argparse.ArgumentParser, flag: str, value: str, allowed) -> tuple[str, ...]:
    """The names of a comma-list flag, each one of `allowed` (else ap.error)."""
    names = tuple(value.split(","))
    if not set(names) <= set(allowed):
        ap.error(f"{flag}: comma list of " + ", ".join(allowed))
    return names


def run_fla(args, W: int) -> list[dict]:
    """FLA's records from W ranks under torchrun (``fla_worker``): those measured within
    --fla-timeout seconds (the child is stopped then, with a note), each printed as it
    comes."""
    child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                              f"--nproc_per_node={W}", "-m", __spec__.name, "--fla-worker",
                              "--T", str(args.T), "--H", str(args.H), "--D", str(args.D),
                              "--iters", str(args.iters), "--layouts", args.layouts,
                              "--ops", args.ops, "--cp-layouts", args.cp_layouts],
                             stdout=subprocess.PIPE, text=True)
    stop = threading.Timer(args.fla_timeout, child.terminate)
    stop.start()
    records = []
    for line in child.stdout:
        if line.startswith("{"):
            r = json.loads(line)
            records.append(r)
            print(f"FLA {r['op']} {r['strategy']} {r['layout']} nseq {r['nseq']} {r['pass']}: "
                  f"{r['ms']:.3f} ms", flush=True)
    child.wait()
    stop.cancel()
    if child.returncode != 0:
        print(f"FLA stopped (exit {child.returncode}) after {len(records)} records", flush=True)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench.cp",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--report", help="write .md and .png from these records and exit")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    add_shape_flags(ap)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--backend", default="pallas", choices=["pallas", "xla", "interpret"])
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="comma list of single (one sequence), packed (10 sequences)")
    ap.add_argument("--cp-layouts", default="contiguous",
                    help="comma list of " + ", ".join(CP_LAYOUTS) + " (allgather and FLA's KCP)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-timeout", type=int, default=600,
                    help="seconds FLA's records may take (what was measured is kept)")
    ap.add_argument("--compile-threads", type=int, default=8,
                    help="programs compiled at once (1: one at a time)")
    ap.add_argument("--fla-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_positive(ap, args, ("T", "H", "D", "iters", "compile_threads", "fla_timeout"))
    ops = comma_list(ap, "--ops", args.ops, OPS)
    names = comma_list(ap, "--layouts", args.layouts, LAYOUTS)
    cp_layouts = comma_list(ap, "--cp-layouts", args.cp_layouts, CP_LAYOUTS)
    strategies = comma_list(ap, "--strategies", args.strategies, STRATEGIES)
    if args.report:
        from benchmarks import pages
        try:
            print("wrote " + ", ".join(pages.write(args.report, record_kind="cp")))
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--report {args.report}: {e}")
        return 0
    if args.fla_worker:
        fla_worker(ops, args.T, args.H, args.D, args.iters, names, cp_layouts)
        return 0
    gpus = host_devices(args.devices)
    W = args.devices or (gpu_count() if gpus else 4)
    pieces = 2 * W if "zigzag" in cp_layouts else W
    if args.T % pieces:
        ap.error(f"--T must divide into {pieces} pieces (W = {W}, --cp-layouts {args.cp_layouts})")
    records = run_fla(args, W) if gpus and not args.no_fla else []
    save = saver(args.json, records)
    save()
    import jax

    if len(jax.devices()) < W:
        ap.error(f"--devices {W}: JAX sees {len(jax.devices())} devices")
    records += run_jaxcp(ops, args.T, args.H, args.D, W, args.iters, strategies, args.backend,
                         save, names, cp_layouts, args.compile_threads)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
