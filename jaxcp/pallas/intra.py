"""Pallas (Triton-lowered) intra-chunk terms of GDN: gate cumsum, kk^T, the unit-lower
triangular inverse, w, u, and the gated qk^T, fused in one kernel per (chunk, batch, head).

Twin of ``jaxcp.xla.intra.intra_chunk`` for a scalar gate (Kg = 1), same layout: q, k
[NT, B, HV, C, K], v [NT, B, HV, C, V], g [NT, B, HV, C, 1], beta [NT, B, HV, C], float32.

    G     = cumsum(g)                                   (within the chunk)
    A     = strict_lower(beta_i (k_i . k_j) exp(G_i - G_j))
    T     = (I + A)^-1         by forward substitution, row i = e_i - sum_j A_ij T_j
    w     = T (beta k exp(G)),  u = T (beta v)
    qg    = scale q exp(G),     kd = k exp(G_C - G),    decay = exp(G_C)
    attn  = lower(scale (q_i . k_j) exp(G_i - G_j))
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.state import _params
from jaxcp.vma import unify
from jaxcp.xla.intra import ChunkTerms


def _dot(a, b, precise: bool):
    """a @ b of fp32 tiles: IEEE fp32 when precise, else the GPU default TF32 (enough for
    bf16 inputs; IEEE fp32 made this kernel 10x slower on the H100)."""
    precision = lax.Precision.HIGHEST if precise else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower [n, n] a, by forward substitution over the rows."""
    n = a.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    lanes = lax.broadcasted_iota(jnp.int32, (n,), 0)

    def substitute(i, inv):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)               # row i of a
        row = jnp.where(lanes == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * inv, axis=0)
        return jnp.where(rows == i, row[None, :], inv)

    return lax.fori_loop(1, n, substitute, jnp.where(rows == cols, 1.0, 0.0))


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kd_ref, attn_ref,
                  *, scale, precise):
    f32 = jnp.float32
    q, k, v = q_ref[...].astype(f32), k_ref[...].astype(f32), v_ref[...].astype(f32)
    g, beta = g_ref[...].astype(f32), beta_ref[...].astype(f32)
    C = k.shape[0]
    G = jnp.cumsum(g)
    rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    cols = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    diff = G[:, None] - G[None, :]
    strict = jnp.exp(jnp.where(rows > cols, diff, -jnp.inf))
    causal = jnp.exp(jnp.where(rows >= cols, diff, -jnp.inf))
    dot = partial(_dot, precise=precise)
    inv = _unit_lower_inverse(beta[:, None] * dot(k, k.T) * strict)
    eg = jnp.exp(G)
    w_ref[...] = dot(inv, k * (beta * eg)[:, None])
    u_ref[...] = dot(inv, v * beta[:, None])
    qg_ref[...] = q * (eg * scale)[:, None]
    kd_ref[...] = k * jnp.exp(jnp.sum(g) - G)[:, None]
    attn_ref[...] = dot(q, k.T) * causal * scale


def intra_chunk(q, k, v, g, beta, scale: float, *, interpret: bool = False,
                precise: bool = True) -> ChunkTerms:
    """Twin of xla.intra.intra_chunk for GDN (g [..., C, 1]); precise=False lets the GPU
    run the products in TF32 (for bf16 inputs)."""
    NT, B, HV, C, K = k.shape
    V = v.shape[-1]
    tile = lambda d: pl.BlockSpec((None, None, None, C, d), lambda t, b, h: (t, b, h, 0, 0))
    vec = pl.BlockSpec((None, None, None, C), lambda t, b, h: (t, b, h, 0))
    args, mat = unify([q, k, v, g[..., 0], beta])
    out = lambda *s: jax.ShapeDtypeStruct((NT, B, HV) + s, jnp.float32, manual_axis_type=mat)
    w, u, qg, kd, attn = pl.pallas_call(
        partial(_intra_kernel, scale=scale, precise=precise), grid=(NT, B, HV),
        in_specs=[tile(K), tile(K), tile(V), vec, vec],
        out_specs=[tile(K), tile(V), tile(K), tile(K), tile(C)],
        out_shape=[out(C, K), out(C, V), out(C, K), out(C, K), out(C, C)],
        **_params(interpret, 0))(*args)
    decay = jnp.exp(jnp.sum(g, axis=-2))
    return ChunkTerms(w=w, u=u, qg=qg, kd=kd, decay=decay, attn=attn)
