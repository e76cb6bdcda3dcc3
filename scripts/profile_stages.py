"""Time each stage of the GDN pipeline alone on the current device (jitted, median ms).

    python scripts/profile_stages.py --T 32768 --H 64 --D 128

Stages: the layout (pad + transpose to chunks), the intra-chunk terms (XLA), the forward
state recurrence (XLA scan and Pallas), the output (XLA), the backward state recurrence
(XLA scan and Pallas). Inputs bf16 like the benchmark, terms float32.
"""
from __future__ import annotations

import argparse

from jax_timing import median_ms

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jaxcp import xla
    from jaxcp.layout import build_layout, num_chunks, to_chunks
    from jaxcp.pallas import state as pstate

    T, H, D, C = args.T, args.H, args.D, 64
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((1, T, H, 1)), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H))
    layout, tmap = build_layout(1, T, C, None, 0, T)
    NT = num_chunks(T, C, None)

    def timed(name, fn, *xs):
        fn = jax.jit(fn)
        print(f"{name:34} {median_ms(fn, *xs, iters=args.iters, warmup=0):9.3f} ms", flush=True)
        return fn(*xs)

    chunks = timed("layout: to_chunks x5 (fp32)", lambda *xs: tuple(
        to_chunks(x.astype(jnp.float32), tmap, NT, C) for x in xs), q, k, v, g, beta)
    l2 = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    terms = timed("intra_chunk (xla)", lambda q, k, v, g, b: xla.intra_chunk(
        l2(q), l2(k), v, g, b, D ** -0.5), *chunks)
    h0 = jnp.zeros((1, H, D, D), jnp.float32)
    h, vn, _ = timed("state_fwd (xla scan)", lambda t: xla.state_fwd(t, layout, None, h0), terms)
    for dt in ("float32", "bfloat16"):
        timed(f"state_fwd (pallas, {dt} dots)", lambda t: pstate.state_fwd(
            t, layout, None, h0, dot_dtype=jnp.dtype(dt)), terms)
    timed("chunk_output (xla)", xla.chunk_output, terms.qg, terms.attn, h, vn)
    do = jnp.asarray(rng.standard_normal(vn.shape), jnp.float32)
    timed("state_bwd (xla scan)", lambda t, d: xla.state_bwd(t, layout, d, None, h0), terms, do)
    for dt in ("float32", "bfloat16"):
        timed(f"state_bwd (pallas, {dt} dots)", lambda t, d: pstate.state_bwd(
            t, layout, d, None, h0, dot_dtype=jnp.dtype(dt)), terms, do)


if __name__ == "__main__":
    main()
