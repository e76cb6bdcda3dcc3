"""Pallas (Triton-lowered) intra-chunk terms of KDA: the gated sums A and attn
(``gated_sums``: their blocks across sub-chunks, one program per (chunk, batch, head), then
their diagonal blocks, one program per (chunk, batch, head, sub-chunk of 16 rows)), then
T = (I + A)^-1 and the tiles of the state recurrences (``wy_terms``, one program per
(chunk, batch, head)). The backward reruns only the last, from the T the forward kept.

Twin of ``jaxcp.xla.intra.intra_chunk`` for the per-channel gate (``Gate.CHANNEL``). The
token tensors are read in place (``chunk_rows``; packed sequences included): q, k
[B, T, HV, K], v [B, T, HV, V], beta [B, T, HV], each chunk at the rows the layout gives
it. The gate comes as G, the cumsum of the natural-log decays g <= 0 over each chunk's rows,
in the chunk layout [NT, B, HV, C, K] (``gate_cumsum.chunk_gate``). The terms come in the
plain form of ``ChunkTerms``, chunk layout: w, qg, kd [NT, B, HV, C, K], u [..., C, V],
attn and the inverse [..., C, C], decay [..., K].

With G = cumsum(g) over the chunk's rows (per channel),

    A_ij    = beta_i sum_d k_id k_jd exp(G_id - G_jd)     for j < i
    attn_ij = scale  sum_d q_id k_jd exp(G_id - G_jd)     for j <= i

is not a matrix product: the decay differs per channel. It is computed in sub-chunks of
S = 16 rows (``gates``), so that no factor overflows whatever the gates:

- j in a sub-chunk s before the sub-chunk of i, whose first row is r: exp(G_id - G_jd) =
  exp(G_id - G_rd) exp(G_rd - G_jd), both factors <= 1, so each such [S, S] block is a
  tensor-core product (x exp(G - G_r)) (k_s exp(G_r - G_s))^T;
- j in the sub-chunk of i: a product too, through the middle of G's span over the
  sub-chunk, where that span is at most 75 on every channel (``gates.diagonal_fits``,
  factors within e^+-37.5); elsewhere pair by pair, one column j at a time,
  exp(G_id - G_jd) <= 1 as the jnp twin takes it.

The terms are finite for any g <= 0. Then

    T = (I + A)^-1 (``unit_lower_inverse``),   w = T diag(beta) (k exp(G)),
    u = T diag(beta) v,   qg = scale q exp(G),   kd = k exp(G_C - G),   decay = exp(G_C).

K and V are walked in blocks of ``ChunkBlocks.col_block`` columns; the sums over channels
add up over the blocks. A and attn pass between the kernels in float32 ([C, C] per chunk).
With normalize_qk the kernels take the raw q, k and their rows' 1 / ||row|| ([C] per chunk,
by XLA) and read every row of q, k times it (``unit_rows.UnitRows``): the terms of the
L2-normalised rows, with no normalised copy in memory.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import (add_chunk_rows, chunk_refs, chunk_specs,
                                                   program_rows)
from jaxcp.pallas.triton.common.launch import ChunkBlocks
from jaxcp.pallas.triton.common.products import (Dots, KernelPrecision, dots as make_dots,
                                                 unit_lower_inverse)
from jaxcp.pallas.triton.common.tiles import f32, lower
from jaxcp.pallas.triton.common.unit_rows import add_row_scales, in_place, operand_row_scales
from jaxcp.pallas.triton.kda.gates import (ChunkGates, SubChunkGates, check_gate_bound,
                                           diagonal_factors, diagonal_fits)
from jaxcp.pallas.triton.kda.sub_chunks import (SUB_CHUNK, SubChunk, check_chunk, chunk_axis,
                                                sub_chunk_axis, sub_chunk_specs)
from jaxcp.terms import ChunkTerms

# the token slabs the kernels read in place (``unit_rows.in_place``)
_TOKENS = ("q", "k", "v", "beta", "q_rows", "k_rows")

_AcrossRefs = refs_type("_AcrossRefs", "q k G beta a attn",
                        "q_rows k_rows token_start token_count")


def _across_kernel(*refs, names, scale, gate_bound, dots: Dots, blocks: ChunkBlocks):
    """From q, k, G [C, K] and beta [C] of one (chunk, head), A = strict_lower(beta_i sum_d
    k_id k_jd E_ijd) and attn = scale lower(sum_d q_id k_jd E_ijd) [C, C] as [S, S] blocks:
    the blocks (i, j) across sub-chunks, j before i, each one product per block of bk
    channels, (x_i exp(G_i - G_r)) (k_j exp(G_r - G_j))^T with r the first row of i; the
    diagonal blocks as products too (``gates.diagonal_factors``) on the sub-chunks that
    ``diagonal_fits`` (under a gate bound, all; the others are zero here, and
    ``_diagonal_kernel`` writes them); zeros above the diagonal. The tiles of the other
    sub-chunks are loaded where a pair needs them (from L1), which holds fewer registers
    than keeping them."""
    r = named(_AcrossRefs, names, refs)
    r = in_place(r, program_rows(r, r.G.shape[0], blocks.chunk_axis), _TOKENS)
    C, K = r.k.shape
    S, n = SUB_CHUNK, C // SUB_CHUNK
    bk = blocks.cols(K)
    pairs = [(i, j) for i in range(n) for j in range(i + 1)]
    rows = SubChunk.of

    def key_block(c, acc):
        cols = pl.ds(pl.multiple_of(c * bk, bk), bk)
        G = lambda s: f32(r.G[rows(s), cols])
        k = lambda s: f32(r.k[rows(s), cols])
        acc = list(acc)
        for i in range(n):
            G_first, G_i, k_i = f32(r.G[rows(i, 1), cols]), G(i), k(i)
            from_first = jnp.exp(G_i - G_first)
            q_i = f32(r.q[rows(i), cols])
            for j in range(i + 1):
                if j < i:
                    left, right = from_first, jnp.exp(G_first - G(j))
                else:
                    G_last = f32(r.G[pl.ds(i * S + S - 1, 1), cols])
                    left, right = diagonal_factors(G_i, G_first, G_last)
                k_j = k(j) * right
                at = 2 * pairs.index((i, j))
                acc[at] = acc[at] + dots.plain(k_i * left, k_j.T)
                acc[at + 1] = acc[at + 1] + dots.plain(q_i * left, k_j.T)
        return tuple(acc)

    zero = jnp.zeros((S, S), jnp.float32)
    acc = lax.fori_loop(0, K // bk, key_block, (zero,) * (2 * len(pairs)))
    for at, (i, j) in enumerate(pairs):
        a, attn = acc[2 * at], acc[2 * at + 1]
        if i == j:    # the diagonal block's upper part is not a decay
            a, attn = lower(a, strict=True), lower(attn, strict=False)
            if gate_bound is None:
                fits = diagonal_fits(r.G, i * S)
                a, attn = jnp.where(fits, a, 0.0), jnp.where(fits, attn, 0.0)
        r.a[rows(i), rows(j)] = f32(r.beta[rows(i)])[:, None] * a
        r.attn[rows(i), rows(j)] = (scale * attn).astype(r.attn.dtype)
    for i in range(n):
        for j in range(i + 1, n):
            r.a[rows(i), rows(j)] = zero
            r.attn[rows(i), rows(j)] = zero.astype(r.attn.dtype)


_DiagonalRefs = refs_type("_DiagonalRefs", "q k G beta a_in attn_in a attn",
                          "q_rows k_rows token_start token_count")


def _diagonal_kernel(*refs, names, scale, blocks: ChunkBlocks):
    """The diagonal block of sub-chunk b of one (chunk, head) in A and attn (as in
    ``_across_kernel``), written in place into a, attn [S, C] (the sub-chunk's rows), where
    b does not ``diagonal_fits``: pair by pair, one partner row p of b at a time
    (``SubChunkGates.partners``), K in blocks of bk channels."""
    r = named(_DiagonalRefs, names, refs)
    S = SUB_CHUNK
    sc = SubChunk(sub_chunk_axis(blocks.sub_chunks_first))
    chunk = program_rows(r, r.G.shape[0], chunk_axis(blocks))
    r = chunk_refs(in_place(r, chunk, ("q", "k", "q_rows", "k_rows")),
                   chunk.sub(sc.first, S), ("beta",))
    K = r.k.shape[1]
    bk = blocks.cols(K)

    @pl.when(jnp.logical_not(diagonal_fits(r.G, sc.first)))
    def _():
        a = attn = jnp.zeros((S, S), jnp.float32)
        for cols in (pl.ds(j * bk, bk) for j in range(K // bk)):
            k, q = sc.rows(r.k, cols), sc.rows(r.q, cols)
            for pt in SubChunkGates(r.G, cols, sc).partners():
                k_p = f32(r.k[pl.ds(pt.row, 1), cols]) * pt.decay
                a = a + pt.column(jnp.sum(k * k_p, axis=1), pt.later)
                attn = attn + pt.column(jnp.sum(q * k_p, axis=1), ~pt.earlier)
        r.a[:, sc.own] = f32(r.beta[...])[:, None] * a
        r.attn[:, sc.own] = (scale * attn).astype(r.attn.dtype)


_TermsRefs = refs_type("_TermsRefs", "q k v G beta w u qg kd decay",
                       "a inv_in inv q_rows k_rows token_start token_count")


def _terms_kernel(*refs, names, scale, dots: Dots, blocks: ChunkBlocks):
    """T = (I + A)^-1 (or the T given), then w, u, qg, kd, decay of one (chunk, head)."""
    r = named(_TermsRefs, names, refs)
    r = in_place(r, program_rows(r, r.G.shape[0], blocks.chunk_axis), _TOKENS)
    K = r.k.shape[1]
    V = r.v.shape[-1]
    bk, bv = blocks.cols(K), blocks.cols(V)
    beta = f32(r.beta[...])
    if r.a is not None:
        inv = unit_lower_inverse(f32(r.a[...]), dots.plain)
    else:
        inv = f32(r.inv_in[...])
    if r.inv is not None:
        r.inv[...] = inv.astype(r.inv.dtype)
    inv_beta = inv * beta[None, :]
    for j in range(K // bk):
        ch = ChunkGates(r.G, j * bk, bk)
        q, k = ch.load(r.q), ch.load(r.k)
        r.w[:, ch.cols] = dots.plain(inv_beta, k * ch.eg).astype(r.w.dtype)
        r.qg[:, ch.cols] = (q * ch.eg * scale).astype(r.qg.dtype)
        r.kd[:, ch.cols] = (k * ch.tail).astype(r.kd.dtype)
        r.decay[ch.cols] = ch.last[0]
    for j in range(V // bv):
        cols = pl.ds(j * bv, bv)
        r.u[:, cols] = dots.plain(inv_beta, f32(r.v[:, cols])).astype(r.u.dtype)


def gated_sums(q, k, G, beta, scale: float, layout, *, gate_bound: float | None = None,
               q_rows=None, k_rows=None, interpret: bool = False,
               precision: KernelPrecision = KernelPrecision(),
               blocks: ChunkBlocks | None = None, diagonal_blocks: ChunkBlocks | None = None):
    """(A [NT, B, HV, C, C] float32, attn [NT, B, HV, C, C] precision.tile_dtype): A =
    strict_lower(beta_i sum_d k_id k_jd exp(G_id - G_jd)) and attn = scale lower(sum_d q_id
    k_jd exp(G_id - G_jd)), G the chunk cumsum of the decay (module docstring): every block
    by ``kda_gated_sums`` (one program per (chunk, batch, head); launch configuration
    blocks, ``ChunkBlocks.across_sub_chunks`` if None) but the diagonal blocks of
    sub-chunks that do not ``diagonal_fits``, which ``kda_diagonal_sums`` writes in place
    (one program per (chunk, batch, head, sub-chunk of 16 rows); diagonal_blocks,
    ``ChunkBlocks.sub_chunk`` if None; not launched under a gate bound). q_rows, k_rows
    [B, T, HV] (both or neither): the rows of q, k are taken times them
    (``unit_rows.UnitRows``). Shapes, layout, gate_bound and precision as in
    ``intra_chunk``."""
    check_gate_bound(gate_bound)
    B, T, HV, K = k.shape
    NT, C = G.shape[0], G.shape[3]
    check_chunk(C)
    blocks = blocks or ChunkBlocks.across_sub_chunks()
    sp = chunk_specs(C, T, blocks.heads_first)
    ins = Operands()
    for name, x in (("q", q), ("k", k)):
        ins.add(name, sp.token(K), x)
    ins.add("G", sp.tile(K), G)
    ins.add("beta", sp.token(None), beta)
    add_row_scales(ins, sp.token(None), q_rows, k_rows)
    add_chunk_rows(ins, sp, layout)

    def outs(spec):
        def add(out, struct):
            out.add("a", spec, struct((NT, B, HV, C, C), jnp.float32))
            out.add("attn", spec, struct((NT, B, HV, C, C), precision.tile_dtype))
        return add

    res, _ = call(_across_kernel, sp.grid(NT, B, HV), ins, outs(sp.tile(C)), name="kda_gated_sums",
                  params=blocks.params(interpret), scale=scale, gate_bound=gate_bound,
                  dots=make_dots(precision, interpret), blocks=blocks)
    if gate_bound is not None:
        return res["a"], res["attn"]
    diagonal_blocks = diagonal_blocks or ChunkBlocks.sub_chunk()
    ssp = sub_chunk_specs(NT, B, HV, C, T, diagonal_blocks)
    ins = Operands()
    for name, x in (("q", q), ("k", k)):
        ins.add(name, ssp.token(K), x)
    ins.add("G", ssp.chunk(K), G)
    ins.add("beta", ssp.token(None), beta)
    ins.add("a_in", ssp.rows(C), res["a"])
    ins.add("attn_in", ssp.rows(C), res["attn"])
    add_row_scales(ins, ssp.token(None), q_rows, k_rows)
    add_chunk_rows(ins, ssp, layout)
    res, _ = call(_diagonal_kernel, ssp.grid, ins, outs(ssp.rows(C)),
                  name="kda_diagonal_sums", params=diagonal_blocks.params(interpret),
                  aliases={"a_in": "a", "attn_in": "attn"}, scale=scale,
                  blocks=diagonal_blocks)
    return res["a"], res["attn"]


def wy_terms(q, k, v, G, beta, scale: float, layout, *, a=None, inv=None,
             with_inverse: bool = False, q_rows=None, k_rows=None, interpret: bool = False,
             precision: KernelPrecision = KernelPrecision(),
             blocks: ChunkBlocks | None = None) -> ChunkTerms:
    """The terms but attn: T = (I + a)^-1 from ``gated_sums``'s a, or the inverse inv given
    (exactly one of the two), then w, u, qg, kd, decay (module docstring); with_inverse also
    returns T (a only). attn is left None. Shapes and layout as in ``intra_chunk``; q_rows,
    k_rows as in ``gated_sums``."""
    if (a is None) == (inv is None):
        raise ValueError("wy_terms: give exactly one of a and inv")
    B, T, HV, K = k.shape
    NT, C = G.shape[0], G.shape[3]
    V = v.shape[-1]
    check_chunk(C)
    blocks = blocks or ChunkBlocks.wy_terms(K)
    sp = chunk_specs(C, T, blocks.heads_first)
    ins = Operands()
    for name, x, d in (("q", q, K), ("k", k, K), ("v", v, V)):
        ins.add(name, sp.token(d), x)
    ins.add("G", sp.tile(K), G)
    ins.add("beta", sp.token(None), beta)
    add_row_scales(ins, sp.token(None), q_rows, k_rows)
    add_chunk_rows(ins, sp, layout)
    if a is not None:
        ins.add("a", sp.tile(C), a)
    else:
        ins.add("inv_in", sp.tile(C), inv)
    per_channel = sp.block(K)

    def outs(out, struct):
        terms = lambda *s: struct((NT, B, HV) + s, jnp.float32)
        tiles = lambda *s: struct((NT, B, HV) + s, precision.tile_dtype)
        out.add("w", sp.tile(K), tiles(C, K))
        out.add("u", sp.tile(V), terms(C, V))
        out.add("qg", sp.tile(K), tiles(C, K))
        out.add("kd", sp.tile(K), tiles(C, K))
        out.add("decay", per_channel, terms(K))
        if with_inverse and a is not None:
            out.add("inv", sp.tile(C), terms(C, C))

    res, _ = call(_terms_kernel, sp.grid(NT, B, HV), ins, outs, name="kda_wy_terms",
                  params=blocks.params(interpret), scale=scale,
                  dots=make_dots(precision, interpret), blocks=blocks)
    return ChunkTerms(w=res["w"], u=res["u"], qg=res["qg"], kd=res["kd"], decay=res["decay"],
                      attn=None, inv=res.get("inv", inv))


def intra_chunk(q, k, v, G, beta, scale: float, layout, *, with_inverse: bool = False,
                gate_bound: float | None = None, normalize_qk: bool = False,
                interpret: bool = False, precision: KernelPrecision = KernelPrecision(),
                blocks: ChunkBlocks | None = None) -> ChunkTerms:
    """Twin of xla.intra.intra_chunk(..., gate=Gate.CHANNEL) (see the module docstring):
    ``gated_sums``, then ``wy_terms``. q, k [B, T, HV, K], v [B, T, HV, V], beta [B, T, HV]
    token-major, read in place at the rows of the ChunkLayout layout; G [NT, B, HV, C, K]
    the chunk cumsum of the decays g <= 0 (``gate_cumsum.chunk_gate``), C a multiple of 16.
    gate_bound: None (any g <= 0), or a bound in [-5, 0) that every gate is known to
    respect (g in [gate_bound, 0)): then every diagonal block is a product
    (``gates.diagonal_fits``) and the pair-by-pair kernel is not launched. precision:
    precise, 3xTF32 products (fp32 inputs), else single TF32 products of the fp32 factor
    tiles (bf16 inputs; see ``products.dots``). normalize_qk: q, k are raw, and the terms
    are those of their L2-normalised rows (the kernels scale the rows as they read them;
    ``l2_row_scales`` by XLA). The terms are float32, as the jnp twin's, but w, qg, kd
    and attn, which are precision.tile_dtype: float16 halves the bytes of the state
    recurrences' tiles and keeps the 10-bit mantissa their TF32 products keep, for terms
    that fit its range (every entry of qg, kd, attn is at most 1 in magnitude for
    L2-normalised q, k). blocks: the launch
    configuration of ``wy_terms`` (``ChunkBlocks.wy_terms`` if None); ``gated_sums`` runs
    with its own."""
    kw = dict(interpret=interpret, precision=precision,
              **operand_row_scales(q, k, normalize_qk))
    a, attn = gated_sums(q, k, G, beta, scale, layout, gate_bound=gate_bound, **kw)
    terms = wy_terms(q, k, v, G, beta, scale, layout, a=a, with_inverse=with_inverse, blocks=blocks,
                     **kw)
    return terms._replace(attn=attn)


def kept_for_terms(terms: ChunkTerms):
    """What the forward keeps for ``recompute_terms``: T and attn."""
    return terms.inv, terms.attn


def recompute_terms(q, k, v, G, beta, scale: float, layout, kept, *, normalize_qk: bool = False,
                    **kw) -> ChunkTerms:
    """The terms with the inverse again from the kept (T, attn): w, u, qg, kd and decay by
    ``wy_terms`` from T, without the gated sums. normalize_qk and kw as in
    ``intra_chunk``."""
    inv, attn = kept
    return wy_terms(q, k, v, G, beta, scale, layout, inv=inv,
                    **operand_row_scales(q, k, normalize_qk), **kw)._replace(attn=attn)

