"""Error of the CP transition M's chain under the kernels' products, emulated on the CPU.

    python docs/studies/m_chain_precision.py --chunks 16 --trials 20

A device's summary carries M = prod_c (decay_c I - kd_c^T w_c) over its chunks (``cp_summary``,
M [K, K] from the identity). For random GDN chunks (C = 64, K = 128, L2-normalised k, beta =
sigmoid, mild gates g = 0.01 logsigmoid(normal)), with w and kd rounded to bf16 as the kernels
store them, it runs M <- decay M - kd^T (w M) with every product as

    ieee     float32 products (numpy)
    tf32x3   3xTF32 products (``inverse_precision.dot_tf32x3``), the kernels' fp32-input path
    bf16x2   the fp32 operand (M, then w M) split into two bf16 parts hi + lo, each
             multiplied by the bf16 tile exactly (``dot(split=True)`` of
             ``jaxcp.pallas.triton.common.products``), the kernels' bf16-input path

and compares with the same chain in float64. Prints the median and max relative error of M
over the trials, and |M| / |I|. Each chunk projects out most of its keys' directions, so M
shrinks fast even with mild gates (~1e-5 after 16 chunks); far beyond that the float32 chain
underflows and a relative error means nothing.
"""
from __future__ import annotations

import argparse

import numpy as np

from inverse_precision import _f64_dot, bf16, dot_tf32x3


def dot_bf16x2(tile, x):
    """tile @ x for a bf16-valued tile and an fp32 x taken as bf16 hi + lo, fp32 result."""
    hi = bf16(x)
    return (_f64_dot(tile, hi) + _f64_dot(tile, bf16(x - hi))).astype(np.float32)


def random_terms(rng, C: int, K: int):
    """(w, kd, decay) of one GDN chunk, w and kd rounded to bf16."""
    k = rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(C)))
    G = np.cumsum(-0.01 * np.log1p(np.exp(-rng.standard_normal(C))))
    decay = np.exp(np.tril(G[:, None] - G[None, :], -1)) * np.tri(C, k=-1)
    a = beta[:, None] * (k @ k.T) * decay
    w = np.linalg.solve(np.eye(C) + a, k * (beta * np.exp(G))[:, None])
    kd = k * np.exp(G[-1] - G)[:, None]
    return bf16(w.astype(np.float32)), bf16(kd.astype(np.float32)), np.float32(np.exp(G[-1]))


def chain(terms, dot, dtype):
    m = np.eye(terms[0][0].shape[1], dtype=dtype)
    for w, kd, decay in terms:
        m = (decay * m - dot(kd.T.astype(dtype), dot(w.astype(dtype), m))).astype(dtype)
    return m


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--K", type=int, default=128)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    errors, sizes = {"ieee": [], "tf32x3": [], "bf16x2": []}, []
    for _ in range(args.trials):
        terms = [random_terms(rng, args.C, args.K) for _ in range(args.chunks)]
        exact = chain(terms, np.matmul, np.float64)
        sizes.append(np.linalg.norm(exact) / np.sqrt(args.K))
        errors["ieee"].append(rel(chain(terms, np.matmul, np.float32), exact))
        errors["tf32x3"].append(rel(chain(terms, dot_tf32x3, np.float32), exact))
        errors["bf16x2"].append(rel(chain(terms, dot_bf16x2, np.float32), exact))
    print(f"| M over {args.chunks} chunks, C = {args.C}, K = {args.K}, {args.trials} trials "
          f"(median |M| / |I| = {np.median(sizes):.1e}) | median | max |")
    print("|---|---|---|")
    for name, e in errors.items():
        print(f"| {name} | {np.median(e):.2e} | {np.max(e):.2e} |")


if __name__ == "__main__":
    main()
