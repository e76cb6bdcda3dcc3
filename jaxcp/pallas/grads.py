"""Pallas (Triton-lowered) cotangents of GDN's chunk inputs: two kernels, each one program per
(chunk, batch, head): the cotangents through the chunk states and the intra-chunk attention
(``_inter_kernel``), then the WY backward (``_wy_kernel``).

Twin of ``jaxcp.xla.grads.chunk_grads``, same layout: q, k [NT, B, HV, C, K], v [NT, B,
HV, C, V], g [NT, B, HV, C, 1], beta [NT, B, HV, C] (or all token-major, [B, NT, C, HV,
...]); the chunk terms w [.., C, K], u [.., C, V], attn and T = (I + A)^-1 [.., C, C]
(``intra`` with the inverse); from the recurrences h (state entering each chunk) and
X = dL/dS_out [NT, B, HV, K, V], v_new, dvn = dL/dv_new and do [NT, B, HV, C, V]. With
G = cumsum(g), E_ij = exp(G_i - G_j), Xk = beta exp(G) k (so w = T Xk, u = T (beta v)):

    1. dattn = do v_new^T,  P = dattn o attn,  D = scale lower(dattn o E); per block of key
       columns (inner loop over value columns for the [K, V] tiles):
         dqg = do h^T,  dkd = v_new X^T,  dw = -dvn h^T  (stored),  d_decay += sum(h o X)
         dq  = scale exp(G) dqg + D k
         dk1 = exp(G_C - G) dkd + D^T q  (stored)
    2. per block of value columns:  dY = T^T dvn,  dv = beta dY,  dA = -dY u^T,
         dbeta = rowsum(dY o v);
       per block of key columns:  dXk = T^T dw,  dA -= dXk w^T,  dk = dk1 + beta exp(G) dXk,
         dbeta += exp(G) rowsum(dXk o k);
       Z = beta_i dA_ij E_ij (strict lower), R = dA o A:  dk += (Z + Z^T) k,
         dbeta += rowsum(dA o kk^T o E)
    dG = rowsum(R) - colsum(R) + rowsum(P) - colsum(P) + rowsum(dXk o Xk) + rowsum(dqg o qg)
         - rowsum(dkd o kd) + [i = C] (sum(dkd o kd) + d_decay exp(G_C))
    dg = reverse cumsum of dG within the chunk (step 1 passes its part of dG to step 2)

With normalize_qk, q and k are read raw and normalised in the kernels (q_n = r_q q with
r_q = (q . q + eps)^(-1/2) per row); the formulas above run on q_n, k_n, and the last pass
over dq (step 1) and dk (step 2) applies the normalisation's vjp:
dq = r_q (dq_n - q_n rowsum(dq_n o q_n)), the same for k.

Only [C, C] tiles and [C, 64] blocks are live at a time; split in two, each kernel holds
few enough of them that registers hardly spill (one fused kernel spent most of its time
on spill traffic). For bf16 inputs every product has bf16 operands (fp32 tiles are
rounded), as in FLA's backward, and dw, dk1 are stored in bf16.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.intra import (_chunk_specs, _col_blocks, _cols, _dots, _f32, _gates, _gram,
                                _row_scale, _scale_gram, _sum_dots, token_dims)
from jaxcp.pallas.state import _params
from jaxcp.vma import unify
from jaxcp.xla.intra import ChunkTerms


def _inter_kernel(q_ref, k_ref, g_ref, attn_ref, h_ref, vn_ref, x_ref, dvn_ref, do_ref,
                  dq_ref, dk_ref, dw_ref, dg_ref, *, scale, dots, normalize):
    """Step 1: dq, the partial dk, dw and the partial dG of one (chunk, head)."""
    gates = _gates(_f32(g_ref))
    dot = dots.plain
    K, V = k_ref.shape[-1], vn_ref.shape[-1]
    bk, bv = _col_blocks(K), _col_blocks(V)
    rq, rk = _row_scale(q_ref, bk, normalize), _row_scale(k_ref, bk, normalize)
    dattn = _sum_dots(dot, do_ref, [_cols(vn_ref, j, bv) for j in range(V // bv)], bv)
    p = dattn * _f32(attn_ref)
    dG = jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
    d = dattn * gates.causal() * scale
    dG_last = jnp.zeros((), jnp.float32)
    dq_q = jnp.zeros_like(dG)        # rowsum(dq o q), for the normalisation's vjp
    state_tiles = lambda ref, i: [ref.at[pl.ds(i * bk, bk), pl.ds(j * bv, bv)]
                                  for j in range(V // bv)]
    # one [C, bk] accumulator at a time: fewer live tiles, no spills to local memory
    for i in range(K // bk):
        q, k = _unit_rows(q_ref, i, bk, rq), _unit_rows(k_ref, i, bk, rk)
        dqg = _sum_dots(dot, do_ref, state_tiles(h_ref, i), bv)
        dq = dqg * (gates.eg * scale)[:, None] + dot(d, k)
        _cols(dq_ref, i, bk)[...] = dq.astype(dq_ref.dtype)
        if normalize:
            dq_q += jnp.sum(dq * q, axis=1)
        dG += jnp.sum(dqg * q, axis=1) * gates.eg * scale
        dkd = None
        for j, (h, x) in enumerate(zip(state_tiles(h_ref, i), state_tiles(x_ref, i))):
            x = x[...]
            term = dot(_cols(vn_ref, j, bv)[...], x.T)
            dkd = term if dkd is None else dkd + term
            dG_last += jnp.sum(_f32(h) * x.astype(jnp.float32)) * gates.last
        _cols(dk_ref, i, bk)[...] = (dkd * gates.tail[:, None]
                                     + dot(d.T, q)).astype(dk_ref.dtype)
        dkd_kd = jnp.sum(dkd * k, axis=1) * gates.tail
        dG -= dkd_kd
        dG_last += jnp.sum(dkd_kd)
        dw = -_sum_dots(dot, dvn_ref, state_tiles(h_ref, i), bv)
        _cols(dw_ref, i, bk)[...] = dw.astype(dw_ref.dtype)
    if normalize:
        _normalize_vjp(dq_ref, q_ref, rq, dq_q, bk)
    # dG_C reaches every row of the reverse cumsum: add it to the last row
    C = dG.shape[0]
    dg_ref[...] = dG + jnp.where(lax.iota(jnp.int32, C) == C - 1, dG_last, 0.0)


def _unit_rows(ref, i: int, bk: int, r):
    """Block i of a [C, d] tile ref in float32, its rows scaled by r (None: as stored)."""
    x = _f32(_cols(ref, i, bk))
    return x if r is None else x * r[:, None]


def _normalize_vjp(dx_ref, x_ref, r, dy_y, bk: int):
    """dx = r (dy - y (dy . y)) in place of dy in dx_ref: the vjp of y = r x, r = (x . x +
    eps)^(-1/2), given dy . y per row (dy_y [C], from dy before its last rounding). dy is
    read back as stored: for bf16 inputs rounded to bf16 (dk after each of its partial
    sums), as the unfused op hands the norm's vjp a bf16 cotangent. The store and this load
    of a block use the same layout, so each element is read back by the thread that wrote
    it (the dk partial sums rely on the same)."""
    for i in range(x_ref.shape[-1] // bk):
        y = _unit_rows(x_ref, i, bk, r)
        dy = _f32(_cols(dx_ref, i, bk))
        _cols(dx_ref, i, bk)[...] = ((dy - y * dy_y[:, None]) * r[:, None]).astype(dx_ref.dtype)


def _wy_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, inv_ref, dvn_ref, dw_ref, dg1_ref,
               dk1_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, dots, normalize):
    """Step 2: the WY backward of one (chunk, head); dk1_ref and dk_ref are one buffer."""
    g, beta = _f32(g_ref), _f32(beta_ref)
    gates = _gates(g)
    dot = dots.plain
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    bk, bv = _col_blocks(K), _col_blocks(V)
    inv = inv_ref[...]
    rk = _row_scale(k_ref, bk, normalize)
    da = dbeta = None
    for j in range(V // bv):
        dy = dot(inv.T, _cols(dvn_ref, j, bv)[...])
        _cols(dv_ref, j, bv)[...] = (dy * beta[:, None]).astype(dv_ref.dtype)
        da_j = -dot(dy, _cols(u_ref, j, bv)[...].T)
        dbeta_j = jnp.sum(dy * _f32(_cols(v_ref, j, bv)), axis=1)
        da, dbeta = (da_j, dbeta_j) if da is None else (da + da_j, dbeta + dbeta_j)
    dG = _f32(dg1_ref)
    for i in range(K // bk):
        k = _unit_rows(k_ref, i, bk, rk)
        dxk = dot(inv.T, _cols(dw_ref, i, bk)[...])
        da -= dot(dxk, _cols(w_ref, i, bk)[...].T)
        dxk_k = jnp.sum(dxk * k, axis=1) * gates.eg
        dbeta += dxk_k
        dG += dxk_k * beta
        dk = _f32(_cols(dk1_ref, i, bk)) + dxk * (beta * gates.eg)[:, None]
        _cols(dk_ref, i, bk)[...] = dk.astype(dk_ref.dtype)
    strict = gates.strict()
    z = beta[:, None] * da * strict
    # R = dA o A = beta_i da_kk
    da_kk = da * strict * _scale_gram(_gram(k_ref, k_ref, dots, bk), rk, rk)
    r = beta[:, None] * da_kk
    dG += jnp.sum(r, axis=1) - jnp.sum(r, axis=0)
    dbeta_ref[...] = (dbeta + jnp.sum(da_kk, axis=1)).astype(dbeta_ref.dtype)
    dk_k = jnp.zeros_like(dG)
    for i in range(K // bk):
        k = _unit_rows(k_ref, i, bk, rk)
        # the dk stored above (rounded once more for bf16 inputs)
        dk = _f32(_cols(dk_ref, i, bk)) + dot(z, k) + dot(z.T, k)
        _cols(dk_ref, i, bk)[...] = dk.astype(dk_ref.dtype)
        if normalize:
            dk_k += jnp.sum(dk * k, axis=1)
    if normalize:
        _normalize_vjp(dk_ref, k_ref, rk, dk_k, bk)
    dg_ref[...] = (jnp.sum(dG) - jnp.cumsum(dG) + dG).astype(dg_ref.dtype)


def chunk_grads(q, k, v, g, beta, scale: float, terms: ChunkTerms, h, v_new, x, dvn, do, *,
                token_major: bool = False, interpret: bool = False, precise: bool = True,
                normalize_qk: bool = False):
    """Twin of xla.grads.chunk_grads for GDN: (dq, dk, dv, dg, dbeta) in the dtypes and the
    layout of q, k, v, g, beta (chunk layout, or [B, NT, C, HV, ...] with token_major, as
    do); accumulation is float32. terms must carry the inverse
    (``intra_chunk(..., with_inverse=True)``). normalize_qk: q, k are raw and the terms are
    those of their L2-normalised rows (``intra_chunk(normalize_qk=True)``); dq, dk are then
    the cotangents of the raw q, k (the normalisation's vjp is applied in the kernels)."""
    if terms.inv is None:
        raise ValueError("terms: chunk_grads needs terms.inv, from intra_chunk(with_inverse=True)")
    NT, B, HV, C = token_dims(k, token_major)
    K, V = k.shape[-1], v.shape[-1]
    sp = _chunk_specs(C, token_major)
    state = pl.BlockSpec((None, None, None, K, V), lambda t, b, hd: (t, b, hd, 0, 0))
    args, mat = unify([q, k, v, g[..., 0], beta, terms.w, terms.u, terms.attn, terms.inv, h,
                       v_new, x, dvn, do])
    out = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    q, k, v, g, beta, w, u, attn, inv, h, v_new, x, dvn, do = args     # g is [..., C]
    dots = _dots(precise, interpret, rounded=True)
    tk, tv, tvec = sp.token_tile(K), sp.token_tile(V), sp.token_vec
    # dw is an operand of bf16 products for bf16 inputs: stored in q's dtype, nothing is lost
    dq, dk1, dw, dg1 = pl.pallas_call(
        partial(_inter_kernel, scale=scale, dots=dots, normalize=normalize_qk), grid=(NT, B, HV),
        in_specs=[tk, tk, tvec, sp.tile(C), state, sp.tile(V), state, sp.tile(V), tv],
        out_specs=[tk, tk, sp.tile(K), sp.vec],
        out_shape=[out(q.shape, q.dtype), out(k.shape, k.dtype),
                   out(w.shape, q.dtype), out(attn.shape[:-1], jnp.float32)],
        **_params(interpret, 0))(q, k, g, attn, h, v_new, x, dvn, do)
    dk, dv, dg, dbeta = pl.pallas_call(
        partial(_wy_kernel, dots=dots, normalize=normalize_qk), grid=(NT, B, HV),
        in_specs=[tk, tv, tvec, tvec, sp.tile(K), sp.tile(V), sp.tile(C), sp.tile(V),
                  sp.tile(K), sp.vec, tk],
        out_specs=[tk, tv, tvec, tvec],
        out_shape=[out(k.shape, k.dtype), out(v.shape, v.dtype), out(g.shape, g.dtype),
                   out(beta.shape, beta.dtype)],
        input_output_aliases={10: 0},
        **_params(interpret, 0))(k, v, g, beta, w, u, inv, dvn, dw, dg1, dk1)
    return dq, dk, dv, dg[..., None], dbeta
