"""Pallas (Triton-lowered) cotangents of GDN's chunk inputs, one program per (chunk, batch,
head): the cotangents of the chunk terms and the intra-chunk backward (WY included), fused.

Twin of ``jaxcp.xla.grads.chunk_grads``, same layout: q, k [NT, B, HV, C, K], v [NT, B,
HV, C, V], g [NT, B, HV, C, 1], beta [NT, B, HV, C] (or all token-major, [B, NT, C, HV,
...]); the chunk terms w [.., C, K], u [.., C, V], attn and T = (I + A)^-1 [.., C, C]
(``intra`` with the inverse); from the recurrences h (state entering each chunk) and
X = dL/dS_out [NT, B, HV, K, V], v_new, dvn = dL/dv_new and do [NT, B, HV, C, V]. With G = cumsum(g), E_ij = exp(G_i - G_j),
Xk = beta exp(G) k (so w = T Xk, u = T (beta v)):

    1. per block of value columns:
         dattn += do v_new^T,  dY = T^T dvn,  dA -= dY u^T,  dv = beta dY,
         dbeta += rowsum(dY o v);            then D = scale lower(dattn o E)
    2. per block of key columns (inner loop over value columns for the [K, V] tiles):
         dw = -dvn h^T,  dqg = do h^T,  dkd = v_new X^T,  d_decay += sum(h o X)
         dXk = T^T dw,   dA -= dXk w^T
         dq = scale exp(G) dqg + D k
         dk = beta exp(G) dXk + exp(G_C - G) dkd + D^T q          (Z part added in 3.)
         dbeta += exp(G) rowsum(dXk o k)
    3. Z = beta_i dA_ij E_ij (strict lower), R = dA o A:  dk += (Z + Z^T) k,
         dbeta += rowsum(dA o kk^T o E)
    dG = rowsum(R) - colsum(R) + rowsum(P) - colsum(P) + rowsum(dXk o Xk) + rowsum(dqg o qg)
         - rowsum(dkd o kd) + [i = C] (sum(dkd o kd) + d_decay exp(G_C)),  P = dattn o attn
    dg = reverse cumsum of dG within the chunk

Only [C, C] tiles and [C, 64] blocks are live at a time. For bf16 inputs every product
has bf16 operands (fp32 tiles are rounded), as in FLA's backward.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcp.pallas.intra import (_chunk_specs, _col_blocks, _cols, _dots, _f32, _gates, _gram,
                                token_dims)
from jaxcp.pallas.state import _params
from jaxcp.vma import unify
from jaxcp.xla.intra import ChunkTerms


def _add(acc, terms):
    """acc + terms elementwise over tuples; acc None starts the sum."""
    return terms if acc is None else tuple(a + t for a, t in zip(acc, terms))


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, attn_ref, inv_ref, h_ref,
                  vn_ref, x_ref, dvn_ref, do_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *,
                  scale, dots):
    g, beta = _f32(g_ref), _f32(beta_ref)
    gates = _gates(g)
    dot = dots.plain
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    bk, bv = _col_blocks(K), _col_blocks(V)
    inv = inv_ref[...]

    sums = None
    for j in range(V // bv):
        dy = dot(inv.T, _cols(dvn_ref, j, bv)[...])
        sums = _add(sums, (dot(_cols(do_ref, j, bv)[...], _cols(vn_ref, j, bv)[...].T),
                           -dot(dy, _cols(u_ref, j, bv)[...].T),
                           jnp.sum(dy * _f32(_cols(v_ref, j, bv)), axis=1)))
        _cols(dv_ref, j, bv)[...] = (dy * beta[:, None]).astype(dv_ref.dtype)
    dattn, da, dbeta = sums
    p = dattn * _f32(attn_ref)
    dG = jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
    d = dattn * gates.causal() * scale
    dkd_kd_total = jnp.zeros((), jnp.float32)
    d_decay = jnp.zeros((), jnp.float32)
    for i in range(K // bk):
        rows = pl.ds(i * bk, bk)
        sums = None
        for j in range(V // bv):
            cols = pl.ds(j * bv, bv)
            h, x = h_ref.at[rows, cols][...], x_ref.at[rows, cols][...]
            sums = _add(sums, (-dot(_cols(dvn_ref, j, bv)[...], h.T),
                               dot(_cols(do_ref, j, bv)[...], h.T),
                               dot(_cols(vn_ref, j, bv)[...], x.T)))
            d_decay += jnp.sum(h.astype(jnp.float32) * x.astype(jnp.float32))
        dw, dqg, dkd = sums
        q, k = _f32(_cols(q_ref, i, bk)), _f32(_cols(k_ref, i, bk))
        xk = k * (beta * gates.eg)[:, None]
        dxk = dot(inv.T, dw)
        da -= dot(dxk, _cols(w_ref, i, bk)[...].T)
        dq = dqg * (gates.eg * scale)[:, None] + dot(d, k)
        _cols(dq_ref, i, bk)[...] = dq.astype(dq_ref.dtype)
        dk = dxk * (beta * gates.eg)[:, None] + dkd * gates.tail[:, None] + dot(d.T, q)
        _cols(dk_ref, i, bk)[...] = dk.astype(dk_ref.dtype)
        dbeta += gates.eg * jnp.sum(dxk * k, axis=1)
        dkd_kd = jnp.sum(dkd * k, axis=1) * gates.tail
        dG += (jnp.sum(dxk * xk, axis=1) + jnp.sum(dqg * q, axis=1) * gates.eg * scale
               - dkd_kd)
        dkd_kd_total += jnp.sum(dkd_kd)

    strict = gates.strict()
    z = beta[:, None] * da * strict
    da_kk = da * strict * _gram(k_ref, k_ref, dots, bk)     # R = dA o A = beta_i da_kk
    r = beta[:, None] * da_kk
    dG += jnp.sum(r, axis=1) - jnp.sum(r, axis=0)
    dbeta_ref[...] = (dbeta + jnp.sum(da_kk, axis=1)).astype(dbeta_ref.dtype)
    for i in range(K // bk):
        k = _cols(k_ref, i, bk)[...]
        # the partial dk of step 2, as stored (rounded once more for bf16 inputs)
        dk = _f32(_cols(dk_ref, i, bk)) + dot(z, k) + dot(z.T, k)
        _cols(dk_ref, i, bk)[...] = dk.astype(dk_ref.dtype)
    # terms of dG_C reach every row of the reverse cumsum
    dG_last = dkd_kd_total + d_decay * gates.last
    dg_ref[...] = (jnp.sum(dG) - jnp.cumsum(dG) + dG + dG_last).astype(dg_ref.dtype)


def chunk_grads(q, k, v, g, beta, scale: float, terms: ChunkTerms, h, v_new, x, dvn, do, *,
                token_major: bool = False, interpret: bool = False, precise: bool = True):
    """Twin of xla.grads.chunk_grads for GDN: (dq, dk, dv, dg, dbeta) in the dtypes and the
    layout of q, k, v, g, beta (chunk layout, or [B, NT, C, HV, ...] with token_major, as
    do); accumulation is float32. terms must carry the inverse
    (``intra_chunk(..., with_inverse=True)``)."""
    if terms.inv is None:
        raise ValueError("terms: chunk_grads needs terms.inv, from intra_chunk(with_inverse=True)")
    NT, B, HV, C = token_dims(k, token_major)
    K, V = k.shape[-1], v.shape[-1]
    sp = _chunk_specs(C, token_major)
    state = pl.BlockSpec((None, None, None, K, V), lambda t, b, hd: (t, b, hd, 0, 0))
    args, mat = unify([q, k, v, g[..., 0], beta, terms.w, terms.u, terms.attn, terms.inv, h,
                       v_new, x, dvn, do])
    out = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=mat)
    kernel = partial(_grads_kernel, scale=scale,
                     dots=_dots(precise, interpret, rounded=True))
    tk, tv, tvec = sp.token_tile(K), sp.token_tile(V), sp.token_vec
    dq, dk, dv, dg, dbeta = pl.pallas_call(
        kernel, grid=(NT, B, HV),
        in_specs=[tk, tk, tv, tvec, tvec, sp.tile(K), sp.tile(V), sp.tile(C), sp.tile(C), state,
                  sp.tile(V), state, sp.tile(V), tv],
        out_specs=[tk, tk, tv, tvec, tvec],
        out_shape=[out(q), out(k), out(v), out(g[..., 0]), out(beta)],
        **_params(interpret, 0))(*args)
    return dq, dk, dv, dg[..., None], dbeta
