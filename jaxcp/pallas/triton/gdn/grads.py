"""Pallas (Triton-lowered) cotangents of GDN's chunk inputs: two kernels, each one program per
(chunk, batch, head): the cotangents through the chunk states and the intra-chunk attention
(``_inter_kernel``), then the WY backward (``_wy_kernel``).

Twin of ``jaxcp.xla.grads.chunk_grads``. The token tensors q, k [B, T, HV, K], v, do
[B, T, HV, V], g, beta [B, T, HV] and their cotangents are read and written in place, chunk
c at the rows ``ChunkLayout.token_start[c]`` on, c C without a table
(``chunk_rows``); the rest is in chunk layout: the chunk terms w [NT, B, HV, C, K],
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

Only [C, C] tiles and [C, col_block] blocks (``ChunkBlocks``) are live at a time; split in two, each kernel holds
few enough of them that registers hardly spill (one fused kernel spent most of its time
on spill traffic). For bf16 inputs every product has bf16 operands (fp32 tiles are
rounded), as in FLA's backward, and dw, dk1 are stored in bf16.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.layout import ChunkLayout
from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import (ChunkRef, add_chunk_rows, chunk_specs,
                                                   program_rows)
from jaxcp.pallas.triton.common.launch import ChunkBlocks
from jaxcp.pallas.triton.common.products import (KernelPrecision, col_tiles, dots as make_dots,
                                                 gram, sum_dots)
from jaxcp.pallas.triton.common.unit_rows import (normalize_vjp, row_scales, scale_gram,
                                                  unit_cols)
from jaxcp.pallas.triton.gdn.gates import scalar_gates
from jaxcp.terms import ChunkTerms


_InterRefs = refs_type("_InterRefs", "q k g do attn h v_new x dvn dq dk1 dw dg1",
                        "token_start token_count")


def _inter_kernel(*refs, names, scale, dots, normalize, blocks, C):
    """Step 1: dq, the partial dk, dw and the partial dG of one (chunk, head)."""
    r = named(_InterRefs, names, refs)
    rows = program_rows(r, C, blocks.chunk_axis)
    q, k, do, dq_out, dk_out = (ChunkRef(ref, rows) for ref in (r.q, r.k, r.do, r.dq, r.dk1))
    vn, dvn = ChunkRef(r.v_new), ChunkRef(r.dvn)
    gates = scalar_gates(ChunkRef(r.g, rows).all().astype(jnp.float32))
    dot = dots.plain
    K, V = k.width, vn.width
    bk, bv = blocks.cols(K), blocks.cols(V)
    rq, rk = row_scales(q, bk, normalize), row_scales(k, bk, normalize)
    dattn = sum_dots(dot, do, col_tiles(vn, bv), bv)
    p = dattn * r.attn[...].astype(jnp.float32)
    dG = jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
    d = dattn * gates.causal() * scale
    dG_last = jnp.zeros((), jnp.float32)
    dq_q = jnp.zeros_like(dG)        # rowsum(dq o q), for the normalisation's vjp
    state_tiles = lambda ref, i: [ref[pl.ds(i * bk, bk), pl.ds(j * bv, bv)]
                                  for j in range(V // bv)]
    # one [C, bk] accumulator at a time: fewer live tiles, no spills to local memory
    for i in range(K // bk):
        qi, ki = unit_cols(q, i, bk, rq), unit_cols(k, i, bk, rk)
        dqg = sum_dots(dot, do, state_tiles(r.h, i), bv)
        dq = dqg * (gates.eg * scale)[:, None] + dot(d, ki)
        dq_out.set_cols(i, bk, dq)
        if normalize:
            dq_q += jnp.sum(dq * qi, axis=1)
        dG += jnp.sum(dqg * qi, axis=1) * gates.eg * scale
        dkd = None
        for j, (h, x) in enumerate(zip(state_tiles(r.h, i), state_tiles(r.x, i))):
            term = dot(vn.cols(j, bv), x.T)
            dkd = term if dkd is None else dkd + term
            dG_last += jnp.sum(h.astype(jnp.float32) * x.astype(jnp.float32)) * gates.last
        dk_out.set_cols(i, bk, dkd * gates.tail[:, None] + dot(d.T, qi))
        dkd_kd = jnp.sum(dkd * ki, axis=1) * gates.tail
        dG -= dkd_kd
        dG_last += jnp.sum(dkd_kd)
        dw = -sum_dots(dot, dvn, state_tiles(r.h, i), bv)
        ChunkRef(r.dw).set_cols(i, bk, dw)
    if normalize:
        normalize_vjp(dq_out, q, rq, dq_q, bk)
    # dG_C reaches every row of the reverse cumsum: add it to the last row
    C = dG.shape[0]
    r.dg1[...] = dG + jnp.where(lax.iota(jnp.int32, C) == C - 1, dG_last, 0.0)


_WYRefs = refs_type("_WYRefs", "k v g beta dk1 w u inv dvn dw dg1 dk dv dg dbeta",
                     "token_start token_count")


def _wy_kernel(*refs, names, dots, normalize, blocks, C):
    """Step 2: the WY backward of one (chunk, head); dk1 and dk are one buffer."""
    r = named(_WYRefs, names, refs)
    rows = program_rows(r, C, blocks.chunk_axis)
    k, v, dk1, dk_out, dv = (ChunkRef(ref, rows) for ref in (r.k, r.v, r.dk1, r.dk, r.dv))
    w, u, dvn, dw = ChunkRef(r.w), ChunkRef(r.u), ChunkRef(r.dvn), ChunkRef(r.dw)
    g = ChunkRef(r.g, rows).all().astype(jnp.float32)
    beta = ChunkRef(r.beta, rows).all().astype(jnp.float32)
    gates = scalar_gates(g)
    dot = dots.plain
    K, V = k.width, v.width
    bk, bv = blocks.cols(K), blocks.cols(V)
    inv = r.inv[...]
    rk = row_scales(k, bk, normalize)
    da = dbeta = None
    for j in range(V // bv):
        dy = dot(inv.T, dvn.cols(j, bv))
        dv.set_cols(j, bv, dy * beta[:, None])
        da_j = -dot(dy, u.cols(j, bv).T)
        dbeta_j = jnp.sum(dy * v.cols(j, bv).astype(jnp.float32), axis=1)
        da, dbeta = (da_j, dbeta_j) if da is None else (da + da_j, dbeta + dbeta_j)
    dG = r.dg1[...].astype(jnp.float32)
    for i in range(K // bk):
        ki = unit_cols(k, i, bk, rk)
        dxk = dot(inv.T, dw.cols(i, bk))
        da -= dot(dxk, w.cols(i, bk).T)
        dxk_k = jnp.sum(dxk * ki, axis=1) * gates.eg
        dbeta += dxk_k
        dG += dxk_k * beta
    strict = gates.strict()
    z = beta[:, None] * da * strict
    # R = dA o A = beta_i da_kk
    da_kk = da * strict * scale_gram(gram(k, k, dots, bk), rk, rk)
    rr = beta[:, None] * da_kk
    dG += jnp.sum(rr, axis=1) - jnp.sum(rr, axis=0)
    ChunkRef(r.dbeta, rows).set_all(dbeta + jnp.sum(da_kk, axis=1))
    dk_k = jnp.zeros_like(dG)
    for i in range(K // bk):
        ki = unit_cols(k, i, bk, rk)
        # dXk again: cheaper than storing dk1 + beta exp(G) dXk above and loading it here
        dxk = dot(inv.T, dw.cols(i, bk))
        dki = (dk1.cols(i, bk).astype(jnp.float32) + dxk * (beta * gates.eg)[:, None]
               + dot(z, ki) + dot(z.T, ki))
        dk_out.set_cols(i, bk, dki)
        if normalize:
            dk_k += jnp.sum(dki * ki, axis=1)
    if normalize:
        normalize_vjp(dk_out, k, rk, dk_k, bk)
    ChunkRef(r.dg, rows).set_all(jnp.sum(dG) - jnp.cumsum(dG) + dG)


def chunk_grads(q, k, v, g, beta, scale: float, layout: ChunkLayout, chunk_size: int,
                terms: ChunkTerms, h, v_new, x, dvn, do, *, interpret: bool = False,
                precision: KernelPrecision = KernelPrecision(), normalize_qk: bool = False,
                blocks: ChunkBlocks | None = None):
    """Twin of xla.grads.chunk_grads for GDN: (dq, dk, dv, dg, dbeta) in the dtypes and the
    token-major layout of q, k, v, g, beta ([B, T, HV, ...], chunks as in ``intra_chunk``;
    do too); accumulation is float32. terms must carry the inverse
    (``intra_chunk(..., with_inverse=True)``). normalize_qk: q, k are raw and the terms are
    those of their L2-normalised rows (``intra_chunk(normalize_qk=True)``); dq, dk are then
    the cotangents of the raw q, k (the normalisation's vjp is applied in the kernels).
    precision: the products (``products.dots``, rounded: gradients). blocks: the launch
    configuration (``ChunkBlocks.gdn`` if None)."""
    if terms.inv is None:
        raise ValueError("terms: chunk_grads needs terms.inv, from intra_chunk(with_inverse=True)")
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NT, C = layout.chunk_starts.shape[0], chunk_size
    blocks = blocks or ChunkBlocks.gdn(K)
    sp = chunk_specs(C, T, blocks.heads_first)
    state = sp.block(K, V)
    g_shape = g.shape
    g = g.reshape(B, T, HV)
    kw = dict(params=blocks.params(interpret), dots=make_dots(precision, interpret, rounded=True),
              normalize=normalize_qk, blocks=blocks, C=C)

    inter = Operands()
    add_chunk_rows(inter, sp, layout)
    for name, spec, val in (("q", sp.token(K), q), ("k", sp.token(K), k),
                            ("g", sp.token(None), g), ("do", sp.token(V), do),
                            ("attn", sp.tile(C), terms.attn), ("h", state, h),
                            ("v_new", sp.tile(V), v_new), ("x", state, x),
                            ("dvn", sp.tile(V), dvn)):
        inter.add(name, spec, val)

    def inter_outs(out, struct):
        out.add("dq", sp.token(K), struct(q.shape, q.dtype))
        out.add("dk1", sp.token(K), struct(k.shape, k.dtype))
        # an operand of bf16 products for bf16 inputs: stored in q's dtype, nothing is lost
        out.add("dw", sp.tile(K), struct(terms.w.shape, q.dtype))
        out.add("dg1", sp.vec, struct(terms.attn.shape[:-1], jnp.float32))

    step1, _ = call(_inter_kernel, sp.grid(NT, B, HV), inter, inter_outs, name="gdn_grads_inter",
                    scale=scale, **kw)

    wy = Operands()
    add_chunk_rows(wy, sp, layout)
    for name, spec, val in (("k", sp.token(K), k), ("v", sp.token(V), v),
                            ("g", sp.token(None), g), ("beta", sp.token(None), beta),
                            ("dk1", sp.token(K), step1["dk1"]), ("w", sp.tile(K), terms.w),
                            ("u", sp.tile(V), terms.u), ("inv", sp.tile(C), terms.inv),
                            ("dvn", sp.tile(V), dvn), ("dw", sp.tile(K), step1["dw"]),
                            ("dg1", sp.vec, step1["dg1"])):
        wy.add(name, spec, val)

    def wy_outs(out, struct):
        out.add("dk", sp.token(K), struct(k.shape, k.dtype))
        out.add("dv", sp.token(V), struct(v.shape, v.dtype))
        out.add("dg", sp.token(None), struct(g.shape, g.dtype))
        out.add("dbeta", sp.token(None), struct(beta.shape, beta.dtype))

    step2, _ = call(_wy_kernel, sp.grid(NT, B, HV), wy, wy_outs, name="gdn_grads_wy",
                    aliases={"dk1": "dk"}, **kw)
    return step1["dq"], step2["dk"], step2["dv"], step2["dg"].reshape(g_shape), step2["dbeta"]
