"""Intra-chunk stages in jnp: gate cumsum, gated inner products, the WY representation.

Layout: a leading batch of chunks (any number of axes, "..."), then the chunk of C tokens.
q, k [..., C, K]; v [..., C, V]; g [..., C, Kg] with Kg = ``Gate.width(K)``: 1 for the
scalar gate (GDN), K for the per-channel gate (KDA); beta [..., C]. All float32.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

from jaxcp.gate import Gate
from jaxcp.terms import ChunkTerms, einsum
from jaxcp.vma import vary_like

def chunk_local_cumsum(g: jax.Array) -> jax.Array:
    """G_i = sum_{s <= i} g_s within each chunk. g [..., C, Kg] -> [..., C, Kg]."""
    return jnp.cumsum(g, axis=-2)


def _causal_mask(n: int, inclusive: bool) -> jax.Array:
    i = jnp.arange(n)
    return (i[:, None] >= i[None, :]) if inclusive else (i[:, None] > i[None, :])


def _column(G, G_j, mask_j):
    """E_ijd = exp(G_id - G_jd) on the rows i that see column j, else 0: [..., C, D]."""
    return jnp.exp(jnp.where(mask_j[:, None], G - G_j[..., None, :], -jnp.inf))


def _gated_columns(x, y, G, inclusive):
    """P[:, j] = sum_d x_d y_jd exp(G_d - G_jd), masked, one column j at a time."""
    mask = _causal_mask(x.shape[-2], inclusive)

    def column(j, out):
        e = _column(G, G[..., j, :], mask[:, j])
        col = einsum("...id,...d->...i", x * e, y[..., j, :])
        return out.at[..., j].set(col)

    out = jnp.zeros(x.shape[:-1] + (x.shape[-2],), x.dtype)
    return lax.fori_loop(0, x.shape[-2], column, vary_like(out, x))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _channel_gated_inner(x, y, g, inclusive):
    """Per-channel gate, one column j at a time so that no [C, C, D] tensor exists, in the
    forward or the backward, with G the chunk cumsum of the decay g."""
    return _gated_columns(x, y, chunk_local_cumsum(g), inclusive)


def _channel_gated_inner_fwd(x, y, g, inclusive):
    G = chunk_local_cumsum(g)
    return _gated_columns(x, y, G, inclusive), (x, y, G)


def _channel_gated_inner_bwd(inclusive, res, ct):
    """The term t_ij of pair (i, j) enters G_i and leaves G_j, so through the cumsum it
    reaches dg_s for j < s <= i only. dg sums those spans directly: the pairs that lie past
    s on both ends never enter dg_s, where a dG per row followed by the cumsum's transpose
    would add and cancel them (with G near -160 under a gate bound, their rounding is
    most of dg's error; docs/precision.md)."""
    x, y, G = res
    C = x.shape[-2]
    mask = _causal_mask(C, inclusive)
    rows = jnp.arange(C)[:, None]

    def column(j, grads):
        dx, dy, dg = grads
        y_j, ct_j = y[..., j, :], ct[..., :, j]
        e = _column(G, G[..., j, :], mask[:, j])
        ce = ct_j[..., None] * e                                  # [..., C, D]
        dx = dx + ce * y_j[..., None, :]
        dy = dy.at[..., j, :].set(jnp.sum(ce * x, axis=-2))
        t = ce * x * y_j[..., None, :]
        from_s = jnp.flip(jnp.cumsum(jnp.flip(t, -2), axis=-2), -2)   # sum over i >= s
        dg = dg + jnp.where(rows > j, from_s, 0.0)
        return dx, dy, dg

    zeros = (jnp.zeros_like(x), jnp.zeros_like(y), jnp.zeros_like(G))
    return lax.fori_loop(0, C, column, vary_like(zeros, ct))


_channel_gated_inner.defvjp(_channel_gated_inner_fwd, _channel_gated_inner_bwd)


def gated_inner(x: jax.Array, y: jax.Array, g: jax.Array, *, inclusive: bool,
                gate: Gate) -> jax.Array:
    """P_ij = sum_d x_id y_jd exp(G_id - G_jd) for j < i (j <= i if inclusive), else 0,
    with G the chunk cumsum of the decay g.

    x, y [..., C, D]; g [..., C, Kg] with Kg = gate.width(D). Only differences G_i - G_j
    with j before i are exponentiated, so decays (g <= 0) never overflow. Scalar gate:
    (x y^T) * exp(G_i - G_j). Per-channel gate: column by column.
    """
    if gate is Gate.SCALAR:
        Gs = chunk_local_cumsum(g)[..., 0]
        mask = _causal_mask(x.shape[-2], inclusive)
        decay = jnp.exp(jnp.where(mask, Gs[..., :, None] - Gs[..., None, :], -jnp.inf))
        return einsum("...id,...jd->...ij", x, y) * decay
    return _channel_gated_inner(x, y, g, inclusive)


def intra_chunk(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                scale: float, *, gate: Gate, with_inverse: bool = False) -> ChunkTerms:
    """The chunk-local part of the delta rule (see the module docstring): gate cumsum, the
    gated kk^T, the unit-lower-triangular solve for w and u, and the output's qk^T; with
    with_inverse also (I + A)^-1. g [..., C, gate.width(K)]."""
    G = chunk_local_cumsum(g)
    C = k.shape[-2]
    A = beta[..., :, None] * gated_inner(k, k, g, inclusive=False, gate=gate)
    L = A + jnp.eye(C, dtype=A.dtype)
    solve = partial(solve_triangular, lower=True, unit_diagonal=True)
    w = solve(L, k * jnp.exp(G) * beta[..., None])
    u = solve(L, v * beta[..., None])
    G_last = G[..., -1:, :]
    inv = solve(L, jnp.broadcast_to(jnp.eye(C, dtype=L.dtype), L.shape)) if with_inverse else None
    return ChunkTerms(
        w=w,
        u=u,
        qg=q * jnp.exp(G) * scale,
        kd=k * jnp.exp(G_last - G),
        decay=jnp.exp(G_last[..., 0, :]),
        attn=gated_inner(q, k, g, inclusive=True, gate=gate) * scale,
        inv=inv,
    )
