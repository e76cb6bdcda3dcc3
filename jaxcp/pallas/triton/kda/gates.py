"""KDA's per-channel gate factors in the kernels: the gate terms of whole-chunk programs
(``ChunkGates``), and those of the gated sums, the forward's A and attn and the
backward's row and column sums of Mq and dA. Every decay exp(G_id - G_jd) (j before i, G
the chunk cumsum of g <= 0) is built from factors that cannot overflow, so the sums are
finite for any gate.

The chunk's C rows are cut into sub-chunks of S = 16 rows. A pair (i, j), j < i:

- i in sub-chunk b, j in a sub-chunk s before b, r the first row of b:
  exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both factors <= 1, so the [S, S] block
  (b, s) is a tensor-core product of [S, bk] tiles times those factors. One program per
  chunk takes every such block (``kda_gated_sums``, ``kda_grads_gated_sums``); the
  backward uses the block's two factor tiles for both the row sums of b and the column
  sums of s.
- i and j in one sub-chunk b that ``diagonal_fits`` (G falls by at most 75 over b on
  every channel; always under a gate bound of -5 or more, FLA's ``safe_gate``): a
  product too, through the middle of G's span over b (``diagonal_factors``, factors
  within e^+-37.5): in the forward four more blocks of the per-chunk program, in the
  backward products of the diagonal blocks of Mq and dA.
- i and j in a sub-chunk b that does not fit: pair by pair, one row p of b at a time
  (``SubChunkGates.partners``), the decay exp(-|G_i - G_j|) = exp(G_later - G_earlier) of
  the pair as the jnp stage takes it, one program per sub-chunk
  (``kda_diagonal_sums``, ``kda_grads_diagonal_sums``). The S steps do not depend on
  each other; each loads one row of G and of the operands.

The factors are differences of the chunk cumsum G (``gate_cumsum.chunk_gate``, read from
memory: a program needs G at rows it cannot slice out of a register tile), so the row sums and
the column sums of a pair take the same rounded exponents. Had either taken them from
partial sums of g instead, they would differ by the cumsum's rounding, and the terms
q_i R_i - k_j Q_j of dg, which cancel in exact arithmetic, would leave it in every row
through dg's reverse cumsum.
"""
from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcp.pallas.triton.common.tiles import f32, iota
from jaxcp.pallas.triton.kda.sub_chunks import SUB_CHUNK, SubChunk


def row_at(x, i: int):
    """Row i of a [n, d] tile as [1, d] (a masked sum: registers cannot be indexed)."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


MIN_GATE_BOUND = -5.0


def check_gate_bound(gate_bound: float | None) -> None:
    """gate_bound: None or in [MIN_GATE_BOUND, 0) (``diagonal_fits``)."""
    if gate_bound is not None and not MIN_GATE_BOUND <= gate_bound < 0:
        raise ValueError(f"gate_bound must be None or in [{MIN_GATE_BOUND}, 0), got "
                         f"{gate_bound!r}")


MAX_DIAGONAL_SPAN = 75.0


def diagonal_factors(G_own, G_first, G_last):
    """exp(G_l - M) and exp(M - G_l) [S, bk] on a sub-chunk's rows l (G_own [S, bk]), with
    M = (G_r + G_e) / 2 the middle of G's span over its rows (G_first = G_r and G_last = G_e
    [1, bk] on its first and last rows): E_lp is the first at l times the second at p. On
    a sub-chunk that ``diagonal_fits``, both lie within e^+-37.5, and the products of the
    pairs with p after l (not decays, up to e^75) stay finite too."""
    middle = 0.5 * (G_first + G_last)
    return jnp.exp(G_own - middle), jnp.exp(middle - G_own)


def diagonal_fits(G_ref, first):
    """Whether G (a [C, K] ref) falls by at most MAX_DIAGONAL_SPAN on every channel over
    the sub-chunk whose first row is `first` (a scalar bool): then its diagonal block is
    taken as products (``diagonal_factors``), else pair by pair. Gates of at least -5 (a
    gate bound) always fit: 15 steps of -5."""
    span = (f32(G_ref[pl.ds(first, 1), :])
            - f32(G_ref[pl.ds(first + SUB_CHUNK - 1, 1), :]))
    return jnp.max(span) <= MAX_DIAGONAL_SPAN


class ChunkGates:
    """The bk key columns from start of a whole-chunk program's [C, K] tiles: their slice,
    a loader of the block of a [C, K] ref, and the gate terms: G, the chunk cumsum
    (``gate_cumsum.chunk_gate``), and, when read, exp(G), exp(G_C - G) and exp(G_C)
    [1, bk]. G_C is G's own last row, so that G_C - G is rounded as G is."""

    def __init__(self, G_ref, start, bk: int):
        self.cols = pl.ds(start, bk)
        self.G = f32(G_ref[:, self.cols])

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


class SubChunkGates:
    """Gate terms of one block of channels (cols) for a sub-chunk program, from the chunk
    cumsum G (``gate_cumsum.chunk_gate``, read from memory; the module docstring says why):
    G on the sub-chunk's rows [S, bk] and on its first and last rows [1, bk]. Every factor is <= 1
    but those of ``diagonal_factors``."""

    def __init__(self, G_ref, cols, sc: SubChunk):
        self.sc, self.G_ref, self.cols = sc, G_ref, cols
        self.G_own = sc.rows(G_ref, cols)
        self.G_first = f32(G_ref[pl.ds(sc.first, 1), cols])
        self.G_last = f32(G_ref[pl.ds(sc.first + SUB_CHUNK - 1, 1), cols])

    def diagonal_factors(self):
        """``diagonal_factors`` of this sub-chunk (where it ``diagonal_fits``)."""
        return diagonal_factors(self.G_own, self.G_first, self.G_last)

    def partner(self, p: int):
        """Row p of the sub-chunk as the partner of its rows l (``Partner``)."""
        sc = self.sc
        G_p = f32(self.G_ref[pl.ds(sc.first + p, 1), self.cols])
        return Partner(index=p, row=sc.first + p, later=sc.local > p, earlier=sc.local < p,
                       decay=jnp.exp(-jnp.abs(self.G_own - G_p)))

    def partners(self):
        """The S rows p of the sub-chunk as partners of its rows l, in order, unrolled (the
        steps are independent, and their loads can be issued together; the backward's
        kernel, which holds more per step, loops over ``partner`` instead)."""
        return (self.partner(p) for p in range(SUB_CHUNK))


class Partner(NamedTuple):
    """Row p of the sub-chunk (local index; chunk row first + p) as the partner of the
    sub-chunk's rows l: later [S] (l > p), earlier [S] (l < p), and decay [S, bk] =
    exp(-|G_l - G_p|), which is E_lp = exp(G_l - G_p) where l >= p and E_pl where l <= p
    (G does not increase down the chunk), <= 1 either way."""
    index: int
    row: jax.Array
    later: jax.Array
    earlier: jax.Array
    decay: jax.Array

    def column(self, value, mask):
        """An [S, S] tile with value [S] in column p where mask [S], else 0."""
        hit = (iota((SUB_CHUNK, SUB_CHUNK), 1) == self.index) & mask[:, None]
        return jnp.where(hit, value[:, None], 0.0)
