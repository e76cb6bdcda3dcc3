"""Intra-chunk stages in jnp: gate cumsum, gated inner products, the WY representation.

Layout: a leading batch of chunks (any number of axes, "..."), then the chunk of C tokens.
q, k [..., C, K]; v [..., C, V]; g [..., C, Kg] with Kg = 1 (GDN, scalar gate) or Kg = K
(KDA, per-channel gate); beta [..., C]. All float32.

With G = cumsum(g) inside the chunk (G_i = sum_{s <= i} g_s) and S_in the state entering the
chunk, the token recurrence over the chunk is, exactly:

    A      = strict_lower( beta_i * sum_d k_id k_jd exp(G_id - G_jd) )          [C, C]
    w      = (I + A)^-1 (beta * k * exp(G))                                     [C, K]
    u      = (I + A)^-1 (beta * v)                                              [C, V]
    v_new  = u - w S_in
    o      = (scale q exp(G)) S_in + lower( scale sum_d q_id k_jd exp(G_id - G_jd) ) v_new
    S_out  = Diag(exp(G_C)) S_in + (k exp(G_C - G))^T v_new

so the chunk is the affine map S_out = M S_in + S_ext with M = Diag(exp(G_C)) - kd^T w.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

SUBCHUNK = 16
einsum = partial(jnp.einsum, precision=lax.Precision.HIGHEST)


class ChunkTerms(NamedTuple):
    """What the state recurrence and the output need from one chunk.

    w [..., C, K]; u [..., C, V]; qg = scale q exp(G) [..., C, K]; kd = k exp(G_C - G)
    [..., C, K]; decay = exp(G_C) [..., Kg]; attn = lower(scale q_i . k_j exp(G_i - G_j))
    [..., C, C].
    """
    w: jax.Array
    u: jax.Array
    qg: jax.Array
    kd: jax.Array
    decay: jax.Array
    attn: jax.Array


def chunk_local_cumsum(g: jax.Array) -> jax.Array:
    """G_i = sum_{s <= i} g_s within each chunk. g [..., C, Kg] -> [..., C, Kg]."""
    return jnp.cumsum(g, axis=-2)


def _causal_mask(n: int, inclusive: bool) -> jax.Array:
    i = jnp.arange(n)
    return (i[:, None] >= i[None, :]) if inclusive else (i[:, None] > i[None, :])


def gated_inner(x: jax.Array, y: jax.Array, G: jax.Array, *, inclusive: bool) -> jax.Array:
    """P_ij = sum_d x_id y_jd exp(G_id - G_jd) for j < i (j <= i if inclusive), else 0.

    x, y [..., C, D]; G [..., C, Kg] non-increasing along C (log decays are <= 0).
    Scalar gate (Kg = 1): (x y^T) * exp(G_i - G_j). Per-channel gate: blocks of 16 tokens;
    diagonal blocks exactly, block (I, J < I) factored through the gate at the end of block
    I - 1, so every exponent is <= 0 and nothing overflows.
    """
    C, D = x.shape[-2], x.shape[-1]
    if G.shape[-1] == 1:
        Gs = G[..., 0]
        mask = _causal_mask(C, inclusive)
        decay = jnp.exp(jnp.where(mask, Gs[..., :, None] - Gs[..., None, :], -jnp.inf))
        return einsum("...id,...jd->...ij", x, y) * decay

    S = min(SUBCHUNK, C)
    NB = C // S
    batch = x.shape[:-2]
    xb = x.reshape(*batch, NB, S, D)
    yb = y.reshape(*batch, NB, S, D)
    Gb = G.reshape(*batch, NB, S, D)

    mask = _causal_mask(S, inclusive)[..., None]
    within = jnp.exp(jnp.where(mask, Gb[..., :, None, :] - Gb[..., None, :, :], -jnp.inf))
    diag = einsum("...id,...jd,...ijd->...ij", xb, yb, within)          # [..., NB, S, S]
    full = einsum("...Iij,IJ->...IiJj", diag, jnp.eye(NB, dtype=x.dtype))
    if NB > 1:
        ref = jnp.concatenate([Gb[..., :1, 0, :], Gb[..., :-1, -1, :]], axis=-2)  # [..., NB, D]
        left = xb * jnp.exp(Gb - ref[..., :, None, :])                  # [..., NB(I), S, D]
        before = _causal_mask(NB, inclusive=False)[:, :, None, None]    # J < I
        right = yb[..., None, :, :, :] * jnp.exp(jnp.where(
            before, ref[..., :, None, None, :] - Gb[..., None, :, :, :], -jnp.inf))
        full = full + einsum("...Iid,...IJjd->...IiJj", left, right)
    return full.reshape(*batch, C, C)


def intra_chunk(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                scale: float) -> ChunkTerms:
    """The chunk-local part of the delta rule (see the module docstring): gate cumsum, the
    gated kk^T, the unit-lower-triangular solve for w and u, and the output's qk^T."""
    G = chunk_local_cumsum(g)
    C = k.shape[-2]
    A = beta[..., :, None] * gated_inner(k, k, G, inclusive=False)
    L = A + jnp.eye(C, dtype=A.dtype)
    solve = partial(solve_triangular, lower=True, unit_diagonal=True)
    w = solve(L, k * jnp.exp(G) * beta[..., None])
    u = solve(L, v * beta[..., None])
    G_last = G[..., -1:, :]
    return ChunkTerms(
        w=w,
        u=u,
        qg=q * jnp.exp(G) * scale,
        kd=k * jnp.exp(G_last - G),
        decay=jnp.exp(G_last[..., 0, :]),
        attn=gated_inner(q, k, G, inclusive=True) * scale,
    )
