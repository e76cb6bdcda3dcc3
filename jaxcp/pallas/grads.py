"""Pallas (Triton-lowered) cotangents of GDN's chunk inputs, one program per (chunk, batch,
head): the cotangents of the chunk terms and the intra-chunk backward (WY included), fused.

Twin of ``jaxcp.xla.grads.chunk_grads``, same layout: q, k [NT, B, HV, C, K], v [NT, B,
HV, C, V], g [NT, B, HV, C, 1], beta [NT, B, HV, C]; from the recurrences h (state entering
each chunk) and X = dL/dS_out [NT, B, HV, K, V], v_new, dvn = dL/dv_new and do [NT, B, HV,
C, V]. The chunk's forward (``intra._chunk``: G, E, A, T = (I + A)^-1, X_k = beta exp(G) k)
is recomputed, then, with w = T X_k, u = T (beta v):

    per block of BV value columns (the [K, V] and [C, V] tiles never sit whole in registers):
        dw  -= dvn h^T,   dqg += do h^T,   dkd += v_new X^T,   dattn += do v_new^T,
        dY   = T^T dvn,   dA  -= dY u^T,   dv = beta dY,       dbeta += rowsum(dY o v),
        dG_C += sum(h o X) exp(G_C)
    then
        dXk = T^T dw,     dA -= dXk w^T,   Z = beta_i dA_ij E_ij,   D = scale lower(dattn o E)
        dq  = scale exp(G) dqg + D k
        dk  = (Z + Z^T) k + beta exp(G) dXk + exp(G_C - G) dkd + D^T q
        dbeta += rowsum(dA o kk^T o E) + exp(G) rowsum(dXk o k)
        dG  = rowsum(R) - colsum(R) + rowsum(P) - colsum(P) + rowsum(dXk o Xk)
              + rowsum(dqg o qg) - rowsum(dkd o kd) + [i = C] sum(dkd o kd)
              with R = dA o A (strict lower), P = dattn o attn
        dg  = reverse cumsum of dG within the chunk
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcp.pallas.intra import _chunk, _dots, _load, _specs
from jaxcp.pallas.state import _params
from jaxcp.vma import unify


def _value_blocks(V: int) -> int:
    """Value columns per step of the in-kernel loop."""
    return min(V, 64)


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h_ref, vn_ref, x_ref, dvn_ref, do_ref,
                  dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, scale, dots, bv):
    q, k, g, beta = _load(q_ref, k_ref, g_ref, beta_ref)
    dot = dots.plain
    c = _chunk(k, g, beta, dots)
    C, K = k.shape
    V = v_ref.shape[-1]
    dw = jnp.zeros((C, K), jnp.float32)
    dqg, dkd = dw, dw
    dattn = jnp.zeros((C, C), jnp.float32)
    da = dattn
    dbeta = jnp.zeros((C,), jnp.float32)
    d_decay = jnp.zeros((), jnp.float32)
    for j in range(V // bv):
        cols = pl.ds(j * bv, bv)
        h, x, v, vn, dvn, do = _load(h_ref.at[:, cols], x_ref.at[:, cols], v_ref.at[:, cols],
                                     vn_ref.at[:, cols], dvn_ref.at[:, cols], do_ref.at[:, cols])
        dw -= dot(dvn, h.T)
        dqg += dot(do, h.T)
        dkd += dot(vn, x.T)
        dattn += dot(do, vn.T)
        d_decay += jnp.sum(h * x)
        dy = dot(c.inv.T, dvn)
        da -= dot(dy, dot(c.inv, v * beta[:, None]).T)
        dv_ref[:, cols] = (dy * beta[:, None]).astype(dv_ref.dtype)
        dbeta += jnp.sum(dy * v, axis=1)
    w = dot(c.inv, c.x)
    dxk = dot(c.inv.T, dw)
    da -= dot(dxk, w.T)                       # only its strict lower part is used below
    z = beta[:, None] * da * c.strict
    attn = dot(q, k.T) * c.causal * scale
    d = dattn * c.causal * scale
    qg = q * (c.eg * scale)[:, None]
    dq_ref[...] = (dqg * (c.eg * scale)[:, None] + dot(d, k)).astype(dq_ref.dtype)
    dk_ref[...] = (dot(z, k) + dot(z.T, k) + dxk * (beta * c.eg)[:, None]
                   + dkd * c.tail[:, None]
                   + dot(d.T, q)).astype(dk_ref.dtype)
    dbeta_ref[...] = (dbeta + jnp.sum(da * c.kk * c.strict, axis=1)
                      + c.eg * jnp.sum(dxk * k, axis=1)).astype(dbeta_ref.dtype)
    r = da * c.a
    p = dattn * attn
    dkd_kd = jnp.sum(dkd * k, axis=1) * c.tail
    dG = (jnp.sum(r, axis=1) - jnp.sum(r, axis=0) + jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
          + jnp.sum(dxk * c.x, axis=1) + jnp.sum(dqg * qg, axis=1) - dkd_kd)
    # terms of dG_C reach every row of the reverse cumsum
    dG_last = jnp.sum(dkd_kd) + d_decay * jnp.exp(jnp.sum(g))
    dg_ref[...] = (jnp.sum(dG) - jnp.cumsum(dG) + dG + dG_last).astype(dg_ref.dtype)


def chunk_grads(q, k, v, g, beta, scale: float, h, v_new, x, dvn, do, *,
                interpret: bool = False, precise: bool = True):
    """Twin of xla.grads.chunk_grads for GDN: (dq, dk, dv, dg, dbeta) float32."""
    NT, B, HV, C, K = k.shape
    V = v.shape[-1]
    tile, vec = _specs(C)
    state = pl.BlockSpec((None, None, None, K, V), lambda t, b, hd: (t, b, hd, 0, 0))
    args, mat = unify([q, k, v, g[..., 0], beta, h, v_new, x, dvn, do])
    out = lambda *s: jax.ShapeDtypeStruct((NT, B, HV) + s, jnp.float32, manual_axis_type=mat)
    kernel = partial(_grads_kernel, scale=scale, dots=_dots(precise, interpret),
                     bv=_value_blocks(V))
    dq, dk, dv, dg, dbeta = pl.pallas_call(
        kernel, grid=(NT, B, HV),
        in_specs=[tile(K), tile(K), tile(V), vec, vec, state, tile(V), state, tile(V), tile(V)],
        out_specs=[tile(K), tile(K), tile(V), vec, vec],
        out_shape=[out(C, K), out(C, K), out(C, V), out(C), out(C)],
        **_params(interpret, 0))(*args)
    return dq, dk, dv, dg[..., None], dbeta
