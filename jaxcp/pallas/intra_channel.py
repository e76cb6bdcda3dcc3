"""Pallas (Triton-lowered) intra-chunk terms of KDA: two kernels, each one program per
(chunk, batch, head): the gated sums A and attn (``gated_sums``), then T = (I + A)^-1 and
the tiles of the state recurrences (``wy_terms``). Split so that neither holds the other's
tiles in registers; the backward reruns only the second, from the T the forward kept.

Twin of ``jaxcp.xla.intra.intra_chunk`` for the per-channel gate (``Gate.CHANNEL``), in the
chunk layout: q, k [NT, B, HV, C, K], v [NT, B, HV, C, V], g [NT, B, HV, C, K] (natural-log
decays, g <= 0), beta [NT, B, HV, C]. The terms come in the plain form of ``ChunkTerms``:
w, qg, kd [NT, B, HV, C, K], u [..., C, V], attn and the inverse [..., C, C], decay
[..., K].

With G = cumsum(g) over the chunk's rows (per channel),

    A_ij    = beta_i sum_d k_id k_jd exp(G_id - G_jd)     for j < i
    attn_ij = scale  sum_d q_id k_jd exp(G_id - G_jd)     for j <= i

is not a matrix product: the decay differs per channel. It is computed in two parts, in
sub-chunks of S = 16 rows, so that no factor exceeds 1 whatever the gates:

- j before the sub-chunk of i, whose first row is r: exp(G_id - G_jd) =
  exp(G_id - G_rd) exp(G_rd - G_jd), both factors <= 1, so these blocks are tensor-core
  products (x exp(G - G_r)) (k exp(G_r - G))^T, one per sub-chunk;
- j in the sub-chunk of i: token by token in the distance delta = i - j (1 .. S - 1), each
  exp(sum_{s = j+1 .. i} g_s) from a partial sum grown by one row of g per step, so that it
  is exact to rounding even for gates of -1e3 (no difference of two large cumsums).

Every exponent is <= 0, so the terms are finite for any g <= 0. Then

    T = (I + A)^-1 (``unit_lower_inverse``),   w = T diag(beta) (k exp(G)),
    u = T diag(beta) v,   qg = scale q exp(G),   kd = k exp(G_C - G),   decay = exp(G_C).

K and V are walked in blocks of ``ChunkBlocks.col_block`` columns; the sums over channels
add up over the blocks. A and attn pass between the kernels in float32 ([C, C] per chunk).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.channel import (SUB_CHUNK, ChannelBlock, f32, iota, sub_chunks,
                                  within_sub_chunks)
from jaxcp.pallas.common import (Dots, Operands, call, chunk_specs, dots as make_dots, named,
                                 refs_type, unit_lower_inverse)
from jaxcp.pallas.config import ChunkBlocks
from jaxcp.xla.intra import ChunkTerms

def _cross_sub_chunks(q, k, G, products, a_kk, a_qk):
    """Adds to a_kk, a_qk [C, C] the parts of sum_d x_id k_jd exp(G_id - G_jd) (x = k, then
    q) with j before the sub-chunk of i, for one block of channels."""
    for sc in sub_chunks(G):
        right = (k * sc.right).T
        a_kk = a_kk + products(k * sc.left, right)
        a_qk = a_qk + products(q * sc.left, right)
    return a_kk, a_qk


def _within_sub_chunks(q, k, ch: ChannelBlock, k_ref, by_delta):
    """Adds to by_delta = (kk, qk) [C, S] the sums sum_d x_id k_jd exp(G_id - G_jd) of the
    pairs j = i - delta in i's sub-chunk (x = k, q) at column delta, for the block of
    channels ch of k_ref. Carrying [C, S] instead of [C, C] accumulators through
    the loop keeps the kernel inside the registers."""
    C, bk = k.shape
    at_delta = lambda s, x: jnp.where(iota((C, SUB_CHUNK), 1) == s.delta,
                                      jnp.sum(x, axis=1)[:, None], 0.0)

    def body(s, acc):
        kk, qk = acc
        e = s.decay * ch.rows(k_ref)(s.partner)
        return kk + at_delta(s, k * e), qk + at_delta(s, q * e)

    return within_sub_chunks(ch.g_rows, C, bk, body, by_delta, upward=False)


def _spread(by_delta, a):
    """a [C, C] plus by_delta [C, S] placed on the bands: a_{i, i - delta} += by_delta[i, delta]."""
    C = a.shape[0]
    at = iota((C, C), 0) - iota((C, C), 1)
    for delta in range(1, SUB_CHUNK):
        a = a + jnp.where(at == delta, _column(by_delta, delta)[:, None], 0.0)
    return a


def _column(x, j: int):
    """Column j of a [C, n] tile as [C]."""
    return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1)


_SumsRefs = refs_type("_SumsRefs", "q k g beta a attn")


def _sums_kernel(*refs, names, scale, dots: Dots, blocks: ChunkBlocks):
    """A = strict_lower(beta_i sum_d k_id k_jd E_ijd), attn = scale lower(sum_d q_id k_jd
    E_ijd) of one (chunk, head)."""
    r = named(_SumsRefs, names, refs)
    C, K = r.k.shape
    bk = blocks.cols(K)
    a_kk = a_qk = jnp.zeros((C, C), jnp.float32)
    by_delta = (jnp.zeros((C, SUB_CHUNK), jnp.float32),) * 2
    qk_diagonal = jnp.zeros((C,), jnp.float32)          # j = i, decay 1
    for j in range(K // bk):
        ch = ChannelBlock(r.g, j, bk)
        q, k = ch.load(r.q), ch.load(r.k)
        a_kk, a_qk = _cross_sub_chunks(q, k, ch.G, dots.plain, a_kk, a_qk)
        by_delta = _within_sub_chunks(q, k, ch, r.k, by_delta)
        qk_diagonal = qk_diagonal + jnp.sum(q * k, axis=1)
    a_qk = _spread(by_delta[1], a_qk) + jnp.where(iota((C, C), 0) == iota((C, C), 1),
                                                  qk_diagonal[:, None], 0.0)
    r.attn[...] = (a_qk * scale).astype(r.attn.dtype)
    r.a[...] = (f32(r.beta[...])[:, None] * _spread(by_delta[0], a_kk)).astype(r.a.dtype)


_TermsRefs = refs_type("_TermsRefs", "q k v g beta w u qg kd decay", "a inv_in inv")


def _terms_kernel(*refs, names, scale, dots: Dots, blocks: ChunkBlocks):
    """T = (I + A)^-1 (or the T given), then w, u, qg, kd, decay of one (chunk, head)."""
    r = named(_TermsRefs, names, refs)
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
        ch = ChannelBlock(r.g, j, bk)
        q, k = ch.load(r.q), ch.load(r.k)
        r.w[:, ch.cols] = dots.plain(inv_beta, k * ch.eg).astype(r.w.dtype)
        r.qg[:, ch.cols] = (q * ch.eg * scale).astype(r.qg.dtype)
        r.kd[:, ch.cols] = (k * ch.tail).astype(r.kd.dtype)
        r.decay[ch.cols] = ch.last[0]
    for j in range(V // bv):
        cols = pl.ds(j * bv, bv)
        r.u[:, cols] = dots.plain(inv_beta, f32(r.v[:, cols])).astype(r.u.dtype)


def _check_chunk(C: int) -> None:
    if C % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK} for the Pallas KDA "
                         f"kernels, got {C}")


def gated_sums(q, k, g, beta, scale: float, *, interpret: bool = False, precise: bool = True,
               blocks: ChunkBlocks | None = None):
    """(A, attn) [NT, B, HV, C, C] float32: A = strict_lower(beta_i sum_d k_id k_jd
    exp(G_id - G_jd)) and attn = scale lower(sum_d q_id k_jd exp(G_id - G_jd)), G the chunk
    cumsum of g (module docstring). Shapes and precise as in ``intra_chunk``."""
    NT, B, HV, C, K = k.shape
    _check_chunk(C)
    blocks = blocks or ChunkBlocks.default(K, q.dtype)
    sp = chunk_specs(C, C)
    ins = Operands()
    for name, x in (("q", q), ("k", k), ("g", g)):
        ins.add(name, sp.tile(K), x)
    ins.add("beta", sp.vec, beta)

    def outs(out, struct):
        out.add("a", sp.tile(C), struct((NT, B, HV, C, C), jnp.float32))
        out.add("attn", sp.tile(C), struct((NT, B, HV, C, C), jnp.float32))

    res, _ = call(_sums_kernel, (NT, B, HV), ins, outs, name="kda_gated_sums",
                  params=blocks.params(interpret), scale=scale,
                  dots=make_dots(precise, interpret), blocks=blocks)
    return res["a"], res["attn"]


def wy_terms(q, k, v, g, beta, scale: float, *, a=None, inv=None, with_inverse: bool = False,
             interpret: bool = False, precise: bool = True,
             blocks: ChunkBlocks | None = None) -> ChunkTerms:
    """The terms but attn: T = (I + a)^-1 from ``gated_sums``'s a, or the inverse inv given
    (exactly one of the two), then w, u, qg, kd, decay (module docstring); with_inverse also
    returns T (a only). attn is left None."""
    if (a is None) == (inv is None):
        raise ValueError("wy_terms: give exactly one of a and inv")
    NT, B, HV, C, K = k.shape
    V = v.shape[-1]
    _check_chunk(C)
    blocks = blocks or ChunkBlocks.default(K, q.dtype)
    sp = chunk_specs(C, C)
    ins = Operands()
    for name, x, d in (("q", q, K), ("k", k, K), ("v", v, V), ("g", g, K)):
        ins.add(name, sp.tile(d), x)
    ins.add("beta", sp.vec, beta)
    if a is not None:
        ins.add("a", sp.tile(C), a)
    else:
        ins.add("inv_in", sp.tile(C), inv)
    per_channel = pl.BlockSpec((None, None, None, K), lambda t, b, h: (t, b, h, 0))

    def outs(out, struct):
        terms = lambda *s: struct((NT, B, HV) + s, jnp.float32)
        out.add("w", sp.tile(K), terms(C, K))
        out.add("u", sp.tile(V), terms(C, V))
        out.add("qg", sp.tile(K), terms(C, K))
        out.add("kd", sp.tile(K), terms(C, K))
        out.add("decay", per_channel, terms(K))
        if with_inverse and a is not None:
            out.add("inv", sp.tile(C), terms(C, C))

    res, _ = call(_terms_kernel, (NT, B, HV), ins, outs, name="kda_wy_terms",
                  params=blocks.params(interpret), scale=scale,
                  dots=make_dots(precise, interpret), blocks=blocks)
    return ChunkTerms(w=res["w"], u=res["u"], qg=res["qg"], kd=res["kd"], decay=res["decay"],
                      attn=None, inv=res.get("inv", inv))


def intra_chunk(q, k, v, g, beta, scale: float, *, with_inverse: bool = False,
                interpret: bool = False, precise: bool = True,
                blocks: ChunkBlocks | None = None) -> ChunkTerms:
    """Twin of xla.intra.intra_chunk(..., gate=Gate.CHANNEL) (see the module docstring):
    ``gated_sums``, then ``wy_terms``. q, k, g [NT, B, HV, C, K], v [NT, B, HV, C, V], beta
    [NT, B, HV, C], chunk layout, C a multiple of 16. precise: 3xTF32 products (fp32
    inputs), else single TF32 products of the fp32 factor tiles (bf16 inputs; see
    ``common.dots``). The terms are float32, as the jnp twin's. blocks: the launch
    configuration (``ChunkBlocks.default`` if None)."""
    kw = dict(interpret=interpret, precise=precise, blocks=blocks)
    a, attn = gated_sums(q, k, g, beta, scale, **kw)
    terms = wy_terms(q, k, v, g, beta, scale, a=a, with_inverse=with_inverse, **kw)
    return terms._replace(attn=attn)


def kept_for_terms(terms: ChunkTerms):
    """What the forward keeps for ``recompute_terms``: T and attn."""
    return terms.inv, terms.attn


def recompute_terms(q, k, v, g, beta, scale: float, kept, **kw) -> ChunkTerms:
    """The terms with the inverse again from the kept (T, attn): w, u, qg, kd and decay by
    ``wy_terms`` from T, without the gated sums. kw as in ``intra_chunk``."""
    inv, attn = kept
    return wy_terms(q, k, v, g, beta, scale, inv=inv, **kw)._replace(attn=attn)
