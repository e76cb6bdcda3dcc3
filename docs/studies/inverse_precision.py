"""Error of the kernels' inverse (I + A)^-1 under TF32 products, emulated on the CPU.

    python docs/studies/inverse_precision.py --chunks 200

For GDN chunks (C = 64, K = 128, L2-normalised k, beta = sigmoid, g = logsigmoid of normals)
it builds w = (I + A)^-1 X in two ways, every product rounded as the tensor cores would:

    block merge    the kernels' function (jaxcp.pallas.triton.common.products.unit_lower_inverse):
                   T_2s = T_s - T_s N_s T_s over diagonal blocks of size s = 1, 2, ..., C/2
    power series   (I - A)(I + A^2)...(I + A^(C/2)), the alternative the kernels avoid: for
                   correlated keys the powers of A grow like binomial coefficients

    tf32x1   both operands rounded to TF32 (10-bit mantissa), fp32 accumulation
    tf32x3   a_hi b_hi + a_hi b_lo + a_lo b_hi with a = a_hi + a_lo in TF32 (3 products)

and compares with a float64 solve; the bf16 rounding of w (how the kernels store it for bf16
inputs) is the yardstick. Keys are independent ("random") or share one direction
("correlated", as the tokens of a trained model's repeated or padding positions do: this is
where the power series fails, with relative errors above 1). Prints
median and max relative error over the chunks.
"""
from __future__ import annotations

import argparse

import numpy as np


def round_mantissa(x: np.ndarray, drop_bits: int) -> np.ndarray:
    """float32 x rounded to nearest, keeping 23 - drop_bits mantissa bits."""
    bits = np.asarray(x, np.float32).copy().view(np.uint32)
    bits += np.uint32(1 << (drop_bits - 1))
    bits &= np.uint32((0xFFFFFFFF >> drop_bits) << drop_bits)
    return bits.view(np.float32)


def tf32(x):
    return round_mantissa(x, 13)


def bf16(x):
    return round_mantissa(x, 16)


def _f64_dot(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


def dot_tf32x1(a, b):
    return _f64_dot(tf32(a), tf32(b)).astype(np.float32)


def dot_tf32x3(a, b):
    a_hi, b_hi = tf32(a), tf32(b)
    a_lo, b_lo = tf32(a - a_hi), tf32(b - b_hi)
    return (_f64_dot(a_hi, b_hi) + _f64_dot(a_hi, b_lo) + _f64_dot(a_lo, b_hi)).astype(np.float32)


def block_merge_inverse(a, dot):
    """(I + a)^-1 for strictly lower a [C, C], C a power of two: the kernels' own function
    (``jaxcp.pallas.triton.common.products.unit_lower_inverse``) with the emulated products."""
    import jax.numpy as jnp
    from jaxcp.pallas.triton.common.products import unit_lower_inverse as _unit_lower_inverse

    f32 = lambda x: np.asarray(x, np.float32)
    return f32(_unit_lower_inverse(jnp.asarray(a, jnp.float32),
                                   lambda x, y: jnp.asarray(dot(f32(x), f32(y)))))


def power_series_inverse(a, dot):
    """(I + a)^-1 = (I - a)(I + a^2)(I + a^4)..., C a power of two."""
    inv, power, m = (np.eye(a.shape[0]) - a).astype(np.float32), a, 2
    while m < a.shape[0]:
        power = dot(power, power)
        inv = inv + dot(inv, power)
        m *= 2
    return inv


def random_chunk(rng, C: int, K: int, correlated: bool):
    """(A, X) of one GDN chunk: A = strict_lower(beta_i k_i.k_j e^(G_i - G_j)), X = beta e^G k."""
    k = rng.standard_normal((C, K))
    if correlated:
        k = k * 0.1 + rng.standard_normal(K)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(C)))
    G = np.cumsum(-np.log1p(np.exp(-rng.standard_normal(C))) / (10 if correlated else 1))
    decay = np.exp(np.tril(G[:, None] - G[None, :], -1)) * np.tri(C, k=-1)
    a = (beta[:, None] * (k @ k.T) * decay).astype(np.float32)
    x = (k * (beta * np.exp(G))[:, None]).astype(np.float32)
    return a, x


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--K", type=int, default=128)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    forms = {"block merge": block_merge_inverse, "power series": power_series_inverse}
    dots = {"tf32x1": dot_tf32x1, "tf32x3": dot_tf32x3}
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    print(f"| w = (I + A)^-1 X, C = {args.C}, K = {args.K}, {args.chunks} chunks | keys "
          f"| median | max |")
    print("|---|---|---|---|")
    with np.errstate(all="ignore"):
        for keys in ("random", "correlated"):
            errors = {}
            for _ in range(args.chunks):
                a, x = random_chunk(rng, args.C, args.K, keys == "correlated")
                exact = np.linalg.solve(np.eye(args.C) + a.astype(np.float64), x.astype(np.float64))
                for form, inverse in forms.items():
                    for name, dot in dots.items():
                        w = dot(inverse(a, dot), x)
                        errors.setdefault(f"{form}, {name}", []).append(rel(w, exact))
                errors.setdefault("bf16 rounding of w", []).append(
                    rel(bf16(exact.astype(np.float32)), exact))
            for name, e in errors.items():
                print(f"| {name} | {keys} | {np.median(e):.2e} | {np.max(e):.2e} |")


if __name__ == "__main__":
    main()
