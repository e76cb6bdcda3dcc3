"""Pallas (Triton-lowered) cotangents of GDN's chunk inputs: two kernels, each one program per
(chunk, batch, head): the cotangents through the chunk states and the intra-chunk attention
(``_inter_kernel``), then the WY backward (``_wy_kernel``).

Twin of ``jaxcp.xla.grads.chunk_grads``. The token tensors q, k [B, T, HV, K], v, do
[B, T, HV, V], g, beta [B, T, HV] and their cotangents are read and written in place, chunk
c at the rows ``ChunkLayout.token_start[c]`` on, c C without a table
(``jaxcp.pallas.tokens``); the rest is in chunk layout: the chunk terms w [NT, B, HV, C, K],
u [.., C, V], attn and T = (I + A)^-1 [.., C, C] (``intra`` with the inverse, or
``recompute_w_u``); from the recurrences h (state entering each chunk)
and X = dL/dS_out [NT, B, HV, K, V], v_new and dvn = dL/dv_new [NT, B, HV, C, V]. With
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

from jaxcp.layout import ChunkLayout
from jaxcp.pallas.intra import (_chunk_rows, _chunk_specs, _col_blocks, _col_tiles, _dots,
                                _gates, _gram, _row_scale, _scale_gram, _sum_dots, _with_table)
from jaxcp.pallas.state import _params
from jaxcp.pallas.tokens import Tile, has_table
from jaxcp.vma import unify
from jaxcp.xla.intra import ChunkTerms


def _inter_kernel(*refs, scale, dots, normalize, table, C):
    """Step 1: dq, the partial dk, dw and the partial dG of one (chunk, head)."""
    refs = list(refs)
    rows = _chunk_rows(refs, C, table)
    (q_ref, k_ref, g_ref, do_ref, attn_ref, h_ref, vn_ref, x_ref, dvn_ref, dq_ref, dk_ref,
     dw_ref, dg_ref) = refs
    q, k, do, dq_out, dk_out = (Tile(r, rows) for r in (q_ref, k_ref, do_ref, dq_ref, dk_ref))
    vn, dvn = Tile(vn_ref), Tile(dvn_ref)
    gates = _gates(Tile(g_ref, rows).all().astype(jnp.float32))
    dot = dots.plain
    K, V = k.width, vn.width
    bk, bv = _col_blocks(K), _col_blocks(V)
    rq, rk = _row_scale(q, bk, normalize), _row_scale(k, bk, normalize)
    dattn = _sum_dots(dot, do, _col_tiles(vn, bv), bv)
    p = dattn * attn_ref[...].astype(jnp.float32)
    dG = jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
    d = dattn * gates.causal() * scale
    dG_last = jnp.zeros((), jnp.float32)
    dq_q = jnp.zeros_like(dG)        # rowsum(dq o q), for the normalisation's vjp
    state_tiles = lambda ref, i: [ref[pl.ds(i * bk, bk), pl.ds(j * bv, bv)]
                                  for j in range(V // bv)]
    # one [C, bk] accumulator at a time: fewer live tiles, no spills to local memory
    for i in range(K // bk):
        qi, ki = _unit_rows(q, i, bk, rq), _unit_rows(k, i, bk, rk)
        dqg = _sum_dots(dot, do, state_tiles(h_ref, i), bv)
        dq = dqg * (gates.eg * scale)[:, None] + dot(d, ki)
        dq_out.set_cols(i, bk, dq)
        if normalize:
            dq_q += jnp.sum(dq * qi, axis=1)
        dG += jnp.sum(dqg * qi, axis=1) * gates.eg * scale
        dkd = None
        for j, (h, x) in enumerate(zip(state_tiles(h_ref, i), state_tiles(x_ref, i))):
            term = dot(vn.cols(j, bv), x.T)
            dkd = term if dkd is None else dkd + term
            dG_last += jnp.sum(h.astype(jnp.float32) * x.astype(jnp.float32)) * gates.last
        dk_out.set_cols(i, bk, dkd * gates.tail[:, None] + dot(d.T, qi))
        dkd_kd = jnp.sum(dkd * ki, axis=1) * gates.tail
        dG -= dkd_kd
        dG_last += jnp.sum(dkd_kd)
        dw = -_sum_dots(dot, dvn, state_tiles(h_ref, i), bv)
        Tile(dw_ref).set_cols(i, bk, dw)
    if normalize:
        _normalize_vjp(dq_out, q, rq, dq_q, bk)
    # dG_C reaches every row of the reverse cumsum: add it to the last row
    C = dG.shape[0]
    dg_ref[...] = dG + jnp.where(lax.iota(jnp.int32, C) == C - 1, dG_last, 0.0)


def _unit_rows(x: Tile, i: int, bk: int, r):
    """Block i of bk columns of a [C, d] tile in float32, its rows scaled by r (None: as
    stored)."""
    y = x.cols(i, bk).astype(jnp.float32)
    return y if r is None else y * r[:, None]


def _normalize_vjp(dx: Tile, x: Tile, r, dy_y, bk: int):
    """dx = r (dy - y (dy . y)) in place of dy in the tile dx: the vjp of y = r x, r = (x . x +
    eps)^(-1/2), given dy . y per row (dy_y [C], from dy before its last rounding). dy is
    read back as stored: for bf16 inputs rounded to bf16, as the unfused op hands the norm's
    vjp a bf16 cotangent. The store and this load of a block use the same layout, so each
    element is read back by the thread that wrote it."""
    for i in range(x.width // bk):
        y = _unit_rows(x, i, bk, r)
        dy = dx.cols(i, bk).astype(jnp.float32)
        dx.set_cols(i, bk, (dy - y * dy_y[:, None]) * r[:, None])


def _wy_kernel(*refs, dots, normalize, table, C):
    """Step 2: the WY backward of one (chunk, head); dk1_ref and dk_ref are one buffer."""
    refs = list(refs)
    rows = _chunk_rows(refs, C, table)
    (k_ref, v_ref, g_ref, beta_ref, dk1_ref, w_ref, u_ref, inv_ref, dvn_ref, dw_ref, dg1_ref,
     dk_ref, dv_ref, dg_ref, dbeta_ref) = refs
    k, v, dk1, dk_out, dv = (Tile(r, rows) for r in (k_ref, v_ref, dk1_ref, dk_ref, dv_ref))
    w, u, dvn, dw = Tile(w_ref), Tile(u_ref), Tile(dvn_ref), Tile(dw_ref)
    g = Tile(g_ref, rows).all().astype(jnp.float32)
    beta = Tile(beta_ref, rows).all().astype(jnp.float32)
    gates = _gates(g)
    dot = dots.plain
    K, V = k.width, v.width
    bk, bv = _col_blocks(K), _col_blocks(V)
    inv = inv_ref[...]
    rk = _row_scale(k, bk, normalize)
    da = dbeta = None
    for j in range(V // bv):
        dy = dot(inv.T, dvn.cols(j, bv))
        dv.set_cols(j, bv, dy * beta[:, None])
        da_j = -dot(dy, u.cols(j, bv).T)
        dbeta_j = jnp.sum(dy * v.cols(j, bv).astype(jnp.float32), axis=1)
        da, dbeta = (da_j, dbeta_j) if da is None else (da + da_j, dbeta + dbeta_j)
    dG = dg1_ref[...].astype(jnp.float32)
    for i in range(K // bk):
        ki = _unit_rows(k, i, bk, rk)
        dxk = dot(inv.T, dw.cols(i, bk))
        da -= dot(dxk, w.cols(i, bk).T)
        dxk_k = jnp.sum(dxk * ki, axis=1) * gates.eg
        dbeta += dxk_k
        dG += dxk_k * beta
    strict = gates.strict()
    z = beta[:, None] * da * strict
    # R = dA o A = beta_i da_kk
    da_kk = da * strict * _scale_gram(_gram(k, k, dots, bk), rk, rk)
    r = beta[:, None] * da_kk
    dG += jnp.sum(r, axis=1) - jnp.sum(r, axis=0)
    Tile(dbeta_ref, rows).set_all(dbeta + jnp.sum(da_kk, axis=1))
    dk_k = jnp.zeros_like(dG)
    for i in range(K // bk):
        ki = _unit_rows(k, i, bk, rk)
        # dXk again: cheaper than storing dk1 + beta exp(G) dXk above and loading it here
        dxk = dot(inv.T, dw.cols(i, bk))
        dki = (dk1.cols(i, bk).astype(jnp.float32) + dxk * (beta * gates.eg)[:, None]
               + dot(z, ki) + dot(z.T, ki))
        dk_out.set_cols(i, bk, dki)
        if normalize:
            dk_k += jnp.sum(dki * ki, axis=1)
    if normalize:
        _normalize_vjp(dk_out, k, rk, dk_k, bk)
    Tile(dg_ref, rows).set_all(jnp.sum(dG) - jnp.cumsum(dG) + dG)


def chunk_grads(q, k, v, g, beta, scale: float, layout: ChunkLayout, chunk_size: int,
                terms: ChunkTerms, h, v_new, x, dvn, do, *, interpret: bool = False,
                precise: bool = True, normalize_qk: bool = False):
    """Twin of xla.grads.chunk_grads for GDN: (dq, dk, dv, dg, dbeta) in the dtypes and the
    token-major layout of q, k, v, g, beta ([B, T, HV, ...], chunks as in ``intra_chunk``;
    do too); accumulation is float32. terms must carry the inverse
    (``intra_chunk(..., with_inverse=True)``). normalize_qk: q, k are raw and the terms are
    those of their L2-normalised rows (``intra_chunk(normalize_qk=True)``); dq, dk are then
    the cotangents of the raw q, k (the normalisation's vjp is applied in the kernels)."""
    if terms.inv is None:
        raise ValueError("terms: chunk_grads needs terms.inv, from intra_chunk(with_inverse=True)")
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NT, C = layout.chunk_starts.shape[0], chunk_size
    sp = _chunk_specs(C, T)
    state = pl.BlockSpec((None, None, None, K, V), lambda t, b, hd: (t, b, hd, 0, 0))
    g_shape = g.shape
    table = has_table(layout)
    args, mat = unify(_with_table(layout, [q, k, v, g.reshape(B, T, HV), beta, do, terms.w,
                                           terms.u, terms.attn, terms.inv, h, v_new, x, dvn]))
    out = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    rows_args, args = args[:2 * table], args[2 * table:]
    q, k, v, g, beta, do, w, u, attn, inv, h, v_new, x, dvn = args
    dots = _dots(precise, interpret, rounded=True)
    rows, tk, tv, tvec = [sp.chunk_rows] * (2 * table), sp.token(K), sp.token(V), sp.token(None)
    kw = dict(dots=dots, normalize=normalize_qk, table=table, C=C)
    # dw is an operand of bf16 products for bf16 inputs: stored in q's dtype, nothing is lost
    dq, dk1, dw, dg1 = pl.pallas_call(
        partial(_inter_kernel, scale=scale, **kw), grid=(NT, B, HV),
        in_specs=rows + [tk, tk, tvec, tv, sp.tile(C), state, sp.tile(V), state, sp.tile(V)],
        out_specs=[tk, tk, sp.tile(K), sp.vec],
        out_shape=[out(q.shape, q.dtype), out(k.shape, k.dtype),
                   out(w.shape, q.dtype), out(attn.shape[:-1], jnp.float32)],
        **_params(interpret, 0))(*rows_args, q, k, g, do, attn, h, v_new, x, dvn)
    dk, dv, dg, dbeta = pl.pallas_call(
        partial(_wy_kernel, **kw), grid=(NT, B, HV),
        in_specs=rows + [tk, tv, tvec, tvec, tk, sp.tile(K), sp.tile(V), sp.tile(C),
                         sp.tile(V), sp.tile(K), sp.vec],
        out_specs=[tk, tv, tvec, tvec],
        out_shape=[out(k.shape, k.dtype), out(v.shape, v.dtype), out(g.shape, g.dtype),
                   out(beta.shape, beta.dtype)],
        input_output_aliases={len(rows_args) + 4: 0},
        **_params(interpret, 0))(*rows_args, k, v, g, beta, dk1, w, u, inv, dvn, dw, dg1)
    return dq, dk, dv, dg.reshape(g_shape), dbeta
