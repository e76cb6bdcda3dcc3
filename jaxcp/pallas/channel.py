"""Gated sums over one sub-chunk with a per-channel gate (KDA), shared by the forward's
``kda_gated_sums`` and the backward's ``kda_grads_gated_sums``: every decay
exp(G_id - G_jd) (j before i, G the chunk cumsum of g <= 0) is built from factors <= 1, so
the sums are finite for any gate.

The chunk's C rows are cut into sub-chunks of S = 16 rows, and these kernels run one
program per (chunk, batch, head, sub-chunk b), on [S, bk] tiles: small enough that many
programs share an SM. Sub-chunk b holds the rows r .. e = r + S - 1. A pair (i, j), j < i:

- i in b, j before b (the rows of b as queries):
  exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both factors <= 1 (``RowFactors``);
- j in b, i after b (the rows of b as keys):
  exp(G_i - G_j) = exp(G_i - G_e) exp(G_e - G_j), both factors <= 1 (``ColumnFactors``);
- i and j in b: token by token in the distance delta = |i - j| (1 .. S - 1), the decay
  exp(sum of g over the rows j+1 .. i) a partial sum grown by one row of g per step
  (``within_sub_chunk``), exact to rounding even for gates of -1e3, where a difference of
  two cumsums of size ~1e4 keeps few digits.

The first two are tensor-core products of the sub-chunk's [S, C] rows (or columns) of a
[C, C] matrix with a [C, bk] tile, their factors differences of the chunk cumsum G, as in
the jnp stages. G comes to the kernels computed once: the row sums of one program and the
column sums of another then take the same rounded exponents for a pair (for the nonzero
decays, whose G_i and G_j are close, the differences are exact), and their terms in dg
cancel as the exact ones do.
"""
from __future__ import annotations

from functools import cached_property
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB_CHUNK = 16


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def f32(x):
    return x.astype(jnp.float32)


def row_at(x, i):
    """Row i (static or traced) of a [n, d] tile as [1, d] (a masked sum: registers cannot
    be indexed)."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def check_chunk(C: int) -> None:
    if C % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK} for the Pallas KDA "
                         f"kernels, got {C}")


class ChannelBlock:
    """The bk key columns from start of a whole-chunk program's [C, K] tiles: their slice,
    a loader of the block of a [C, K] ref, and the gate terms G = cumsum(g) and, when read,
    exp(G), exp(G_C - G) and exp(G_C) [1, bk]. G_C is the cumsum's own last row, so that
    G_C - G is rounded as G is."""

    def __init__(self, g_ref, start, bk: int):
        self.cols = pl.ds(start, bk)
        self.G = jnp.cumsum(f32(g_ref[:, self.cols]), axis=0)

    @cached_property
    def _G_last(self):
        return row_at(self.G, self.G.shape[0] - 1)

    @cached_property
    def eg(self):
        return jnp.exp(self.G)

    @cached_property
    def tail(self):
        return jnp.exp(self._G_last - self.G)

    @cached_property
    def last(self):
        return jnp.exp(self._G_last)

    def load(self, ref):
        return f32(ref[:, self.cols])


class SubChunkSpecs(NamedTuple):
    """BlockSpecs of a grid over (chunk, batch, head, sub-chunk) on chunk-layout arrays:
    `chunk(d)` the whole chunk [C, d] of [NT, B, HV, C, d], `chunk_vec` [C] of
    [NT, B, HV, C], `square_flat` a [C, C] matrix per chunk as [NT, B, HV, C * C];
    `rows(d)` and `rows_vec` the program's sub-chunk, S rows."""
    chunk: Callable
    chunk_vec: pl.BlockSpec
    square_flat: pl.BlockSpec
    rows: Callable
    rows_vec: pl.BlockSpec


def sub_chunk_specs(C: int) -> SubChunkSpecs:
    S = SUB_CHUNK
    return SubChunkSpecs(
        chunk=lambda d: pl.BlockSpec((None, None, None, C, d), lambda t, b, h, s: (t, b, h, 0, 0)),
        chunk_vec=pl.BlockSpec((None, None, None, C), lambda t, b, h, s: (t, b, h, 0)),
        square_flat=pl.BlockSpec((None, None, None, C * C), lambda t, b, h, s: (t, b, h, 0)),
        rows=lambda d: pl.BlockSpec((None, None, None, S, d), lambda t, b, h, s: (t, b, h, s, 0)),
        rows_vec=pl.BlockSpec((None, None, None, S), lambda t, b, h, s: (t, b, h, s)),
    )


class SubChunk:
    """This program's sub-chunk (grid axis 3): first row r, local rows l = 0 .. S - 1 [S],
    and loaders of its rows (or of rows idx [S] of the chunk) of a block of columns."""

    def __init__(self):
        self.first = pl.program_id(3) * SUB_CHUNK
        self.last = self.first + SUB_CHUNK - 1
        self.local = iota((SUB_CHUNK,), 0)

    def rows(self, ref, cols):
        """Its S rows of the chunk tile ref, float32 [S, bk]."""
        return f32(ref[pl.ds(self.first, SUB_CHUNK), cols])

    def gather(self, ref, local_idx, cols):
        """Rows first + local_idx (local_idx [S], clipped into the sub-chunk) of ref, float32."""
        idx = self.first + jnp.clip(local_idx, 0, SUB_CHUNK - 1)
        return f32(ref[idx, cols])

    def gather_vec(self, ref, local_idx):
        idx = self.first + jnp.clip(local_idx, 0, SUB_CHUNK - 1)
        return f32(ref[idx])

    def band_of(self, m_flat, step, C: int, *, transposed: bool):
        """Entries of a [C, C] matrix m (given as m_flat [C * C]) by local row l, [S]: at
        step (a ``Step``) m[first + l, partner] (transposed: m[partner, first + l]), 0 where
        the partner is outside the sub-chunk; at step 0 the diagonal m[first + l, first + l]."""
        own = self.first + self.local
        if isinstance(step, int):
            return f32(m_flat[own * (C + 1)])
        idx = step.column * C + own if transposed else own * C + step.column
        return jnp.where(step.same, f32(m_flat[idx]), 0.0)

    def columns(self, C: int):
        """The chunk column of each entry of an [S, C] tile, [S, C]."""
        return iota((SUB_CHUNK, C), 1)

    def diagonal(self, C: int):
        """[S, C] mask of the entries (i, i) of the sub-chunk's rows of a [C, C] matrix."""
        return self.columns(C) == self.first + self.local[:, None]


class ChannelGates:
    """Gate terms of one block of channels for a sub-chunk program, from the chunk cumsum
    G [C, bk] (computed once, outside the kernels, so that every program reads the same
    rounded values) and g on the sub-chunk's rows (for ``within_sub_chunk``)."""

    def __init__(self, G_ref, g_ref, cols, sc: SubChunk):
        self.G_ref, self.g_ref, self.cols, self.sc = G_ref, g_ref, cols, sc
        self.G = f32(G_ref[:, cols])
        self.G_own = sc.rows(G_ref, cols)

    def _row(self, i):
        return f32(self.G_ref[pl.ds(i, 1), self.cols])

    def row_factors(self) -> "RowFactors":
        """left = exp(G_i - G_r) on the sub-chunk's rows [S, bk]; right = exp(G_r - G_j) on
        the chunk's rows j < r, else 0 [C, bk]."""
        G_r = self._row(self.sc.first)
        right = jnp.exp(jnp.where(iota(self.G.shape, 0) < self.sc.first, G_r - self.G,
                                  -jnp.inf))
        return RowFactors(jnp.exp(self.G_own - G_r), right)

    def column_factors(self) -> "ColumnFactors":
        """left = exp(G_i - G_e) on the chunk's rows i > e, else 0 [C, bk]; right =
        exp(G_e - G_j) on the sub-chunk's rows [S, bk]."""
        G_e = self._row(self.sc.last)
        left = jnp.exp(jnp.where(iota(self.G.shape, 0) > self.sc.last, self.G - G_e, -jnp.inf))
        return ColumnFactors(left, jnp.exp(G_e - self.G_own))


class RowFactors(NamedTuple):
    left: jax.Array       # [S, bk]
    right: jax.Array      # [C, bk]


class ColumnFactors(NamedTuple):
    left: jax.Array       # [C, bk]
    right: jax.Array      # [S, bk]


class Step(NamedTuple):
    """One distance delta of ``within_sub_chunk`` for the sub-chunk's local rows l: partner
    [S] (l - delta downward, l + delta upward, clipped into the sub-chunk), same [S] (the
    partner lies in the sub-chunk), column [S] (the partner's chunk row), decay [S, bk] =
    exp(sum of g over the rows strictly after min(l, p) up to max(l, p)) where same, else 0."""
    delta: jax.Array
    partner: jax.Array
    same: jax.Array
    column: jax.Array
    decay: jax.Array


def within_sub_chunk(sc: SubChunk, gates: ChannelGates, body: Callable, acc, *, upward: bool):
    """Folds body(step, acc) -> acc over delta = 1 .. S - 1, the pairs (l, p) of the
    sub-chunk at distance delta: p = l - delta (downward: l the later row) or p = l + delta
    (upward: l the earlier row)."""
    l = sc.local

    def step(delta, carry):
        partial, acc = carry
        if upward:
            partner, same, joining = l + delta, l + delta < SUB_CHUNK, l + delta
        else:
            partner, same, joining = l - delta, l >= delta, l - delta + 1
        partial = partial + sc.gather(gates.g_ref, joining, gates.cols)
        decay = jnp.exp(jnp.where(same[:, None], partial, -jnp.inf))
        column = sc.first + jnp.clip(partner, 0, SUB_CHUNK - 1)
        return partial, body(Step(delta, partner, same, column, decay), acc)

    zero = jnp.zeros(gates.G_own.shape, jnp.float32)
    return lax.fori_loop(1, SUB_CHUNK, step, (zero, acc))[1]


def place(step: Step, value, C: int):
    """An [S, C] tile with value [S] at (l, step.column) where step.same, else 0."""
    hit = (iota((SUB_CHUNK, C), 1) == step.column[:, None]) & step.same[:, None]
    return jnp.where(hit, value[:, None], 0.0)


def band(m, step: Step):
    """The entries m[l, step.column] of an [S, C] tile m, by local row, [S] (0 where the
    partner is outside the sub-chunk)."""
    hit = (iota(m.shape, 1) == step.column[:, None]) & step.same[:, None]
    return jnp.sum(jnp.where(hit, m, 0.0), axis=1)
