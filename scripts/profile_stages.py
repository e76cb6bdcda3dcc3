"""Time each stage of the Pallas GDN pipeline alone on the current device (jitted, median ms).

    python scripts/profile_stages.py --T 32768 --H 64 --D 128

Stages, as ``backend="pallas"`` runs them for bf16 inputs: the layout (pad + transpose to
chunks), the intra-chunk terms, the forward state recurrence fused with the output (what
the forward runs), the forward recurrence that stores h and v_new (what the backward
recomputes), the reverse recurrence, and the input cotangents; then the whole op. Rows
marked "variant" re-time a stage with another tile or warp count (not what ships).
"""
from __future__ import annotations

import argparse
from functools import partial

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
    from jax.experimental.pallas import triton as pltriton
    import jaxcp
    from jaxcp import xla
    from jaxcp.layout import build_layout, num_chunks, to_chunks
    from jaxcp.pallas import grads as pgrads
    from jaxcp.pallas import intra as pintra
    from jaxcp.pallas import state as pstate

    T, H, D, C = args.T, args.H, args.D, 64
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    l2 = lambda x: (x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6))
    q, k, v = l2(r(1, T, H, D)), l2(r(1, T, H, D)), r(1, T, H, D)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((1, T, H, 1)), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H).astype(jnp.float32))
    layout, tmap = build_layout(1, T, C, None, 0, T)
    NT = num_chunks(T, C, None)
    scale = D ** -0.5
    bf16 = jnp.dtype(jnp.bfloat16)
    rows = []

    def timed(name, fn, *xs):
        fn = jax.jit(fn)
        ms = median_ms(fn, *xs, iters=args.iters, warmup=0)
        rows.append((name, ms))
        print(f"{name:44} {ms:9.3f} ms", flush=True)
        return fn(*xs)

    chunks = timed("layout: to_chunks (q, k, v bf16; g, beta fp32)", lambda *xs: tuple(
        to_chunks(x, tmap, NT, C) for x in xs), q, k, v, g, beta)
    intra = partial(pintra.intra_chunk, scale=scale, precise=False, out_dtype=bf16)
    terms = timed("intra_chunk", lambda *xs: intra(*xs), *chunks)
    terms = timed("intra_chunk with the inverse (backward)",
                  lambda *xs: intra(*xs, with_inverse=True), *chunks)
    h0 = jnp.zeros((1, H, D, D), jnp.float32)
    timed("state_output (fwd recurrence + output)", lambda t: pstate.state_output(
        t, layout, None, h0, False, dot_dtype=bf16)[0], terms)
    h, vn, _ = timed("state_fwd (stores h, v_new)", lambda t: pstate.state_fwd(
        t, layout, None, h0, dot_dtype=bf16), terms)
    do = r(*vn.shape)
    _, _, x, dvn = timed("state_bwd", lambda t, d: pstate.state_bwd(
        t, layout, d, None, h0, dot_dtype=bf16), terms, do)
    grads = lambda *xs: pgrads.chunk_grads(*xs[:5], scale, *xs[5:], precise=False)
    timed("chunk_grads", grads, *chunks, terms, h, vn, x, dvn, do)
    f32 = lambda x: x.astype(jnp.float32)
    timed("variant: chunk_grads (xla)", lambda *xs: xla.chunk_grads(
        *map(f32, xs[:5]), scale, None, *xs[5:]), *chunks, h, vn, x, dvn, do)

    for bv in (32, 16):
        pstate._block_cols = lambda n, k, bv=bv: min(n, bv)
        timed(f"variant: state_output BV={bv}", lambda t: pstate.state_output(
            t, layout, None, h0, False, dot_dtype=bf16)[0], terms)
    for warps, stages in ((8, 1), (4, 2)):
        params = lambda interpret, *_, w=warps, n=stages: {
            "compiler_params": pltriton.CompilerParams(num_warps=w, num_stages=n)}
        pintra._params, pgrads._params = params, params
        timed(f"variant: intra_chunk {warps} warps, {stages} stages",
              lambda *xs: intra(*xs), *chunks)
        timed(f"variant: chunk_grads {warps} warps, {stages} stages", grads,
              *chunks, terms, h, vn, x, dvn, do)

    import importlib
    for mod in (pstate, pintra, pgrads):
        importlib.reload(mod)
    op = partial(jaxcp.chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True, backend="pallas")
    xs = (q, k, v, g[..., 0], beta.astype(jnp.bfloat16))
    timed("op forward", lambda *a: op(*a)[0], *xs)
    wo = r(1, T, H, D)
    loss = lambda *a: jnp.sum(op(*a)[0].astype(jnp.float32) * wo)
    timed("op forward+backward", jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *xs)

    print(f"\ndevice={jax.devices()[0].device_kind} jax={jax.__version__} T={T} H={H} D={D}")
    print("| stage | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
