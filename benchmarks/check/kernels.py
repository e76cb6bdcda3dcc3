"""A backend against the float32 token reference on the current device: outputs and gradients.

    python -m benchmarks.check.kernels --backend pallas --T 1000 8192 --D 64 128 256

For each op, layout, T and K = V = D (bf16 inputs by default, q/k L2-normalised, initial
states): relative error of o, the final state and every gradient against the reference.
Layouts: "varlen" packs sequences (cu_seqlens, B = 1); "batch" is B = 2 rows of one sequence
each, without cu_seqlens (the GDN kernels read the tokens in place in both). Keys: "random" (independent normals) or "correlated" (the keys of a head share one
direction plus 10 % noise, with 10x weaker decay, as for the repeated tokens of real data,
where (I + A)^-1 is far from I). Limits: o < 5e-3, everything else < 1e-2 (bf16); 1e-4 in float32.
With --segments S the op runs each sequence as S segments (T divisible by S). With
--repeat N the op runs N times per case and must give the same bits every time (a
kernel that reads back what other threads wrote without a barrier would not; run with
XLA_FLAGS=--xla_gpu_deterministic_ops=true so that XLA's own reductions are deterministic
too); a case that does not shows NaN errors. --json writes one record per case, from which
``benchmarks.pages`` renders docs/benchmarks/gpu_checks.md (``markdown``). A record: op, layout,
keys, dtype, backend, T, D, H, segments, repeat (runs of the op that had to agree bit for
bit), errors
(relative error per name of NAMES against the float32 reference; NaN for all when the runs
disagreed), device, jax.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from jaxcp.metrics import rel_error

NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def limits(dtype: str) -> tuple[float, float]:
    """The limits for o and for everything else: bf16 5e-3 and 1e-2, float32 1e-4."""
    return (5e-3, 1e-2) if dtype == "bfloat16" else (1e-4, 1e-4)


def within_limits(errors: dict, dtype: str) -> bool:
    """Whether every error of a case is below its limit (NaN is not)."""
    lim_o, lim = limits(dtype)
    return errors["o"] < lim_o and all(errors[n] < lim for n in NAMES[1:])


def heads(H: int, D: int) -> int:
    """The heads of a case: H, a quarter of it above D = 128 (the reference keeps T states)."""
    return H if D <= 128 else max(1, H // 4)


def check(kind: str, backend: str, layout: str, T: int, D: int, H: int, dtype,
          keys: str = "random", repeat: int = 1, segments: int = 1) -> list[float]:
    """Relative errors (NAMES) of the op against the float32 reference on one random problem;
    NaN for all when `repeat` runs of the op on the same inputs do not agree bit for bit.
    segments: the op's (each sequence run as that many segments, ``jaxcp.cp.segments``)."""
    import jax
    import jax.numpy as jnp
    import jaxcp

    op = jaxcp.chunk_gated_delta_rule if kind == "gdn" else jaxcp.chunk_kda
    ref = jaxcp.gated_delta_rule_reference if kind == "gdn" else jaxcp.kda_reference
    rng = np.random.default_rng(T + D)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    H = heads(H, D)
    B = 1 if layout == "varlen" else 2
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    g = jax.nn.log_sigmoid(r(B, T, H) if kind == "gdn" else r(B, T, H, D) + 2.0)
    beta = jax.nn.sigmoid(r(B, T, H))
    if keys == "correlated":
        k = 0.1 * k + r(1, 1, H, D)
        g = g / 10
    cu = None
    if layout == "varlen":
        cuts = sorted({1, T // 3, T // 3 + 1, T // 2, (3 * T) // 4})
        cu = jnp.asarray([0] + [c for c in cuts if 0 < c < T] + [T], jnp.int32)
    h0 = r(B if cu is None else cu.shape[0] - 1, H, D, D) * 0.1
    xs = tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (h0,)
    wo, wf = r(B, T, H, D), r(*h0.shape)

    def loss(fn, **kw):
        def f(*a):
            o, final = fn(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=True, **kw)
            return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(final * wf), (o, final)
        return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))

    fn = loss(op, backend=backend, segments=segments)
    (_, (o, f)), grads = fn(*xs)
    for _ in range(repeat - 1):     # the same inputs must give the same bits (no races)
        (_, again), grads_again = fn(*xs)
        if not all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(
                jax.tree.leaves((o, f, grads)), jax.tree.leaves((again, grads_again)))):
            return [float("nan")] * len(NAMES)
    (_, (o_r, f_r)), grads_r = loss(ref)(*(x.astype(jnp.float32) for x in xs))
    return [rel_error(a, b) for a, b in zip([o, f, *grads], [o_r, f_r, *grads_r])]


def _sci(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def markdown(records: list[dict]) -> str:
    """Setting and limits, then one row per case: its errors and "ok" or "over"."""
    devices = sorted({r["device"] for r in records})
    versions = sorted({r["jax"] for r in records})
    backends = sorted({r["backend"] for r in records})
    lines = ["# GPU checks of the kernels", "",
             f"Device: {', '.join(devices)}; jax {', '.join(versions)}; backend "
             f"{', '.join(backends)}.", "",
             "Relative errors ||x - ref|| / ||ref|| of o, the final states and every gradient "
             "against the float32 token recurrence (`python -m benchmarks.check.kernels`): "
             "random inputs, "
             "q and k L2-normalised, initial states, random cotangents of o and the final states. "
             "Layouts: varlen (B = 1, packed sequences with a 1-token one), batch (B = 2, no "
             "cu_seqlens). Keys: random, or correlated (one direction per head plus 10 % noise, "
             "10x weaker decay). runs: how many runs of the op had to agree bit for bit.", "",
             "Limits: bf16 o < {}, the rest < {}; float32 everything < {}.".format(
                 *map(_sci, limits("bfloat16") + limits("float32")[:1])), "",
             "| device | op | layout | keys | dtype | T | D | H | runs | " + " | ".join(NAMES)
             + " | result |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(NAMES) + "---|"]
    for r in records:
        errs = " | ".join(f"{r['errors'][n]:.1e}" for n in NAMES)
        result = "ok" if within_limits(r["errors"], r["dtype"]) else "over"
        layout = r["layout"] + (f", {r['segments']} segments" if r.get("segments", 1) > 1
                                else "")
        lines.append(f"| {r['device']} | {r['op']} | {layout} | {r['keys']} | "
                     f"{r['dtype']} | {r['T']} | {r['D']} | {r['H']} | {r['repeat']} | "
                     f"{errs} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.check.kernels",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="pallas", choices=["pallas", "mosaic", "xla", "interpret"],
                    help="mosaic: GDN only (--ops gdn), bf16")
    ap.add_argument("--ops", default="gdn,kda")
    ap.add_argument("--T", type=int, nargs="+", default=[1000, 8192])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layouts", default="varlen,batch")
    ap.add_argument("--keys", default="random,correlated")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of the op per case, which must agree bit for bit")
    ap.add_argument("--segments", type=int, default=1,
                    help="run each sequence as this many segments (every --T divisible by it)")
    ap.add_argument("--json", help="write one record per case here")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be positive")
    if args.segments < 1 or any(T % args.segments for T in args.T):
        ap.error("--segments must be positive and divide every --T")
    layouts, key_kinds = args.layouts.split(","), args.keys.split(",")
    if not set(layouts) <= {"varlen", "batch"}:
        ap.error("--layouts: comma list of varlen, batch")
    if not set(key_kinds) <= {"random", "correlated"}:
        ap.error("--keys: comma list of random, correlated")
    if args.backend == "mosaic" and (args.ops != "gdn" or args.dtype != "bfloat16"):
        ap.error("--backend mosaic runs GDN in bfloat16: --ops gdn --dtype bfloat16")

    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0].device_kind
    records = []
    for kind in args.ops.split(","):
        for lay, keys in ((lay, keys) for lay in layouts for keys in key_kinds):
            for T in args.T:
                for D in args.D:
                    errs = check(kind, args.backend, lay, T, D, args.H, dtype, keys,
                                 args.repeat, args.segments)
                    r = dict(op=kind, layout=lay, keys=keys, dtype=args.dtype,
                             backend=args.backend, T=T, D=D, H=heads(args.H, D),
                             segments=args.segments, repeat=args.repeat,
                             errors=dict(zip(NAMES, errs)),
                             device=device, jax=jax.__version__)
                    records.append(r)
                    print(f"{kind} {lay} {keys} T={T} D={D}: " + " ".join(
                        f"{n}={e:.1e}" for n, e in zip(NAMES, errs))
                        + (" ok" if within_limits(r["errors"], args.dtype) else " FAIL"),
                        flush=True)

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(f"backend={args.backend} dtype={args.dtype} H={args.H} device={device}"
          f" jax={jax.__version__}")
    print(f"{'op':4} {'layout':6} {'keys':10} {'T':>6} {'D':>4} "
          + " ".join(f"{n:>8}" for n in NAMES) + "  result")
    ok = True
    for r in records:
        good = within_limits(r["errors"], args.dtype)
        ok &= good
        print(f"{r['op']:4} {r['layout']:6} {r['keys']:10} {r['T']:>6} {r['D']:>4} "
              + " ".join(f"{r['errors'][n]:8.1e}" for n in NAMES) + ("  ok" if good else "  FAIL"))
    lim_o, lim = limits(args.dtype)
    print(f"limits: o < {lim_o:.0e}, others < {lim:.0e}: {'all ok' if ok else 'FAILURES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
