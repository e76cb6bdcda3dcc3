"""Pallas (Triton-lowered) cotangents of KDA's chunk inputs: two kernels, each one program
per (chunk, batch, head), in the chunk layout.

Twin of ``jaxcp.xla.grads.chunk_grads`` for the per-channel gate (``Gate.CHANNEL``). Inputs:
q, k, g [NT, B, HV, C, K], v, do [.., C, V], beta [.., C]; the terms w [.., C, K], u
[.., C, V] and T = (I + A)^-1 [.., C, C]; from the recurrences h (state entering each chunk)
and X = dL/dS_out [NT, B, HV, K, V], v_new and dvn = dL/dv_new [.., C, V]. With
G = cumsum(g) per channel, E_ijd = exp(G_id - G_jd), Xk = beta exp(G) k (w = T Xk,
u = T (beta v)) and the gated row and column sums of ``pallas.channel``
(rows(M, y)_id = sum_{j<i} M_ij y_jd E_ijd, cols(M, x)_jd = sum_{i>j} M_ij x_id E_ijd):

    1. (``_inter_kernel``) Mq = scale lower(do v_new^T) (diagonal included); per block of
       key columns:
         dqg = do h^T,  dkd = v_new X^T,  dw = -dvn h^T (stored),  d_decay = sum_V(h o X)
         Rq = rows(Mq, k),  Cq = cols(Mq, q)
         dq  = scale exp(G) dqg + Rq + diag(Mq) k
         dk1 = exp(G_C - G) dkd + Cq + diag(Mq) q                       (stored)
         dG1 = q o (scale exp(G) dqg + Rq) - k o Cq - k o exp(G_C - G) dkd,
               and on the last row + sum_i (k o exp(G_C - G) dkd) + d_decay exp(G_C)
    2. (``_wy_kernel``) dY = T^T dvn per block of value columns: dv = beta dY,
       dbeta = rowsum(dY o v); dXk = T^T dw per block of key columns;
       dA = strict_lower(-dY u^T - dXk w^T); per block of key columns:
         R = rows(dA, k),  Q = cols(dA, beta k)
         dk = dk1 + beta exp(G) dXk + beta R + Q
         dbeta += rowsum(exp(G) dXk o k) + rowsum(k o R)
         dG = dG1 + beta exp(G) dXk o k + beta k o R - k o Q
         dg = reverse cumsum of dG over the chunk's rows

Every decay is a product of factors <= 1 (``pallas.channel``), so the cotangents are finite
for any gate g <= 0. Only [C, C] tiles and [C, col_block] blocks are live at a time; the
work is split in two kernels, as GDN's is, so that neither spills registers. For bf16 inputs
the products take bf16 operands (fp32 tiles rounded), as in FLA's backward.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcp.pallas.channel import ChannelBlock, f32, gated_sum, iota
from jaxcp.pallas.common import (Operands, call, chunk_specs, dots as make_dots, named,
                                 refs_type)
from jaxcp.pallas.config import ChunkBlocks
from jaxcp.xla.intra import ChunkTerms


def _state_tiles(ref, cols, V: int, bv: int):
    return [f32(ref[cols, pl.ds(j * bv, bv)]) for j in range(V // bv)]


def _sum_products(product, xs, ys):
    """sum_j xs[j] @ ys[j]^T."""
    return sum(product(x, y.T) for x, y in zip(xs, ys))


_InterRefs = refs_type("_InterRefs", "q k g do h v_new x dvn dq dk1 dw dg1")


def _inter_kernel(*refs, names, scale, dots, blocks):
    r = named(_InterRefs, names, refs)
    C, K = r.k.shape
    V = r.do.shape[-1]
    bk, bv = blocks.cols(K), blocks.cols(V)
    dot = dots.plain
    value_cols = [pl.ds(j * bv, bv) for j in range(V // bv)]
    do = [f32(r.do[:, c]) for c in value_cols]
    dattn = _sum_products(dot, do, [f32(r.v_new[:, c]) for c in value_cols])
    eye = iota((C, C), 0) == iota((C, C), 1)
    m = jnp.where(iota((C, C), 0) >= iota((C, C), 1), dattn * scale, 0.0)
    m_diagonal = jnp.sum(jnp.where(eye, m, 0.0), axis=1)[:, None]
    last_row = iota((C, bk), 0) == C - 1
    for i in range(K // bk):
        ch = ChannelBlock(r.g, i, bk)
        q, k = ch.load(r.q), ch.load(r.k)
        h = _state_tiles(r.h, ch.cols, V, bv)
        x = _state_tiles(r.x, ch.cols, V, bv)
        dqg = _sum_products(dot, do, h) * (ch.eg * scale)
        dkd = _sum_products(dot, [f32(r.v_new[:, c]) for c in value_cols], x) * ch.tail
        r.dw[:, ch.cols] = (-_sum_products(dot, [f32(r.dvn[:, c]) for c in value_cols], h)
                            ).astype(r.dw.dtype)
        d_decay = sum(jnp.sum(hj * xj, axis=1) for hj, xj in zip(h, x))[None, :]
        rq = gated_sum(m, ch.G, k, ch.rows(r.k), dot, columns=False, g_rows=ch.g_rows)
        cq = gated_sum(m, ch.G, q, ch.rows(r.q), dot, columns=True, g_rows=ch.g_rows)
        r.dq[:, ch.cols] = (dqg + rq + m_diagonal * k).astype(r.dq.dtype)
        r.dk1[:, ch.cols] = (dkd + cq + m_diagonal * q).astype(r.dk1.dtype)
        dkd_k = dkd * k
        dG_last = jnp.sum(dkd_k, axis=0, keepdims=True) + d_decay * ch.last
        dG = q * (dqg + rq) - k * cq - dkd_k + jnp.where(last_row, dG_last, 0.0)
        r.dg1[:, ch.cols] = dG


_WYRefs = refs_type("_WYRefs", "k v g beta dk1 w u inv dvn dw dg1 dk dv dg dbeta")


def _wy_kernel(*refs, names, dots, blocks):
    r = named(_WYRefs, names, refs)
    C, K = r.k.shape
    V = r.v.shape[-1]
    bk, bv = blocks.cols(K), blocks.cols(V)
    dot = dots.plain
    dot_t = lambda a, b: dot(a.T, b)
    inv = f32(r.inv[...])
    beta = f32(r.beta[...])
    da = jnp.zeros((C, C), jnp.float32)
    dbeta = jnp.zeros((C,), jnp.float32)
    for j in range(V // bv):
        cols = pl.ds(j * bv, bv)
        dy = dot_t(inv, f32(r.dvn[:, cols]))
        r.dv[:, cols] = (dy * beta[:, None]).astype(r.dv.dtype)
        da = da - dot(dy, f32(r.u[:, cols]).T)
        dbeta = dbeta + jnp.sum(dy * f32(r.v[:, cols]), axis=1)
    for i in range(K // bk):
        cols = pl.ds(i * bk, bk)
        da = da - dot(dot_t(inv, f32(r.dw[:, cols])), f32(r.w[:, cols]).T)
    da = jnp.where(iota((C, C), 0) > iota((C, C), 1), da, 0.0)
    beta_rows = lambda idx: f32(r.beta[idx])[:, None]
    for i in range(K // bk):
        ch = ChannelBlock(r.g, i, bk)
        k = ch.load(r.k)
        # dXk again: cheaper than keeping one [C, bk] block per column block live
        dxk_eg = dot_t(inv, ch.load(r.dw)) * ch.eg
        k_rows = ch.rows(r.k)
        rk = gated_sum(da, ch.G, k, k_rows, dot, columns=False, g_rows=ch.g_rows)
        ck = gated_sum(da, ch.G, k * beta[:, None], lambda idx: k_rows(idx) * beta_rows(idx),
                       dot, columns=True, g_rows=ch.g_rows)
        k_grad = dxk_eg + rk
        r.dk[:, ch.cols] = (ch.load(r.dk1) + k_grad * beta[:, None] + ck).astype(r.dk.dtype)
        dbeta = dbeta + jnp.sum(k_grad * k, axis=1)
        dG = ch.load(r.dg1) + (beta[:, None] * k_grad - ck) * k
        # reverse cumsum over the rows: dg_s = sum_{i >= s} dG_i
        r.dg[:, ch.cols] = (jnp.sum(dG, axis=0, keepdims=True) - jnp.cumsum(dG, axis=0)
                            + dG).astype(r.dg.dtype)
    r.dbeta[...] = dbeta.astype(r.dbeta.dtype)


def chunk_grads(q, k, v, g, beta, scale: float, terms: ChunkTerms, h, v_new, x, dvn, do, *,
                interpret: bool = False, precise: bool = True,
                blocks: ChunkBlocks | None = None):
    """Twin of xla.grads.chunk_grads(..., gate=Gate.CHANNEL) in the chunk layout (module
    docstring): (dq, dk, dv, dg, dbeta), float32, shapes of q, k, v, g, beta. terms must
    carry the inverse (``intra_chunk(..., with_inverse=True)``). precise: 3xTF32 products
    (fp32 inputs), else bf16 products. blocks: the launch configuration
    (``ChunkBlocks.default`` if None)."""
    if terms.inv is None:
        raise ValueError("terms: chunk_grads needs terms.inv, from intra_chunk(with_inverse=True)")
    NT, B, HV, C, K = k.shape
    V = v.shape[-1]
    blocks = blocks or ChunkBlocks.default(K, q.dtype)
    sp = chunk_specs(C, C)
    state = pl.BlockSpec((None, None, None, K, V), lambda t, b, hd: (t, b, hd, 0, 0))
    kw = dict(params=blocks.params(interpret), dots=make_dots(precise, interpret, rounded=True),
              blocks=blocks)

    inter = Operands()
    for name, spec, val in (("q", sp.tile(K), q), ("k", sp.tile(K), k), ("g", sp.tile(K), g),
                            ("do", sp.tile(V), do), ("h", state, h),
                            ("v_new", sp.tile(V), v_new), ("x", state, x),
                            ("dvn", sp.tile(V), dvn)):
        inter.add(name, spec, val)

    def inter_outs(out, struct):
        out.add("dq", sp.tile(K), struct(q.shape, jnp.float32))
        out.add("dk1", sp.tile(K), struct(k.shape, jnp.float32))
        out.add("dw", sp.tile(K), struct(k.shape, jnp.float32))
        out.add("dg1", sp.tile(K), struct(g.shape, jnp.float32))

    step1, _ = call(_inter_kernel, (NT, B, HV), inter, inter_outs, name="kda_grads_inter",
                    scale=scale, **kw)

    wy = Operands()
    for name, spec, val in (("k", sp.tile(K), k), ("v", sp.tile(V), v), ("g", sp.tile(K), g),
                            ("beta", sp.vec, beta), ("dk1", sp.tile(K), step1["dk1"]),
                            ("w", sp.tile(K), terms.w), ("u", sp.tile(V), terms.u),
                            ("inv", sp.tile(C), terms.inv), ("dvn", sp.tile(V), dvn),
                            ("dw", sp.tile(K), step1["dw"]), ("dg1", sp.tile(K), step1["dg1"])):
        wy.add(name, spec, val)

    def wy_outs(out, struct):
        out.add("dk", sp.tile(K), struct(k.shape, jnp.float32))
        out.add("dv", sp.tile(V), struct(v.shape, jnp.float32))
        out.add("dg", sp.tile(K), struct(g.shape, jnp.float32))
        out.add("dbeta", sp.vec, struct(beta.shape, jnp.float32))

    step2, _ = call(_wy_kernel, (NT, B, HV), wy, wy_outs, name="kda_grads_wy", **kw)
    return step1["dq"], step2["dk"], step2["dv"], step2["dg"], step2["dbeta"]
