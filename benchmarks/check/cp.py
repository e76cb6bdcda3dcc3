"""GDN and KDA with context parallelism vs a single device: errors and times, as a table.

Runs on the GPUs when there are some, else on fake CPU devices (--devices of them). For each
op and CP strategy: relative errors of o, the final states and the gradients (q, k, v, g,
beta, initial_state) of CP against the single-device call, and median times of the jitted
forward and forward+backward.

    python -m benchmarks.check.cp                               # defaults, 8 CPU devices
    python -m benchmarks.check.cp --T 32768 --H 16 --K 128 --V 128 --varlen 0,2960,5212,32768
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.check.cp",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="gdn,kda", help="comma list of gdn, kda")
    ap.add_argument("--strategies", default="allgather,all_to_all,relay")
    ap.add_argument("--devices", type=int, default=None,
                    help="CP size (default: all GPUs, or 8 fake CPU devices)")
    ap.add_argument("--T", type=int, default=1536, help="total tokens (divisible by --devices)")
    ap.add_argument("--H", type=int, default=8, help="q/k heads")
    ap.add_argument("--HV", type=int, default=None, help="v heads (default H)")
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--varlen", default="auto",
                    help="cu_seqlens as comma list, 'auto' (a packed set crossing devices) "
                         "or 'none'")
    ap.add_argument("--iters", type=int, default=3, help="timed runs (median)")
    ap.add_argument("--backend", default=None, choices=["xla", "pallas", "mosaic", "interpret"],
                    help="jaxcp backend (default: automatic)")
    args = ap.parse_args(argv)
    for name in ("T", "H", "K", "V", "iters"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    return args, ap


def main(argv=None) -> int:
    args, ap = parse_args(argv)
    gpu = shutil.which("nvidia-smi") is not None
    if not gpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        n = args.devices or 8
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={n}")

    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jaxcp
    from benchmarks.timing import median_ms
    from jaxcp.metrics import rel_error

    W = args.devices or len(jax.devices())
    if W > len(jax.devices()):
        ap.error(f"--devices {W} but only {len(jax.devices())} devices are present")
    if args.T % W:
        ap.error(f"--T {args.T} must be divisible by the CP size {W}")
    HV = args.HV or args.H
    T = args.T
    if args.varlen == "none":
        cu = None
    elif args.varlen == "auto":
        # a 1-token sequence, sequences crossing 1 and (W >= 4) 2 and 3+ device boundaries,
        # and (W > 2) one ending on a device boundary
        tl = T // W
        points = {1, tl // 2, min(T - 1, 3 * tl + tl // 2), min(T - 1, 3 * tl + tl // 2 + 1)}
        if W > 2:
            points |= {2 * tl, 2 * tl + 5}
        cu = sorted(p for p in points if 0 < p < T)
        cu = [0] + cu + [T]
    else:
        try:
            cu = [int(x) for x in args.varlen.split(",")]
        except ValueError:
            ap.error("--varlen must be a comma list of integers, 'auto' or 'none'")
    dtype = jnp.dtype(args.dtype)
    mesh = Mesh(np.array(jax.devices()[:W]), ("seq",))
    cu_arr = None if cu is None else jnp.asarray(cu, jnp.int32)
    n_seqs = 1 if cu is None else len(cu) - 1

    timed = lambda fn, *xs: median_ms(fn, *xs, iters=args.iters, warmup=0)

    print(f"devices: {W} x {jax.devices()[0].device_kind}; jax {jax.__version__}; backend "
          f"{args.backend or 'auto'}; T={T} H={args.H} HV={HV} K={args.K} V={args.V} {args.dtype}; "
          f"cu_seqlens={cu}", flush=True)
    head = f"{'op':4} {'strategy':10} {'W':>2} {'err o':>9} {'err final':>9} {'err grads':>9} " \
           f"{'fwd ms':>9} {'fwd+bwd ms':>10}"
    print(head)
    print("-" * len(head))
    rows = []

    def emit(row):
        kind, strategy, w, eo, ef, eg, tf, tb = row
        rows.append(row)
        print(f"{kind:4} {strategy:10} {w:>2} {eo:9.2e} {ef:9.2e} {eg:9.2e} {tf:9.2f} {tb:10.2f}",
              flush=True)

    rng = np.random.default_rng(0)
    for kind in args.ops.split(","):
        if kind not in ("gdn", "kda"):
            ap.error(f"--ops: unknown op {kind!r}")
        op = jaxcp.chunk_gated_delta_rule if kind == "gdn" else jaxcp.chunk_kda
        r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        q, k, v = r(1, T, args.H, args.K), r(1, T, args.H, args.K), r(1, T, HV, args.V)
        g = jax.nn.log_sigmoid(r(1, T, HV) if kind == "gdn" else r(1, T, HV, args.K) + 2.0)
        beta = jax.nn.sigmoid(r(1, T, HV))
        xs = tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (r(n_seqs, HV, args.K, args.V),)
        wo = r(1, T, HV, args.V)

        def make(call):
            def loss(*a):
                o, final = call(*a)
                return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(final)
            fwd = jax.jit(call)
            both = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))
            return fwd, both

        kw = dict(cu_seqlens=cu_arr, use_qk_l2norm_in_kernel=True, output_final_state=True,
                  backend=args.backend)
        single = lambda q, k, v, g, beta, h0: op(q, k, v, g, beta, initial_state=h0, **kw)
        fwd1, both1 = make(single)
        o1, f1 = fwd1(*xs)
        grads1 = both1(*xs)[1]
        t1f, t1b = timed(fwd1, *xs), timed(both1, *xs)
        emit((kind, "none", 1, 0.0, 0.0, 0.0, t1f, t1b))
        for strategy in args.strategies.split(","):
            if strategy == "all_to_all" and args.H % W:
                print(f"{kind} all_to_all: skipped, H={args.H} not divisible by {W}", flush=True)
                continue
            seq = P(None, "seq")

            def body(q, k, v, g, beta, h0, strategy=strategy):
                return op(q, k, v, g, beta, initial_state=h0, cp_axis="seq",
                          cp_strategy=strategy, **kw)

            cp = jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 5 + (P(),),
                               out_specs=(seq, P()), check_vma=args.backend != "interpret")
            fwd, both = make(cp)
            o, f = fwd(*xs)
            grads = both(*xs)[1]
            err_g = max(rel_error(a, b) for a, b in zip(grads, grads1))
            emit((kind, strategy, W, rel_error(o, o1), rel_error(f, f1), err_g, timed(fwd, *xs),
                  timed(both, *xs)))
    worst = max(max(r[3:6]) for r in rows)
    limit = 1e-4 if args.dtype == "float32" else 1e-2
    print(f"worst relative error of CP vs single device: {worst:.2e} "
          f"({'ok' if worst < limit else 'FAIL'}, limit {limit:.0e})")
    return 0 if worst < limit else 1


if __name__ == "__main__":
    sys.exit(main())
