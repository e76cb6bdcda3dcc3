"""Pallas (Triton-lowered) intra-chunk terms of GDN, one program per (chunk, batch, head).

Twin of ``jaxcp.xla.intra.intra_chunk`` for a scalar gate (Kg = 1). The token tensors are
read in place, token-major: q, k [B, T, HV, K], v [B, T, HV, V], g, beta [B, T, HV], chunk c
the rows from ``ChunkLayout.token_start[c]`` on (from c C without a table; see
``jaxcp.pallas.tokens``). The terms are written in chunk layout, [NT, B, HV, C, ...].

Forward, with G = cumsum(g) inside the chunk and E_ij = exp(G_i - G_j):

    A      = strict_lower(beta_i (k_i . k_j) E_ij)
    T      = (I + A)^-1, merging diagonal blocks of size 1, 2, 4, ..., C/2
             (_unit_lower_inverse)
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
row updates). K and V are walked in blocks of 64 columns so that no [C, K] or [C, V] tile
stays live across the kernel (at K = 256 they would not fit in registers).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.l2norm import L2NORM_EPS
from jaxcp.layout import ChunkLayout
from jaxcp.pallas.state import _bf16_dot, _dot, _params, fp32_precision
from jaxcp.pallas.tokens import ChunkRows, Tile, has_table, slab_spec
from jaxcp.vma import unify
from jaxcp.xla.intra import ChunkTerms


class _Dots(NamedTuple):
    """a @ b with fp32 accumulation: `native` for tiles as loaded (bf16 MMA for bf16
    inputs), `plain` for products with fp32 operands (the inverse's chain included),
    `split` for an fp32 [C, C] a times a tile b as loaded."""
    native: callable
    plain: callable
    split: callable


def _dots(precise: bool, interpret: bool, *, rounded: bool = False) -> _Dots:
    """precise (fp32 inputs): 3xTF32 everywhere, on tensor cores (``fp32_precision``).
    Otherwise (bf16 inputs): bf16 products of the inputs and single TF32 products of fp32
    tiles, the inverse's chain included: its error, ~2e-4 relative on w, is far under the
    bf16 rounding w is stored with (~2e-3; scripts/inverse_precision.py); `split` takes the
    fp32 factor as two bf16 parts (``state._dot``), measured faster than one TF32 product
    for w and u (H100: op forward 4.47 -> 4.01 ms at T = 32768, H = 64, K = 128). rounded (bf16
    inputs only): fp32 operands are rounded to bf16 for `plain` products, for kernels whose
    results are gradients. Interpret mode (CPU) computes IEEE fp32."""
    def dot(precision):
        return partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    if interpret or precise:
        exact = dot(fp32_precision(interpret))
        return _Dots(exact, exact, lambda a, b: exact(a, b.astype(jnp.float32)))
    tf32 = dot(None)
    return _Dots(tf32, _bf16_dot if rounded else tf32,
                 partial(_dot, interpret=False, split=True))


def _unit_lower_inverse(a, dot):
    """(I + a)^-1 of a strictly lower [n, n] a (n a power of two), by merging diagonal blocks
    of doubling size s: with T_s the inverse of the block-diagonal part (blocks of size s) and
    N_s the part of a inside the 2s-blocks but outside the s-blocks,
    T_2s = T_s - T_s N_s T_s, per 2s-block the identity
    [[L11, 0], [A21, L22]]^-1 = [[T11, 0], [-T22 A21 T11, T22]] with Tii = Lii^-1.
    Every intermediate is a block of the true inverse, which the delta rule keeps bounded.
    (The power series (I - a)(I + a^2)(I + a^4)... is not safe: for correlated keys the
    entries of a^m grow like binomial coefficients, and fp32 loses the inverse in cancellation.)
    """
    n = a.shape[0]
    # i ^ j < 2s: i and j lie in the same aligned block of size 2s (s a power of two)
    x = lax.broadcasted_iota(jnp.int32, (n, n), 0) ^ lax.broadcasted_iota(jnp.int32, (n, n), 1)
    inv = jnp.where(x == 0, 1.0, 0.0) - jnp.where(x < 2, a, 0.0)
    s = 2
    while s < n:
        outer = (x >= s) & (x < 2 * s)
        inv = inv - dot(inv, dot(jnp.where(outer, a, 0.0), inv))
        s *= 2
    return inv


def _col_blocks(d: int) -> int:
    """Columns per step of the kernels' loops over K and V (keeps tiles in registers)."""
    return min(d, 64)


class _Gates(NamedTuple):
    """Gate terms of one chunk, from g [C]: G = cumsum(g). The [C, C] decay matrices are
    built where they are used, so that they do not hold registers in between."""
    G: jax.Array          # [C]
    eg: jax.Array         # exp(G) [C]
    tail: jax.Array       # exp(G_C - G) [C]
    last: jax.Array       # exp(G_C) []

    def strict(self):
        """exp(G_i - G_j) for j < i, else 0 [C, C]."""
        return self._decays(lambda rows, cols: rows > cols)

    def causal(self):
        """exp(G_i - G_j) for j <= i, else 0 [C, C]."""
        return self._decays(lambda rows, cols: rows >= cols)

    def _decays(self, visible):
        C = self.G.shape[0]
        rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
        cols = lax.broadcasted_iota(jnp.int32, (C, C), 1)
        return jnp.exp(jnp.where(visible(rows, cols), self.G[:, None] - self.G[None, :],
                                 -jnp.inf))


def _gates(g) -> _Gates:
    G = jnp.cumsum(g)
    total = jnp.sum(g)
    return _Gates(G, jnp.exp(G), jnp.exp(total - G), jnp.exp(total))


def _sum_dots(dot, x: Tile, ys, n: int):
    """sum_j x[:, block j] @ ys[j]^T over blocks j of n columns of x (ys: loaded blocks)."""
    acc = None
    for j, y in enumerate(ys):
        term = dot(x.cols(j, n), y.T)
        acc = term if acc is None else acc + term
    return acc


def _col_tiles(x: Tile, n: int):
    """The blocks of n columns of x, loaded."""
    return [x.cols(j, n) for j in range(x.width // n)]


def _gram(x: Tile, y: Tile, dots: _Dots, bk: int):
    """x y^T of two [C, K] tiles, in blocks of bk columns."""
    return _sum_dots(dots.native, x, _col_tiles(y, bk), bk)


def _inverse(k: Tile, beta, gates: _Gates, dots: _Dots, bk: int, rk=None):
    """T = (I + A)^-1 with A = strict_lower(beta_i (k_i . k_j) E_ij), the keys scaled by rk
    (``_row_scale``) when it is given."""
    kk = _scale_gram(_gram(k, k, dots, bk), rk, rk)
    return _unit_lower_inverse(beta[:, None] * kk * gates.strict(), dots.plain)


def _row_scale(x: Tile, bk: int, normalize: bool):
    """1 / sqrt(sum(x^2) + eps) of each row of a [C, d] tile ([C] float32), the L2 norm
    that ``jaxcp.l2norm.l2_normalize`` applies, or None (no normalisation). The kernels fold
    it into the row scales they apply anyway, so that normalised q and k never go through
    memory."""
    if not normalize:
        return None
    sq = sum(jnp.sum(jnp.square(c.astype(jnp.float32)), axis=1) for c in _col_tiles(x, bk))
    return lax.rsqrt(sq + L2NORM_EPS)


def _scale_gram(xy, rx, ry):
    """diag(rx) xy diag(ry) of a [C, C] gram (rows of x scaled by rx, of y by ry)."""
    return xy if rx is None else xy * rx[:, None] * ry[None, :]


def _times(row_vec, r):
    """row_vec * r, r None meaning 1."""
    return row_vec if r is None else row_vec * r


def _on_tokens(r, valid):
    """Row factors r ([C], None meaning 1) zeroed past the chunk's tokens (valid [C] from
    ``ChunkRows.valid``, None: every row a token)."""
    if valid is None:
        return r
    return valid if r is None else r * valid


def _chunk_rows(refs: list, C: int, table: bool) -> ChunkRows:
    """The rows of this program's chunk (grid axis 0) in the token slabs: from the layout's
    table (table: the two leading refs of `refs`, token_start and token_count [1, 1], are
    taken off it), else c C on."""
    if not table:
        return ChunkRows(pl.program_id(0) * C, None, C)
    start_ref, count_ref = refs.pop(0), refs.pop(0)
    return ChunkRows(start_ref[0, 0], count_ref[0, 0], C)


def _with_table(layout: ChunkLayout, args: list) -> list:
    """The layout's token_start, token_count before args when it places chunks by table."""
    return [layout.token_start, layout.token_count] + args if has_table(layout) else args


def _intra_kernel(*refs, scale, dots, normalize, table, C):
    refs = list(refs)
    rows = _chunk_rows(refs, C, table)
    (q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, attn_ref, q_rows_ref, k_rows_ref,
     decay_ref, *inv_ref) = refs
    # q, k, v read loose (``jaxcp.pallas.tokens``): past the tokens, beta and the row factors
    # rq, rk are zero, so those rows drop out of A, w, u and attn (whose rows there are zero)
    q, k, v = (Tile(r, rows, loose=True) for r in (q_ref, k_ref, v_ref))
    g = Tile(g_ref, rows).all().astype(jnp.float32)
    beta = Tile(beta_ref, rows).all().astype(jnp.float32)
    gates = _gates(g)
    bk, bv = _col_blocks(k.width), _col_blocks(v.width)
    valid = rows.valid()
    rq = _on_tokens(_row_scale(q, bk, normalize), valid)
    rk = _on_tokens(_row_scale(k, bk, normalize), valid)
    attn = _scale_gram(_gram(q, k, dots, bk), rq, rk) * gates.causal() * scale
    attn_ref[...] = attn.astype(attn_ref.dtype)
    q_rows_ref[...] = _times(gates.eg * scale, rq)
    k_rows_ref[...] = _times(gates.tail, rk)
    decay_ref[...] = gates.last
    # w and u from the inverse as stored, as recompute_w_u computes them again
    inv = _inverse(k, beta, gates, dots, bk, rk).astype(w_ref.dtype).astype(jnp.float32)
    if inv_ref:
        inv_ref[0][...] = inv.astype(inv_ref[0].dtype)
    _store_w_u(w_ref, u_ref, inv, k, v, beta, gates, rk, dots)


def _store_w_u(w_ref, u_ref, inv, k: Tile, v: Tile, beta, gates: _Gates, rk, dots: _Dots):
    """w = T diag(beta exp(G) rk) k and u = T diag(beta) v of one chunk."""
    _store_products(Tile(w_ref), inv * _times(beta * gates.eg, rk)[None, :], k, dots,
                    _col_blocks(k.width))
    _store_products(Tile(u_ref), inv * beta[None, :], v, dots, _col_blocks(v.width))


def _w_u_kernel(*refs, dots, normalize, table, C):
    """w, u, k_rows and decay of one chunk from its kept inverse T (see ``recompute_w_u``)."""
    refs = list(refs)
    rows = _chunk_rows(refs, C, table)
    k_ref, v_ref, g_ref, beta_ref, inv_ref, w_ref, u_ref, k_rows_ref, decay_ref = refs
    k, v = Tile(k_ref, rows), Tile(v_ref, rows)
    gates = _gates(Tile(g_ref, rows).all().astype(jnp.float32))
    beta = Tile(beta_ref, rows).all().astype(jnp.float32)
    rk = _row_scale(k, _col_blocks(k.width), normalize)
    k_rows_ref[...] = _times(gates.tail, rk)
    decay_ref[...] = gates.last
    _store_w_u(w_ref, u_ref, inv_ref[...].astype(jnp.float32), k, v, beta, gates, rk, dots)


def _store_products(out: Tile, a, x: Tile, dots: _Dots, n: int):
    """out = a @ x for an fp32 [C, C] a and [C, d] tiles, in blocks of n columns."""
    for j in range(x.width // n):
        out.set_cols(j, n, dots.split(a, x.cols(j, n)))


class _ChunkSpecs(NamedTuple):
    """BlockSpecs of a grid over (chunk, batch, head): `tile(d)` and `vec` for chunk terms
    [NT, B, HV, C, d] and [NT, B, HV, C]; `token(d)` for the slab of a token tensor
    [B, T, HV, d] (d None: [B, T, HV]); `chunk_rows` for the layout's token_start and
    token_count [NT, B]; `scalar` for [NT, B, HV]."""
    tile: Callable
    vec: pl.BlockSpec
    token: Callable
    chunk_rows: pl.BlockSpec
    scalar: pl.BlockSpec


def _chunk_specs(C: int, T: int) -> _ChunkSpecs:
    return _ChunkSpecs(
        tile=lambda d: pl.BlockSpec((None, None, None, C, d), lambda t, b, h: (t, b, h, 0, 0)),
        vec=pl.BlockSpec((None, None, None, C), lambda t, b, h: (t, b, h, 0)),
        token=lambda d: slab_spec(T, d, lambda t, b, h: (b, h, 0)),
        chunk_rows=pl.BlockSpec((1, 1), lambda t, b, h: (t, b)),
        scalar=pl.BlockSpec((None, None, None), lambda t, b, h: (t, b, h)),
    )


def intra_chunk(q, k, v, g, beta, scale: float, layout: ChunkLayout, chunk_size: int, *,
                with_inverse: bool = False, interpret: bool = False, precise: bool = True,
                out_dtype=jnp.float32, normalize_qk: bool = False) -> ChunkTerms:
    """Twin of xla.intra.intra_chunk for GDN, in the row-factored form of ``ChunkTerms``
    (qg, kd are q, k as given). q, k, v, g, beta are token-major, [B, T, HV, ...] with g
    [B, T, HV] or [B, T, HV, 1], chunk c being chunk_size rows from layout.token_start[c]
    (from c chunk_size when the layout has no table; ``jaxcp.pallas.tokens``); w, u,
    attn, inv, decay and the row factors are in chunk layout [NT, B, HV, ...]. precise:
    fp32 inputs (3xTF32 products) or bf16 inputs (bf16 and TF32 products, see ``_dots``);
    out_dtype is the dtype of w, u, attn and inv (decay and the row factors stay float32); w
    and u are products of the inverse rounded to it, so that ``recompute_w_u`` gives the
    same w and u from the stored inverse.
    normalize_qk: the terms of l2_normalize(q), l2_normalize(k) (the kernel scales rows)."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NT = layout.chunk_starts.shape[0]
    C = chunk_size
    sp = _chunk_specs(C, T)
    g = g.reshape(B, T, HV)
    table = has_table(layout)
    args, mat = unify(_with_table(layout, [q, k, v, g, beta]))
    out = lambda *s, dtype=out_dtype: jax.ShapeDtypeStruct((NT, B, HV) + s, dtype,
                                                           manual_axis_type=mat)
    tiles = [(C, K), (C, V), (C, C)]
    w, u, attn, q_rows, k_rows, decay, *inv = pl.pallas_call(
        partial(_intra_kernel, scale=scale, dots=_dots(precise, interpret),
                normalize=normalize_qk, table=table, C=C), grid=(NT, B, HV),
        in_specs=[sp.chunk_rows] * (2 * table) + [sp.token(K), sp.token(K), sp.token(V),
                                                  sp.token(None), sp.token(None)],
        out_specs=([sp.tile(d) for _, d in tiles] + [sp.vec] * 2 + [sp.scalar]
                   + [sp.tile(C)] * with_inverse),
        out_shape=([out(*s) for s in tiles] + [out(C, dtype=jnp.float32)] * 2
                   + [out(dtype=jnp.float32)] + [out(C, C)] * with_inverse),
        **_params(interpret, 0))(*args)
    q, k = args[2 * table:][:2]
    return ChunkTerms(w=w, u=u, qg=q, kd=k, decay=decay[..., None], attn=attn,
                      inv=inv[0] if inv else None, q_rows=q_rows, k_rows=k_rows)


def kept_for_w_u(terms: ChunkTerms) -> ChunkTerms:
    """What ``recompute_w_u`` needs of the terms of ``intra_chunk(..., with_inverse=True)``:
    the inverse, attn and q_rows (w, u, k_rows, decay are recomputed; qg, kd are q, k)."""
    if terms.inv is None:
        raise ValueError("terms: keeping them for recompute_w_u needs their inverse "
                         "(intra_chunk(..., with_inverse=True))")
    return terms._replace(w=None, u=None, qg=None, kd=None, decay=None, k_rows=None)


def recompute_w_u(q, k, v, g, beta, layout: ChunkLayout, chunk_size: int, kept: ChunkTerms,
                  *, interpret: bool = False, precise: bool = True,
                  normalize_qk: bool = False) -> ChunkTerms:
    """The terms of ``intra_chunk(q, k, v, g, beta, ..., with_inverse=True)`` from those kept
    by ``kept_for_w_u``: only w = T diag(beta exp(G)) k, u = T diag(beta) v (and the row
    factors k_rows, decay of exp(G)) are computed, from the kept inverse T, so that the
    backward neither inverts again nor recomputes attn (one program per (chunk, batch, head);
    k, v, g, beta token-major as in ``intra_chunk``; w, u in the dtype of the inverse).
    q is only placed in the terms (qg)."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NT, C = layout.chunk_starts.shape[0], chunk_size
    sp = _chunk_specs(C, T)
    g = g.reshape(B, T, HV)
    table = has_table(layout)
    args, mat = unify(_with_table(layout, [k, v, g, beta, kept.inv]))
    out = lambda *s, dtype=kept.inv.dtype: jax.ShapeDtypeStruct((NT, B, HV) + s, dtype,
                                                                manual_axis_type=mat)
    w, u, k_rows, decay = pl.pallas_call(
        partial(_w_u_kernel, dots=_dots(precise, interpret), normalize=normalize_qk,
                table=table, C=C), grid=(NT, B, HV),
        in_specs=[sp.chunk_rows] * (2 * table) + [sp.token(K), sp.token(V), sp.token(None),
                                                  sp.token(None), sp.tile(C)],
        out_specs=[sp.tile(K), sp.tile(V), sp.vec, sp.scalar],
        out_shape=[out(C, K), out(C, V), out(C, dtype=jnp.float32), out(dtype=jnp.float32)],
        **_params(interpret, 0))(*args)
    return kept._replace(w=w, u=u, qg=q, kd=args[2 * table], decay=decay[..., None],
                         k_rows=k_rows)
