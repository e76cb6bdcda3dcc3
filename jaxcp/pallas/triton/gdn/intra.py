"""Pallas (Triton-lowered) intra-chunk terms of GDN, one program per (chunk, batch, head).

Twin of ``jaxcp.xla.intra.intra_chunk`` for a scalar gate (Kg = 1). The token tensors are
read in place, token-major: q, k [B, T, HV, K], v [B, T, HV, V], g, beta [B, T, HV], chunk c
the rows from ``ChunkLayout.token_start[c]`` on (from c C without a table; see
``chunk_rows``). The terms are written in chunk layout, [NT, B, HV, C, ...].

Forward, with G = cumsum(g) inside the chunk and E_ij = exp(G_i - G_j):

    A      = strict_lower(beta_i (k_i . k_j) E_ij)
    T      = (I + A)^-1, merging diagonal blocks of size 1, 2, 4, ..., C/2
             (``products.unit_lower_inverse``)
    w      = (T diag(beta exp(G))) k;      u = (T diag(beta)) v
    attn   = lower(scale (q_i . k_j) E_ij),   decay = exp(G_C)
    q_rows = scale exp(G),   k_rows = exp(G_C - G)

The terms come in the row-factored form of ``ChunkTerms``: qg = diag(q_rows) q and
kd = diag(k_rows) k are left to the state kernels, which scale rows of their products, so
only w, u, attn (and the inverse) are written per chunk.

With normalize_qk the kernel reads raw q, k and computes the terms of their L2-normalised
rows: the row factors 1 / ||q_i||, 1 / ||k_i|| join the row scales above (and scale
the grams and the row factors), so the normalised q and k are never written.

The backward keeps the forward's inverse, attn and q_rows (``kept_for_w_u``) and recomputes
only w, u and the k row factors from them (``recompute_w_u``, as FLA's recompute_w_u).

The inverse is 2 (log2(C) - 1) tensor-core dots (forward substitution would be C dependent
row updates). K and V are walked in blocks of ``ChunkBlocks.col_block`` columns so that no
[C, K] or [C, V] tile stays live across the kernel (at K = 256 they would not fit in
registers).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxcp.layout import ChunkLayout
from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import (ChunkRef, add_chunk_rows, chunk_specs,
                                                   program_rows)
from jaxcp.pallas.triton.common.launch import ChunkBlocks
from jaxcp.pallas.triton.common.products import (Dots, KernelPrecision, dots as make_dots,
                                                 gram, unit_lower_inverse)
from jaxcp.pallas.triton.common.unit_rows import on_tokens, row_scales, scale_gram, times
from jaxcp.pallas.triton.gdn.gates import ScalarGates, scalar_gates
from jaxcp.terms import ChunkTerms


def _inverse(k: ChunkRef, beta, gates: ScalarGates, dots: Dots, bk: int, rk=None):
    """T = (I + A)^-1 with A = strict_lower(beta_i (k_i . k_j) E_ij), the keys scaled by rk
    (``row_scales``) when it is given."""
    kk = scale_gram(gram(k, k, dots, bk), rk, rk)
    return unit_lower_inverse(beta[:, None] * kk * gates.strict(), dots.plain)


_IntraRefs = refs_type("_IntraRefs", "q k v g beta w u attn q_rows k_rows decay",
                        "inv token_start token_count")


def _intra_kernel(*refs, names, scale, dots, normalize, blocks, C):
    r = named(_IntraRefs, names, refs)
    rows = program_rows(r, C, blocks.chunk_axis)
    # q, k, v read loose (``chunk_rows``): past the tokens, beta and the row factors
    # rq, rk are zero, so those rows drop out of A, w, u and attn (whose rows there are zero)
    q, k, v = (ChunkRef(ref, rows, loose=True) for ref in (r.q, r.k, r.v))
    g = ChunkRef(r.g, rows).all().astype(jnp.float32)
    beta = ChunkRef(r.beta, rows).all().astype(jnp.float32)
    gates = scalar_gates(g)
    bk = blocks.cols(k.width)
    valid = rows.valid()
    rq = on_tokens(row_scales(q, bk, normalize), valid)
    rk = on_tokens(row_scales(k, bk, normalize), valid)
    attn = scale_gram(gram(q, k, dots, bk), rq, rk) * gates.causal() * scale
    r.attn[...] = attn.astype(r.attn.dtype)
    r.q_rows[...] = times(gates.eg * scale, rq)
    r.k_rows[...] = times(gates.tail, rk)
    r.decay[...] = gates.last
    # w and u from the inverse as stored, as recompute_w_u computes them again
    inv = _inverse(k, beta, gates, dots, bk, rk).astype(r.w.dtype).astype(jnp.float32)
    if r.inv is not None:
        r.inv[...] = inv.astype(r.inv.dtype)
    _store_w_u(r.w, r.u, inv, k, v, beta, gates, rk, dots, blocks)


def _store_w_u(w_ref, u_ref, inv, k: ChunkRef, v: ChunkRef, beta, gates: ScalarGates, rk,
               dots: Dots, blocks: ChunkBlocks):
    """w = T diag(beta exp(G) rk) k and u = T diag(beta) v of one chunk."""
    _store_products(ChunkRef(w_ref), inv * times(beta * gates.eg, rk)[None, :], k, dots,
                    blocks.cols(k.width))
    _store_products(ChunkRef(u_ref), inv * beta[None, :], v, dots, blocks.cols(v.width))


_WURefs = refs_type("_WURefs", "k v g beta inv w u k_rows decay",
                     "token_start token_count")


def _w_u_kernel(*refs, names, dots, normalize, blocks, C):
    """w, u, k_rows and decay of one chunk from its kept inverse T (see ``recompute_w_u``)."""
    r = named(_WURefs, names, refs)
    rows = program_rows(r, C, blocks.chunk_axis)
    k, v = ChunkRef(r.k, rows), ChunkRef(r.v, rows)
    gates = scalar_gates(ChunkRef(r.g, rows).all().astype(jnp.float32))
    beta = ChunkRef(r.beta, rows).all().astype(jnp.float32)
    rk = row_scales(k, blocks.cols(k.width), normalize)
    r.k_rows[...] = times(gates.tail, rk)
    r.decay[...] = gates.last
    _store_w_u(r.w, r.u, r.inv[...].astype(jnp.float32), k, v, beta, gates, rk, dots, blocks)


def _store_products(out: ChunkRef, a, x: ChunkRef, dots: Dots, n: int):
    """out = a @ x for an fp32 [C, C] a and [C, d] tiles, in blocks of n columns."""
    for j in range(x.width // n):
        out.set_cols(j, n, dots.split(a, x.cols(j, n)))


def _token_inputs(sp, layout: ChunkLayout, tokens) -> Operands:
    """The layout's table (where it has one), then the token tensors (name, array, d) under
    sp.token(d) (d None: [B, T, HV])."""
    ins = Operands()
    add_chunk_rows(ins, sp, layout)
    for name, x, d in tokens:
        ins.add(name, sp.token(d), x)
    return ins


def intra_chunk(q, k, v, g, beta, scale: float, layout: ChunkLayout, chunk_size: int, *,
                with_inverse: bool = False, interpret: bool = False,
                precision: KernelPrecision = KernelPrecision(), normalize_qk: bool = False,
                blocks: ChunkBlocks | None = None) -> ChunkTerms:
    """Twin of xla.intra.intra_chunk for GDN, in the row-factored form of ``ChunkTerms``
    (qg, kd are q, k as given). q, k, v, g, beta are token-major, [B, T, HV, ...] with g
    [B, T, HV] or [B, T, HV, 1], chunk c being chunk_size rows from layout.token_start[c]
    (from c chunk_size when the layout has no table; ``chunk_rows``); w, u,
    attn, inv, decay and the row factors are in chunk layout [NT, B, HV, ...]. precision:
    the products (``products.dots``) and, as tile_dtype, the dtype of w, u, attn and inv
    (decay and the row factors stay float32); w and u are products of the inverse rounded
    to it, so that ``recompute_w_u`` gives the same w and u from the stored inverse.
    normalize_qk: the terms of l2_normalize(q), l2_normalize(k) (the kernel scales rows).
    blocks: the launch configuration (``ChunkBlocks.gdn`` if None)."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NT, C = layout.chunk_starts.shape[0], chunk_size
    blocks = blocks or ChunkBlocks.gdn(K)
    sp = chunk_specs(C, T, blocks.heads_first)
    ins = _token_inputs(sp, layout, (("q", q, K), ("k", k, K), ("v", v, V),
                                     ("g", g.reshape(B, T, HV), None), ("beta", beta, None)))

    def outs(out, struct):
        terms = lambda *s, dtype=precision.tile_dtype: struct((NT, B, HV) + s, dtype)
        out.add("w", sp.tile(K), terms(C, K))
        out.add("u", sp.tile(V), terms(C, V))
        out.add("attn", sp.tile(C), terms(C, C))
        out.add("q_rows", sp.vec, terms(C, dtype=jnp.float32))
        out.add("k_rows", sp.vec, terms(C, dtype=jnp.float32))
        out.add("decay", sp.scalar, terms(dtype=jnp.float32))
        if with_inverse:
            out.add("inv", sp.tile(C), terms(C, C))

    res, args = call(_intra_kernel, sp.grid(NT, B, HV), ins, outs, name="gdn_intra_chunk",
                     params=blocks.params(interpret), scale=scale,
                     dots=make_dots(precision, interpret), normalize=normalize_qk,
                     blocks=blocks, C=C)
    q, k = args[ins.index("q")], args[ins.index("k")]
    return ChunkTerms(w=res["w"], u=res["u"], qg=q, kd=k, decay=res["decay"][..., None],
                      attn=res["attn"], inv=res.get("inv"), q_rows=res["q_rows"],
                      k_rows=res["k_rows"])


def kept_for_w_u(terms: ChunkTerms) -> ChunkTerms:
    """What ``recompute_w_u`` needs of the terms of ``intra_chunk(..., with_inverse=True)``:
    the inverse, attn and q_rows (w, u, k_rows, decay are recomputed; qg, kd are q, k)."""
    if terms.inv is None:
        raise ValueError("terms: keeping them for recompute_w_u needs their inverse "
                         "(intra_chunk(..., with_inverse=True))")
    return terms._replace(w=None, u=None, qg=None, kd=None, decay=None, k_rows=None)


def recompute_w_u(q, k, v, g, beta, layout: ChunkLayout, chunk_size: int, kept: ChunkTerms,
                  *, interpret: bool = False, precision: KernelPrecision = KernelPrecision(),
                  normalize_qk: bool = False, blocks: ChunkBlocks | None = None) -> ChunkTerms:
    """The terms of ``intra_chunk(q, k, v, g, beta, ..., with_inverse=True)`` from those kept
    by ``kept_for_w_u``: only w = T diag(beta exp(G)) k, u = T diag(beta) v (and the row
    factors k_rows, decay of exp(G)) are computed, from the kept inverse T, so that the
    backward neither inverts again nor recomputes attn (one program per (chunk, batch, head);
    k, v, g, beta token-major as in ``intra_chunk``; w, u in the dtype of the inverse;
    precision: its products, as in ``intra_chunk``).
    q is only placed in the terms (qg)."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NT, C = layout.chunk_starts.shape[0], chunk_size
    blocks = blocks or ChunkBlocks.gdn(K)
    sp = chunk_specs(C, T, blocks.heads_first)
    ins = _token_inputs(sp, layout, (("k", k, K), ("v", v, V),
                                     ("g", g.reshape(B, T, HV), None), ("beta", beta, None)))
    ins.add("inv", sp.tile(C), kept.inv)

    def outs(out, struct):
        terms = lambda *s, dtype=kept.inv.dtype: struct((NT, B, HV) + s, dtype)
        out.add("w", sp.tile(K), terms(C, K))
        out.add("u", sp.tile(V), terms(C, V))
        out.add("k_rows", sp.vec, terms(C, dtype=jnp.float32))
        out.add("decay", sp.scalar, terms(dtype=jnp.float32))

    res, args = call(_w_u_kernel, sp.grid(NT, B, HV), ins, outs, name="gdn_recompute_w_u",
                     params=blocks.params(interpret), dots=make_dots(precision, interpret),
                     normalize=normalize_qk, blocks=blocks, C=C)
    return kept._replace(w=res["w"], u=res["u"], qg=q, kd=args[ins.index("k")],
                         decay=res["decay"][..., None], k_rows=res["k_rows"])
