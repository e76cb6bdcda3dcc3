"""What the context-parallel op adds to a device's share of the work, taken apart by
removing one piece at a time: jaxcp's allgather (GDN or KDA) on W devices, timed as

    share         the op without CP on one device, on T / W tokens: the ideal per device
    cp            the allgather call as shipped
    no collective the all-gather replaced by this device's own summaries, repeated W times
                  (same shapes, same merge, no communication)
    no exchange   no cross-device step: zero entry states and exit cotangents (no summary,
                  no all-gather, no merge)

so that cp - no collective is what the all-gather costs (waiting for the slowest device
included), no collective - no exchange what the summaries and merges cost, and
no exchange - share what running the pieces apart costs. The three substitutes give wrong
numbers: they exist to be timed. Times are ``benchmarks.timing.pipelined_ms`` of the jitted
calls on ``benchmarks.bench.cp``'s inputs (contiguous layout).

    python -m benchmarks.profile.cp_overhead --ops gdn,kda --T 32768 --H 64 --D 128
    python -m benchmarks.profile.cp_overhead --ops gdn --T 262144 --H 16 --passes fwd+bwd

Without GPUs it runs on fake CPU devices (``benchmarks.bench.cp.host_devices``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys

from benchmarks.bench import cp
from benchmarks.profile import cp as profile_cp

VARIANTS = ("share", "cp", "no collective", "no exchange")


def _local_gather(ex, per_piece):
    """``cp.exchange._gather_summaries`` without communication: this device's summaries
    stand in for every device's."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jaxcp.cp.split import in_sequence_order

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_piece)
    W = lax.axis_size(ex.axis)
    repeated = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (W, *a.shape)), stacked)
    return jax.tree.map(lambda a: in_sequence_order(a, ex.layout), repeated)


def _zero_entry_states(ex, stages, terms, layouts, init, segments=1):
    """``cp.exchange.entry_states`` with no cross-device step: zero states, zero M."""
    import jax.numpy as jnp
    from jaxcp.cp.exchange import zero_state

    zeros = [zero_state(t) for t in terms]
    if ex is None:
        return zeros, [None] * len(terms)
    K = terms[0].w.shape[-1]
    B, HV = zeros[0].shape[:2]
    return zeros, [(jnp.zeros((B, HV, K, K), jnp.float32), jnp.zeros((B,), jnp.int32))
                   for _ in terms]


def _zero_exit_cotangents(ex, stages, terms, layouts, do, d_final, ms, segments=1):
    from jaxcp.cp.exchange import zero_state
    return [zero_state(t) for t in terms]


@contextlib.contextmanager
def substituted(variant: str):
    """Within: the op traced as `variant` ("cp" and "share" as shipped)."""
    import jaxcp.core as core
    import jaxcp.cp.exchange as exchange

    saved = exchange._gather_summaries, core.entry_states, core.exit_cotangents
    if variant == "no collective":
        exchange._gather_summaries = _local_gather
    elif variant == "no exchange":
        core.entry_states, core.exit_cotangents = _zero_entry_states, _zero_exit_cotangents
    try:
        yield
    finally:
        exchange._gather_summaries, core.entry_states, core.exit_cotangents = saved


def measure(ops, T: int, H: int, D: int, W: int, passes, backend: str, iters: int) -> list[dict]:
    """Per op, pass and ``VARIANTS`` entry: ms per call. Every variant is traced and
    lowered under its substitution, then compiled and timed."""
    import jax.numpy as jnp
    from benchmarks.timing import pipelined_ms

    mesh = cp.seq_mesh(W)
    rows = []
    for op in ops:
        whole = cp.inputs(op, T, H, D)
        share = tuple(x[:, :T // W] for x in whole)
        split = cp.placed(whole, mesh, "contiguous")
        for passes_ in passes:
            for variant in VARIANTS:
                if variant == "share":
                    call, xs = cp.op_call(op, jnp.asarray([0, T // W], jnp.int32), backend), share
                else:
                    call = cp.op_call(op, jnp.asarray([0, T], jnp.int32), backend, "allgather",
                                      "contiguous", mesh)
                    xs = split
                with substituted(variant):
                    lowered = cp.jitted(call, passes_).lower(*xs)
                ms = pipelined_ms(lowered.compile(), *xs, iters=iters)
                rows.append(dict(op=op, **{"pass": passes_}, variant=variant, ms=ms))
                print(f"{op} {passes_:8} {variant:14} {ms:9.3f} ms", flush=True)
    return rows


def markdown(rows: list[dict], title: str) -> str:
    """Per op and pass: the four times and the differences they give."""
    lines = [f"# {title}", "",
             "| op | pass | share | cp | no collective | no exchange | all-gather | "
             "summaries and merges | pieces apart |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["op"], r["pass"]) for r in rows)
    for op, passes_ in keys:
        t = {r["variant"]: r["ms"] for r in rows if (r["op"], r["pass"]) == (op, passes_)}
        lines.append(f"| {op} | {passes_} | {t['share']:.3f} | {t['cp']:.3f} | "
                     f"{t['no collective']:.3f} | {t['no exchange']:.3f} | "
                     f"{t['cp'] - t['no collective']:.3f} | "
                     f"{t['no collective'] - t['no exchange']:.3f} | "
                     f"{t['no exchange'] - t['share']:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile.cp_overhead",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(cp.OPS), help="comma list of gdn, kda")
    ap.add_argument("--passes", default=",".join(cp.PASSES), help="comma list of fwd, fwd+bwd")
    cp.add_shape_flags(ap)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default="pallas", choices=["pallas", "xla", "interpret"])
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    args = ap.parse_args(argv)
    cp.check_positive(ap, args, ("T", "H", "D", "iters"))
    ops = cp.comma_list(ap, "--ops", args.ops, cp.OPS)
    passes = cp.comma_list(ap, "--passes", args.passes, cp.PASSES)
    return ap, args, ops, passes


def main(argv=None) -> int:
    ap, args, ops, passes = parse_args(argv)
    cp.host_devices(args.devices)
    import jax

    W = profile_cp.cp_world(ap, args)
    if args.T % W:
        ap.error(f"--T must divide into {W} pieces")
    rows = measure(ops, args.T, args.H, args.D, W, passes, args.backend, args.iters)
    text = markdown(rows, f"CP overhead, {W} x {jax.devices()[0].device_kind}: T = {args.T}, "
                          f"H = {args.H}, K = V = {args.D}, bf16, one sequence, backend "
                          f"{args.backend}")
    profile_cp.write_text(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
