"""The CP attention's cuDNN pieces on a GPU: errors against a float32 reference, and times.

    python -m benchmarks.check.attention                       # checks, then times
    python -m benchmarks.check.attention --time-T 65536 --W 2  # times at another shape

Checks (bf16 inputs, T = --W x --T tokens, every device's share computed on this GPU as CP
computes it): the output and the q, k, v gradients of ``prefix_causal_attention`` with
``CudnnPieces`` against the same function on ``DensePieces`` in float32 (relative errors,
limit 1e-2), with and without grouped heads. Times (pipelined, ms) at --time-T tokens split
over --W devices: the last device's share (its queries over all keys, the most work) on the
cuDNN pieces and on the blockwise softmax, beside cuDNN's causal attention over the whole
sequence on one GPU; forward and forward+backward.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.timing import forward_backward, pipelined_ms
from jaxcp.metrics import rel_error


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.check.attention",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=1024, help="tokens per device in the checks")
    ap.add_argument("--W", type=int, default=4, help="devices simulated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--time-T", type=int, default=65536, help="whole sequence in the timings")
    args = ap.parse_args(argv)
    if min(args.T, args.W, args.heads, args.head_dim, args.time_T) <= 0:
        ap.error("sizes must be positive")
    if args.time_T % args.W:
        ap.error("--time-T must divide by --W")

    import jax
    import jax.numpy as jnp
    from jaxcp.attention import DensePieces, blockwise_attention, prefix_causal_attention
    from jaxcp.attention import cudnn

    if jax.default_backend() != "gpu" or not cudnn.available():
        print("needs a GPU and jax's cuDNN attention rules")
        return 1
    cudnn_pieces = cudnn.CudnnPieces()
    rng = np.random.default_rng(0)
    N, D, W = args.heads, args.head_dim, args.W

    def inputs(T, G):
        r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        return r(1, T, N, D), r(1, T, G, D), r(1, T, G, D), r(1, T, N, D)

    def by_devices(pieces, T, dtype):
        def run(q, k, v):
            q, k, v = (x.astype(dtype) for x in (q, k, v))
            part = lambda x, r: x[:, r * T:(r + 1) * T]
            return jnp.concatenate([prefix_causal_attention(part(q, r), part(k, r), part(v, r),
                                                            k, v, r * T, pieces)
                                    for r in range(W)], axis=1)
        return run

    worst = 0.0
    print(f"checks: W = {W} devices x T = {args.T}, {N} heads of {D}, bf16 (cuDNN) vs float32")
    for G in (N, max(1, N // 4)):
        q, k, v, wo = inputs(W * args.T, G)
        results = []
        for pieces, dtype in ((cudnn_pieces, jnp.bfloat16), (DensePieces(), jnp.float32)):
            f = by_devices(pieces, args.T, dtype)
            loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * wo)
            results.append((jax.jit(f)(q, k, v),
                            *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)))
        errs = [rel_error(a.astype(jnp.float32), b) for a, b in zip(*results)]
        worst = max(worst, *errs)
        print(f"  kv heads {G}: " + "  ".join(f"{n} {e:.2e}" for n, e in
                                              zip(("o", "dq", "dk", "dv"), errs)))
    ok = worst < 1e-2
    print(f"worst {worst:.2e}: {'ok' if ok else 'FAILED'}")

    T_all = args.time_T
    T = T_all // W
    q, k, v, _ = inputs(T_all, N)
    last = lambda x: x[:, (W - 1) * T:]
    pos = jnp.arange(T_all)
    zero = jnp.zeros_like(pos)
    jobs = {
        "whole sequence, cuDNN causal (one GPU)":
            (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                          implementation="cudnn"), (q, k, v)),
        f"last of {W} devices, cuDNN pieces":
            (lambda q, k, v: prefix_causal_attention(last(q), last(k), last(v), k, v,
                                                     (W - 1) * T, cudnn_pieces), (q, k, v)),
        f"last of {W} devices, blockwise":
            (lambda q, k, v: blockwise_attention(last(q), k, v, pos[(W - 1) * T:],
                                                 zero[(W - 1) * T:], pos, zero), (q, k, v)),
    }
    print(f"\ntimes (ms), {T_all} tokens, {N} heads of {D}, bf16")
    print("| attention | fwd | fwd+bwd |\n|---|---|---|")
    for name, (f, xs) in jobs.items():
        fwd = pipelined_ms(jax.jit(f), *xs, iters=10)
        both = pipelined_ms(jax.jit(forward_backward(f, range(3))), *xs, iters=10)
        print(f"| {name} | {fwd:.2f} | {both:.2f} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
