"""Error of the product-form inverse (I + A)^-1 under TF32 products, emulated on the CPU.

    python scripts/inverse_precision.py --chunks 200

For random GDN chunks (C = 64, K = 128, L2-normalised k, beta = sigmoid, g = logsigmoid of
normals) it builds w = (I + A)^-1 X with the kernels' product form
(I - A)(I + A^2)...(I + A^(C/2)), every product rounded as the tensor cores would:

    tf32x1   both operands rounded to TF32 (10-bit mantissa), fp32 accumulation
    tf32x3   a_hi b_hi + a_hi b_lo + a_lo b_hi with a = a_hi + a_lo in TF32 (3 products)

and compares with a float64 solve; the bf16 rounding of w (how the kernels store it for bf16
inputs) is the yardstick. Prints median and max relative error over the chunks.
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


def product_form_solve(a, x, dot):
    """(I + a)^-1 x for strictly lower a [C, C], C a power of two."""
    inv, power, m = (np.eye(a.shape[0]) - a).astype(np.float32), a, 2
    while m < a.shape[0]:
        power = dot(power, power)
        inv = inv + dot(inv, power)
        m *= 2
    return dot(inv, x)


def random_chunk(rng, C: int, K: int):
    """(A, X) of one GDN chunk: A = strict_lower(beta_i k_i.k_j e^(G_i - G_j)), X = beta e^G k."""
    k = rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(C)))
    G = np.cumsum(-np.log1p(np.exp(-rng.standard_normal(C))))
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
    errors = {"tf32x1": [], "tf32x3": [], "bf16 rounding of w": []}
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    for _ in range(args.chunks):
        a, x = random_chunk(rng, args.C, args.K)
        exact = np.linalg.solve(np.eye(args.C) + a.astype(np.float64), x.astype(np.float64))
        errors["tf32x1"].append(rel(product_form_solve(a, x, dot_tf32x1), exact))
        errors["tf32x3"].append(rel(product_form_solve(a, x, dot_tf32x3), exact))
        errors["bf16 rounding of w"].append(rel(bf16(exact.astype(np.float32)), exact))
    print(f"| w = (I + A)^-1 X, C = {args.C}, K = {args.K}, {args.chunks} chunks | median | max |")
    print("|---|---|---|")
    for name, e in errors.items():
        print(f"| {name} | {np.median(e):.2e} | {np.max(e):.2e} |")


if __name__ == "__main__":
    main()
