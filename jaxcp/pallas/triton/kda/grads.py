"""Pallas (Triton-lowered) cotangents of KDA's chunk inputs: three kernels with one program
per (chunk, batch, head), then one with one program per (chunk, batch, head, sub-chunk of
16 rows). dG, the cotangent of the gate's chunk cumsum, leaves in the chunk layout; its
reverse cumsum (and the gate activation's backward) is ``gate_cumsum.chunk_gate``'s.

Twin of ``jaxcp.xla.grads.chunk_grads`` for the per-channel gate (``Gate.CHANNEL``). Inputs,
the token tensors read in place at the layout's rows (``chunk_rows``): q, k
[B, T, HV, K], v, do [B, T, HV, V], beta [B, T, HV]; in the chunk layout: G [NT, B, HV,
C, K]; the terms w [.., C, K], u [.., C, V] and T = (I + A)^-1 [.., C, C]; from the
recurrences h (state entering each chunk) and X = dL/dS_out [NT, B, HV, K, V], v_new and
dvn = dL/dv_new [.., C, V]. With G = cumsum(g) per channel, E_ijd = exp(G_id - G_jd),
Xk = beta exp(G) k (w = T Xk, u = T (beta v)) and the gated row and column sums of
``gates`` (rows(M, y)_id = sum_{j<i} M_ij y_jd E_ijd,
cols(M, x)_jd = sum_{i>j} M_ij x_id E_ijd):

    1. (``_inter_kernel``) Mq = scale lower(do v_new^T) (diagonal included, stored);
       per block of key columns:
         dqg = do h^T,  dkd = v_new X^T,  dw = -dvn h^T (stored),  d_decay = sum_V(h o X)
         dq = scale exp(G) dqg,  dk = exp(G_C - G) dkd
         dG = q o dq - k o dk, and on the last row + sum_i (k o dk) + d_decay exp(G_C)
    2. (``_wy_kernel``) dY = T^T dvn per block of value columns: dv = beta dY,
       dbeta = rowsum(dY o v); dXk = T^T dw per block of key columns;
       dA = strict_lower(-dY u^T - dXk w^T) (stored); per block of key columns:
         dk += beta exp(G) dXk,  dbeta += rowsum(exp(G) dXk o k),
         dG += beta exp(G) dXk o k
    3. (``_across_kernel`` for the pairs in different sub-chunks, then ``_diagonal_kernel``
       for those inside one sub-chunk and Mq's diagonal; both in place) per block of key
       columns:
         Rq = rows(Mq, k),  Cq = cols(Mq, q),  R = rows(dA, k),  Q = cols(dA, beta k)
         dq += Rq + diag(Mq) k
         dk += Cq + diag(Mq) q + beta R + Q,   dbeta += rowsum(k o R)
         dG += q o Rq - k o Cq + beta k o R - k o Q

With normalize_qk the kernels read q, k L2-normalised from the raw tiles (as
``intra`` does), and XLA applies the normalisation's vjp to dq, dk.

The sums are float32; dv leaves step 2, and dq, dk the last kernel, in their inputs'
dtypes (rounded once, as the op would round them), so no conversion pass follows.

Every decay is a product of factors <= 1 (``gates``), so the cotangents are finite
for any gate g <= 0. The per-chunk kernels loop over blocks of col_block columns, so that
only [C, C] tiles and one block's [C, col_block] tiles are live at a time; the kernels of
step 3 hold [16, *] tiles. The stage table asks for precise products for every input
dtype: 3xTF32 for fp32 inputs, TF32 for bf16 ones (``products.Fp32Products``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import (ChunkSpecs, add_chunk_rows, chunk_refs,
                                                   chunk_specs, program_rows)
from jaxcp.pallas.triton.common.launch import ChunkBlocks
from jaxcp.pallas.triton.common.products import Dots, KernelPrecision, dots as make_dots
from jaxcp.pallas.triton.common.tiles import f32, iota, lower
from jaxcp.pallas.triton.common.unit_rows import (in_place, operand_row_scales,
                                                  xla_normalize_vjp)
from jaxcp.pallas.triton.kda.gates import (ChunkGates, SubChunkGates, check_gate_bound,
                                           diagonal_fits)
from jaxcp.pallas.triton.kda.sub_chunks import (SUB_CHUNK, SubChunk, check_chunk, chunk_axis,
                                                sub_chunk_axis, sub_chunk_specs)
from jaxcp.terms import ChunkTerms


def _sum_products(product, xs, ys):
    """sum_j xs[j] @ ys[j]^T."""
    return sum(product(x, y.T) for x, y in zip(xs, ys))


# the token slabs the kernels read and write in place (``unit_rows.in_place``)
_TOKENS = ("q", "k", "v", "beta", "do", "q_rows", "k_rows", "dq_in", "dk_in", "dbeta_in",
           "dq", "dk", "dv", "dbeta")

_InterRefs = refs_type("_InterRefs", "q k G do h v_new x dvn dq dk dw dG mq",
                       "q_rows k_rows token_start token_count")


def _inter_kernel(*refs, names, scale, dots, blocks):
    """Step 1 of the module docstring for one (chunk, head): q, k, G [C, K], do, v_new, dvn
    [C, V], h, x [K, V] -> dq, dk, dw, dG [C, K] and Mq [C, C], float32."""
    r = named(_InterRefs, names, refs)
    r = in_place(r, program_rows(r, r.G.shape[0], blocks.chunk_axis), _TOKENS)
    C, K = r.k.shape
    V = r.do.shape[-1]
    bk, bv = blocks.cols(K), blocks.cols(V)
    dot = dots.plain
    value_cols = [pl.ds(j * bv, bv) for j in range(V // bv)]
    tiles = lambda ref: [f32(ref[:, c]) for c in value_cols]
    dattn = _sum_products(dot, tiles(r.do), tiles(r.v_new))
    r.mq[...] = lower(dattn * scale, strict=False)
    last_row = iota((C, bk), 0) == C - 1

    # loops, not unrolled, so that no block's tiles are live in another's
    def block(i, carry):
        ch = ChunkGates(r.G, pl.multiple_of(i * bk, bk), bk)

        def value_block(j, acc):
            dqg, dkd, dw, d_decay = acc
            vcols = pl.ds(pl.multiple_of(j * bv, bv), bv)
            h, x = f32(r.h[ch.cols, vcols]), f32(r.x[ch.cols, vcols])
            return (dqg + dot(f32(r.do[:, vcols]), h.T),
                    dkd + dot(f32(r.v_new[:, vcols]), x.T),
                    dw - dot(f32(r.dvn[:, vcols]), h.T),
                    d_decay + jnp.sum(h * x, axis=1))

        zero = jnp.zeros((C, bk), jnp.float32)
        dqg, dkd, dw, d_decay = lax.fori_loop(0, V // bv, value_block,
                                              (zero, zero, zero, jnp.zeros((bk,), jnp.float32)))
        dqg = dqg * (ch.eg * scale)
        dkd = dkd * ch.tail
        r.dw[:, ch.cols] = dw
        r.dq[:, ch.cols] = dqg
        r.dk[:, ch.cols] = dkd
        dkd_k = dkd * ch.load(r.k)
        dG_last = jnp.sum(dkd_k, axis=0, keepdims=True) + d_decay[None, :] * ch.last
        r.dG[:, ch.cols] = ch.load(r.q) * dqg - dkd_k + jnp.where(last_row, dG_last, 0.0)
        return carry

    lax.fori_loop(0, K // bk, block, 0)


_WYRefs = refs_type("_WYRefs", "k v G beta w u inv dvn dw dk_in dG_in dk dv dG dbeta da",
                    "k_rows token_start token_count")


def _wy_kernel(*refs, names, dots, blocks):
    """Step 2 of the module docstring for one (chunk, head): k, G, w, dw [C, K], v, u, dvn
    [C, V], beta [C], T [C, C]; dk, dG [C, K] added to in place (dk_in, dG_in) -> dv
    [C, V] (in its ref's dtype), dbeta [C] and dA [C, C], float32."""
    r = named(_WYRefs, names, refs)
    r = in_place(r, program_rows(r, r.G.shape[0], blocks.chunk_axis), _TOKENS)
    C, K = r.k.shape
    V = r.v.shape[-1]
    bk, bv = blocks.cols(K), blocks.cols(V)
    dot = dots.plain
    dot_t = lambda a, b: dot(a.T, b)
    beta = f32(r.beta[...])[:, None]

    def value_block(j, carry):
        da, dbeta = carry
        cols = pl.ds(pl.multiple_of(j * bv, bv), bv)
        dy = dot_t(f32(r.inv[...]), f32(r.dvn[:, cols]))
        r.dv[:, cols] = dy * beta
        return (da - dot(dy, f32(r.u[:, cols]).T),
                dbeta + jnp.sum(dy * f32(r.v[:, cols]), axis=1))

    def key_block(i, carry):
        da, dbeta = carry
        ch = ChunkGates(r.G, pl.multiple_of(i * bk, bk), bk)
        k = ch.load(r.k)
        dxk = dot_t(f32(r.inv[...]), ch.load(r.dw))
        da = da - dot(dxk, ch.load(r.w).T)
        dxk_eg = dxk * ch.eg
        r.dk[:, ch.cols] = ch.load(r.dk_in) + dxk_eg * beta
        r.dG[:, ch.cols] = ch.load(r.dG_in) + beta * dxk_eg * k
        return da, dbeta + jnp.sum(dxk_eg * k, axis=1)

    carry = (jnp.zeros((C, C), jnp.float32), jnp.zeros((C,), jnp.float32))
    carry = lax.fori_loop(0, V // bv, value_block, carry)
    da, dbeta = lax.fori_loop(0, K // bk, key_block, carry)
    r.dbeta[...] = dbeta
    r.da[...] = lower(da, strict=True)


_AcrossRefs = refs_type("_AcrossRefs", "q k G beta mq da dq_in dk_in dG_in dbeta_in dq dk dG "
                                        "dbeta", "q_rows k_rows token_start token_count")


def _across_kernel(*refs, names, dots, blocks):
    """Step 3 of the module docstring across sub-chunks, for one (chunk, head): from q, k,
    G [C, K], beta [C], Mq, dA [C, C], adds the gated sums over the pairs (l, p) in
    different sub-chunks to dq, dk, dG [C, K] and dbeta [C] in place. For sub-chunks j
    before i, with r the first row of i, the decays of the block (i, j) factor as
    E_lp = left_l right_p, left = exp(G_i - G_r) on the rows of i and right = exp(G_r - G_j)
    on the rows of j (both <= 1), one pair of [S, bk] factors shared by the row sums of i
    and the column sums of j:

        Rq_i += left o sum_j Mq_ij (k_j o right),   R_i += left o sum_j dA_ij (k_j o right)
        Cq_j += right o Mq_ij^T (q_i o left),      Q_j += right o dA_ij^T (beta_i k_i o left)

    The sub-chunks are taken last to first, so that the sums of each are complete when its
    own row sums are."""
    r = named(_AcrossRefs, names, refs)
    r = in_place(r, program_rows(r, r.G.shape[0], blocks.chunk_axis), _TOKENS)
    C, K = r.k.shape
    S, n = SUB_CHUNK, C // SUB_CHUNK
    bk = blocks.cols(K)
    dot = dots.plain
    rows = SubChunk.of
    beta = [f32(r.beta[rows(s)])[:, None] for s in range(n)]

    def key_block(c, dbeta):
        cols = pl.ds(pl.multiple_of(c * bk, bk), bk)
        G = lambda s: f32(r.G[rows(s), cols])
        k = lambda s: f32(r.k[rows(s), cols])
        zero = jnp.zeros((S, bk), jnp.float32)
        cq, ck, dbeta = [zero] * n, [zero] * n, list(dbeta)
        for i in reversed(range(n)):
            q, k_i = f32(r.q[rows(i), cols]), k(i)
            rq = rk = zero
            if i > 0:
                G_first = f32(r.G[rows(i, 1), cols])
                left = jnp.exp(G(i) - G_first)
                q_left, k_left = q * left, beta[i] * k_i * left
                for j in range(i):
                    right = jnp.exp(G_first - G(j))
                    k_right = k(j) * right
                    mq, da = f32(r.mq[rows(i), rows(j)]), f32(r.da[rows(i), rows(j)])
                    rq, rk = rq + dot(mq, k_right), rk + dot(da, k_right)
                    cq[j] = cq[j] + right * dot(mq.T, q_left)
                    ck[j] = ck[j] + right * dot(da.T, k_left)
                rq, rk = left * rq, left * rk
            cols_sum = cq[i] + ck[i]
            r.dq[rows(i), cols] = f32(r.dq_in[rows(i), cols]) + rq
            r.dk[rows(i), cols] = f32(r.dk_in[rows(i), cols]) + beta[i] * rk + cols_sum
            r.dG[rows(i), cols] = (f32(r.dG_in[rows(i), cols]) + q * rq
                                   + (beta[i] * rk - cols_sum) * k_i)
            dbeta[i] = dbeta[i] + jnp.sum(k_i * rk, axis=1)
        return tuple(dbeta)

    dbeta = lax.fori_loop(0, K // bk, key_block,
                          tuple(f32(r.dbeta_in[rows(s)]) for s in range(n)))
    for s in range(n):
        r.dbeta[rows(s)] = dbeta[s]


_DiagonalRefs = refs_type("_DiagonalRefs", "q k G beta mq da mq_flat da_flat dq_in dk_in "
                                            "dG_in dbeta_in dq dk dG dbeta",
                          "q_rows k_rows token_start token_count")


def _diagonal_kernel(*refs, names, gate_bound, dots, blocks):
    """Step 3 of the module docstring within sub-chunk b of one (chunk, head): from q, k, G
    [C, K], beta [C], Mq, dA [C, C] (and as mq_flat, da_flat [C * C]), adds the gated sums
    over the pairs inside b, and Mq's diagonal terms, to the S rows of b of dq, dk, dG
    [S, K] and dbeta [S] in place: where b ``diagonal_fits`` (under a gate bound, always),
    four products of the diagonal blocks of Mq and dA with the factor tiles of
    ``diagonal_factors``; elsewhere one partner row p at a time, the entries of Mq and dA in
    its row and column of the diagonal block gathered from the flat matrices."""
    r = named(_DiagonalRefs, names, refs)
    S = SUB_CHUNK
    sc = SubChunk(sub_chunk_axis(blocks.sub_chunks_first))
    chunk = program_rows(r, r.G.shape[0], chunk_axis(blocks))
    r = chunk_refs(in_place(r, chunk, ("q", "k", "beta", "q_rows", "k_rows")),
                   chunk.sub(sc.first, S), ("dq_in", "dk_in", "dbeta_in", "dq", "dk", "dbeta"))
    C, K = r.k.shape
    bk = blocks.cols(K)
    dot = dots.plain
    own = sc.own
    mq_diagonal = sc.diagonal_of(r.mq_flat, C)[:, None]
    beta_own = f32(r.beta[own])[:, None]
    zero = jnp.zeros((S, bk), jnp.float32)
    # the diagonal block's rows and columns as products (``SubChunkGates.diagonal_factors``);
    # Mq's diagonal is added apart
    mq_block = lower(f32(r.mq[own, own]), strict=True)
    da_block = f32(r.da[own, own])
    fits = gate_bound is not None or diagonal_fits(r.G, sc.first)

    def diagonal_products(gates, q_own, k_own):
        left, right = gates.diagonal_factors()
        k_right, k_left = k_own * right, k_own * left
        return (left * dot(mq_block, k_right), left * dot(da_block, k_right),
                right * dot(mq_block.T, q_own * left),
                right * dot(da_block.T, k_left * beta_own))

    def block(j, dbeta):
        cols = pl.ds(pl.multiple_of(j * bk, bk), bk)
        gates = SubChunkGates(r.G, cols, sc)
        q_own, k_own = sc.rows(r.q, cols), sc.rows(r.k, cols)

        # within the sub-chunk: the diagonal block's entries in the partner's column (the
        # sub-chunk's rows as the later i) and row (as the earlier j)
        def partner(pt, acc):
            rq, rk, cq, ck = acc
            mq_col = jnp.where(pt.later, sc.column_of(r.mq_flat, pt.index, C), 0.0)[:, None]
            da_col = jnp.where(pt.later, sc.column_of(r.da_flat, pt.index, C), 0.0)[:, None]
            mq_row = jnp.where(pt.earlier, sc.row_of(r.mq_flat, pt.index, C), 0.0)[:, None]
            da_row = (jnp.where(pt.earlier, sc.row_of(r.da_flat, pt.index, C), 0.0)[:, None]
                      * f32(r.beta[pl.ds(pt.row, 1)]))
            k_p = f32(r.k[pl.ds(pt.row, 1), cols]) * pt.decay
            q_p = f32(r.q[pl.ds(pt.row, 1), cols]) * pt.decay
            return rq + mq_col * k_p, rk + da_col * k_p, cq + mq_row * q_p, ck + da_row * k_p

        pairs = lambda: lax.fori_loop(0, S, lambda p, acc: partner(gates.partner(p), acc),
                                      (zero,) * 4)
        products = lambda: diagonal_products(gates, q_own, k_own)
        if gate_bound is not None:
            rq, rk, cq, ck = products()
        else:
            rq, rk, cq, ck = lax.cond(fits, products, pairs)
        r.dq[:, cols] = f32(r.dq_in[:, cols]) + rq + mq_diagonal * k_own
        r.dk[:, cols] = (f32(r.dk_in[:, cols]) + mq_diagonal * q_own + beta_own * rk
                         + cq + ck)
        r.dG[:, cols] = (f32(r.dG_in[:, cols]) + q_own * rq + beta_own * rk * k_own
                         - (cq + ck) * k_own)
        return dbeta + jnp.sum(k_own * rk, axis=1)

    r.dbeta[...] = lax.fori_loop(0, K // bk, block, f32(r.dbeta_in[...]))


class _Call(NamedTuple):
    """What the kernel launches of one ``chunk_grads`` call share: the token inputs q, k,
    v, beta and the chunk cumsum G; row_scales, the operands q_rows, k_rows
    (``operand_row_scales``; empty without normalize_qk); the layout;
    the products; the launch configuration of ``kda_grads_inter`` and ``kda_grads_wy``."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    G: jax.Array
    beta: jax.Array
    row_scales: dict
    layout: object
    dots: Dots
    blocks: ChunkBlocks
    interpret: bool

    @property
    def square(self) -> tuple:
        """The shape of a [C, C] matrix per chunk, [NT, B, HV, C, C]."""
        return self.G.shape[:4] + (self.G.shape[3],)

    def specs(self, blocks: ChunkBlocks | None = None) -> ChunkSpecs:
        """The BlockSpecs and grid of a per-chunk launch with blocks (the call's own if
        None)."""
        heads_first = (blocks or self.blocks).heads_first
        return chunk_specs(self.G.shape[3], self.k.shape[1], heads_first)

    def inputs(self, sp, entries, row_scales: tuple[str, ...] = ("q_rows", "k_rows")):
        """The inputs (name, spec, value) in order, then the row scales named (token slabs
        under the BlockSpecs sp; where given) and the layout's table."""
        ins = Operands()
        for name, spec, val in entries:
            ins.add(name, spec, val)
        for name in row_scales:
            if name in self.row_scales:
                ins.add(name, sp.token(None), self.row_scales[name])
        add_chunk_rows(ins, sp, self.layout)
        return ins

    def static(self, blocks: ChunkBlocks | None = None) -> dict:
        """A kernel's static arguments: the products and its launch configuration, blocks
        (the call's own if None)."""
        blocks = blocks or self.blocks
        return dict(params=blocks.params(self.interpret), dots=self.dots, blocks=blocks)


def _f32(struct, like):
    """The ShapeDtypeStruct of a float32 output shaped like the array `like`."""
    return struct(like.shape, jnp.float32)


def _launch_inter(c: _Call, do, h, v_new, x, dvn, scale: float) -> dict:
    """Step 1 (``kda_grads_inter``): dq, dk, dw, dG and Mq."""
    sp, (_, _, _, C, K), V = c.specs(), c.G.shape, c.v.shape[-1]
    state = sp.block(K, V)
    ins = c.inputs(sp, (("q", sp.token(K), c.q), ("k", sp.token(K), c.k),
                        ("G", sp.tile(K), c.G), ("do", sp.token(V), do), ("h", state, h),
                        ("v_new", sp.tile(V), v_new), ("x", state, x),
                        ("dvn", sp.tile(V), dvn)))

    def outs(out, struct):
        for name in ("dq", "dk"):
            out.add(name, sp.token(K), _f32(struct, c.k))
        for name in ("dw", "dG"):
            out.add(name, sp.tile(K), _f32(struct, c.G))
        out.add("mq", sp.tile(C), struct(c.square, jnp.float32))

    return call(_inter_kernel, sp.grid(*c.G.shape[:3]), ins, outs, name="kda_grads_inter",
                scale=scale, **c.static())[0]


def _launch_wy(c: _Call, terms: ChunkTerms, dvn, inter: dict) -> dict:
    """Step 2 (``kda_grads_wy``): dv (in v's dtype), dbeta and dA, and inter's dk, dG
    added to in place."""
    sp, (_, _, _, C, K), V = c.specs(), c.G.shape, c.v.shape[-1]
    ins = c.inputs(sp, (("k", sp.token(K), c.k), ("v", sp.token(V), c.v),
                        ("G", sp.tile(K), c.G), ("beta", sp.token(None), c.beta),
                        ("w", sp.tile(K), terms.w), ("u", sp.tile(V), terms.u),
                        ("inv", sp.tile(C), terms.inv), ("dvn", sp.tile(V), dvn),
                        ("dw", sp.tile(K), inter["dw"]), ("dk_in", sp.token(K), inter["dk"]),
                        ("dG_in", sp.tile(K), inter["dG"])), row_scales=("k_rows",))

    def outs(out, struct):
        out.add("dk", sp.token(K), _f32(struct, c.k))
        out.add("dv", sp.token(V), struct(c.v.shape, c.v.dtype))
        out.add("dG", sp.tile(K), _f32(struct, c.G))
        out.add("dbeta", sp.token(None), _f32(struct, c.beta))
        out.add("da", sp.tile(C), struct(c.square, jnp.float32))

    return call(_wy_kernel, sp.grid(*c.G.shape[:3]), ins, outs, name="kda_grads_wy",
                aliases={"dk_in": "dk", "dG_in": "dG"}, **c.static())[0]


def _launch_gated_sums(c: _Call, kernel, grid, sp, whole, own_chunk, mq, da, partial: dict,
                       extra=(), qk_grads_dtype=jnp.float32, **static) -> dict:
    """One kernel of step 3, in place: q, k, beta and the row scales under sp.token, G
    and Mq, dA [C, C] under whole (the chunk's block of a chunk-layout array); the
    partial dq, dk, dbeta (token slabs) and dG (own_chunk, the program's rows of the
    chunk layout) in and out; extra: more (name, spec, value) inputs. dq, dk leave in
    qk_grads_dtype, written in place where that is float32, as new arrays otherwise (every
    row is some program's)."""
    C, K = c.G.shape[3:]
    ins = c.inputs(sp, (("q", sp.token(K), c.q), ("k", sp.token(K), c.k),
                        ("G", whole(K), c.G), ("beta", sp.token(None), c.beta),
                        ("mq", whole(C), mq), ("da", whole(C), da), *extra,
                        ("dq_in", sp.token(K), partial["dq"]),
                        ("dk_in", sp.token(K), partial["dk"]),
                        ("dG_in", own_chunk(K), partial["dG"]),
                        ("dbeta_in", sp.token(None), partial["dbeta"])))

    def outs(out, struct):
        for name in ("dq", "dk"):
            out.add(name, sp.token(K), struct(c.k.shape, qk_grads_dtype))
        out.add("dG", own_chunk(K), _f32(struct, c.G))
        out.add("dbeta", sp.token(None), _f32(struct, c.beta))

    aliases = {"dG_in": "dG", "dbeta_in": "dbeta"}
    if jnp.dtype(qk_grads_dtype) == jnp.float32:
        aliases.update(dq_in="dq", dk_in="dk")
    return call(kernel, grid, ins, outs, aliases=aliases, **static)[0]


def _launch_across(c: _Call, mq, da, partial: dict, blocks: ChunkBlocks) -> dict:
    """Step 3 across sub-chunks (``kda_grads_gated_sums``), with its launch configuration."""
    sp = c.specs(blocks)
    return _launch_gated_sums(c, _across_kernel, sp.grid(*c.G.shape[:3]), sp, sp.tile, sp.tile,
                              mq, da, partial, name="kda_grads_gated_sums",
                              **c.static(blocks))


def _launch_diagonal(c: _Call, mq, da, partial: dict, gate_bound: float | None,
                     qk_grads_dtype, blocks: ChunkBlocks) -> dict:
    """Step 3 within sub-chunks, and Mq's diagonal (``kda_grads_diagonal_sums``), the last
    kernel, with its launch configuration: dq, dk leave in qk_grads_dtype."""
    NT, B, HV, C, _ = c.G.shape
    ss = sub_chunk_specs(NT, B, HV, C, c.k.shape[1], blocks)
    flat = lambda m: m.reshape(NT, B, HV, C * C)
    return _launch_gated_sums(c, _diagonal_kernel, ss.grid, ss, ss.chunk, ss.rows, mq, da,
                              partial, extra=(("mq_flat", ss.square_flat, flat(mq)),
                                              ("da_flat", ss.square_flat, flat(da))),
                              qk_grads_dtype=qk_grads_dtype, name="kda_grads_diagonal_sums",
                              gate_bound=gate_bound, **c.static(blocks))


def chunk_grads(q, k, v, G, beta, scale: float, layout, terms: ChunkTerms, h, v_new, x, dvn,
                do, *, gate_bound: float | None = None, normalize_qk: bool = False,
                interpret: bool = False, precision: KernelPrecision = KernelPrecision(),
                blocks: ChunkBlocks | None = None, across_blocks: ChunkBlocks | None = None,
                diagonal_blocks: ChunkBlocks | None = None):
    """Twin of xla.grads.chunk_grads(..., gate=Gate.CHANNEL) (module docstring), but that
    the gate comes as its chunk cumsum G and leaves as dG: (dq, dk, dv, dG, dbeta), dq and
    dk in q's dtype (float32 with normalize_qk), dv in v's, dG and dbeta float32.
    q, k [B, T, HV, K], v, do [B, T, HV, V], beta [B, T, HV] are read in place at the rows
    of the ChunkLayout layout, and dq, dk, dv, dbeta written so, in their shapes; G and dG
    [NT, B, HV, C, K] are in the chunk layout (``gate_cumsum.chunk_gate``, whose backward
    turns dG into the gate's cotangent); h, x [NT, B, HV, K, V], v_new, dvn
    [NT, B, HV, C, V]. terms must carry the inverse (``intra_chunk(...,
    with_inverse=True)``). gate_bound as in ``intra.intra_chunk``. normalize_qk:
    q, k are raw, the kernels read them L2-normalised (as ``intra_chunk(normalize_qk=True)``),
    and dq, dk are the cotangents of the raw q, k (the normalisation's vjp by XLA).
    precision: precise, every product at precision.products (``products.Fp32Products``),
    else bf16 products.
    blocks: the launch configuration of ``kda_grads_inter`` and ``kda_grads_wy``
    (``ChunkBlocks.kda_grads`` if None); across_blocks that of ``kda_grads_gated_sums``
    (``ChunkBlocks.grads_across_sub_chunks`` if None); diagonal_blocks that of
    ``kda_grads_diagonal_sums`` (``ChunkBlocks.grads_sub_chunk`` if None)."""
    if terms.inv is None:
        raise ValueError("terms: chunk_grads needs terms.inv, from intra_chunk(with_inverse=True)")
    check_gate_bound(gate_bound)
    check_chunk(G.shape[3])
    c = _Call(q, k, v, G, beta, operand_row_scales(q, k, normalize_qk), layout,
              make_dots(precision, interpret, rounded=True),
              blocks or ChunkBlocks.kda_grads(), interpret)
    inter = _launch_inter(c, do, h, v_new, x, dvn, scale)
    wy = _launch_wy(c, terms, dvn, inter)
    sums = _launch_across(c, inter["mq"], wy["da"],
                          dict(dq=inter["dq"], dk=wy["dk"], dG=wy["dG"], dbeta=wy["dbeta"]),
                          across_blocks or ChunkBlocks.grads_across_sub_chunks())
    # dq, dk in q's dtype (no conversion pass after the kernels), but in float32 for the
    # normalisation's vjp by XLA
    qk_grads_dtype = jnp.float32 if normalize_qk else q.dtype
    sums = _launch_diagonal(c, inter["mq"], wy["da"], sums, gate_bound, qk_grads_dtype,
                            diagonal_blocks or ChunkBlocks.grads_sub_chunk(k.shape[-1]))
    dq, dk = sums["dq"], sums["dk"]
    if normalize_qk:
        dq, dk = xla_normalize_vjp(q, dq), xla_normalize_vjp(k, dk)
    return dq, dk, wy["dv"], sums["dG"], sums["dbeta"]
