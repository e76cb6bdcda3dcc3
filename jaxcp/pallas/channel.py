"""Gated sums over one chunk with a per-channel gate (KDA), shared by the intra-chunk kernel
and the cotangent kernels: every decay exp(G_id - G_jd) (j before i, G the chunk cumsum of
g <= 0) is built from factors <= 1, so the sums are finite for any gate.

The chunk's C rows are cut into sub-chunks of S = 16 rows. A pair (i, j), j <= i, is

- across sub-chunks (j before the sub-chunk b of i, whose first row is r):
  exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both factors <= 1, so the sums over j
  are tensor-core products of tiles scaled by ``SubChunk.left`` and ``SubChunk.right``;
- within a sub-chunk: token by token in the distance delta = |i - j| (1 .. S - 1), the
  decay exp(sum of g over the rows j+1 .. i) a partial sum grown by one row of g per step
  (``within_sub_chunks``), exact to rounding even for gates of -1e3, where a difference of
  two cumsums of size ~1e4 would keep few digits.

For a [C, C] matrix M (lower triangular) and [C, bk] blocks of channels x, y, the sums the
backward needs are

    rows:    R_id = sum_{j < i} M_ij y_jd exp(G_id - G_jd)      (``gated_sum``)
    columns: Q_jd = sum_{i > j} M_ij x_id exp(G_id - G_jd)      (``gated_sum(columns=True)``)

(the diagonal j = i, where the decay is 1, is the caller's). The forward's
A_ij = sum_d x_id y_jd exp(G_id - G_jd) is built from the same pieces in
``pallas.intra_channel``.
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


def row_of(x, i: int):
    """Row i of a [C, d] tile as [1, d] (a masked sum: registers cannot be indexed)."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


class ChannelBlock:
    """Block i of bk key columns of a chunk (one program's [C, K] tiles): its column slice,
    loaders of the block of a [C, K] ref (all rows, or the rows idx), and the gate terms
    G = cumsum(g) and, when read, exp(G), exp(G_C - G) and exp(G_C) [1, bk]. G_C is the
    cumsum's own last row, so that G_C - G is rounded as G is."""

    def __init__(self, g_ref, i: int, bk: int):
        self.cols = pl.ds(i * bk, bk)
        self.g_ref = g_ref
        self.G = jnp.cumsum(f32(g_ref[:, self.cols]), axis=0)

    @cached_property
    def _G_last(self):
        return row_of(self.G, self.G.shape[0] - 1)

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

    def rows(self, ref):
        """idx [C] -> rows idx of this block of ref, float32."""
        return lambda idx: f32(ref[idx, self.cols])

    def g_rows(self, idx):
        return self.g_ref[idx, self.cols]


class SubChunk(NamedTuple):
    """The factors of sub-chunk b >= 1 (first row r = b S) for a [C, bk] block of G:
    left = exp(G_i - G_r) on the rows of b, else 0; right = exp(G_r - G_j) on the rows
    j < r, else 0. Both <= 1."""
    left: jax.Array
    right: jax.Array


def sub_chunks(G) -> list[SubChunk]:
    """The factors of sub-chunks 1 .. C/S - 1 (sub-chunk 0 has no rows before it)."""
    C = G.shape[0]
    rows = iota(G.shape, 0)
    out = []
    for r in range(SUB_CHUNK, C, SUB_CHUNK):
        G_r = row_of(G, r)
        in_b = (rows >= r) & (rows < r + SUB_CHUNK)
        out.append(SubChunk(jnp.exp(jnp.where(in_b, G - G_r, -jnp.inf)),
                            jnp.exp(jnp.where(rows < r, G_r - G, -jnp.inf))))
    return out


class Step(NamedTuple):
    """One distance delta of ``within_sub_chunks``: partner [C] (row i's partner p, i - delta
    or i + delta, clipped into the chunk), same [C] (p lies in i's sub-chunk), decay
    [C, bk] = exp(sum of g over the rows strictly after min(i, p) up to max(i, p)) where
    same, else 0."""
    delta: jax.Array
    partner: jax.Array
    same: jax.Array
    decay: jax.Array


def within_sub_chunks(g_rows: Callable, C: int, bk: int, body: Callable, acc, *,
                      upward: bool):
    """Folds body(step, acc) -> acc over delta = 1 .. S - 1, the pairs (i, p) in one
    sub-chunk at distance delta: p = i - delta (downward) or p = i + delta (upward).
    g_rows(idx [C]) loads the rows idx of the block of g, [C, bk]."""
    rows = iota((C,), 0)
    pos = rows % SUB_CHUNK

    def step(delta, carry):
        partial, acc = carry
        if upward:
            partner, same, joining = rows + delta, pos + delta < SUB_CHUNK, rows + delta
        else:
            partner, same, joining = rows - delta, pos >= delta, rows - delta + 1
        clip = lambda idx: jnp.clip(idx, 0, C - 1)
        partial = partial + g_rows(clip(joining)).astype(jnp.float32)
        decay = jnp.exp(jnp.where(same[:, None], partial, -jnp.inf))
        return partial, body(Step(delta, clip(partner), same, decay), acc)

    zero = jnp.zeros((C, bk), jnp.float32)
    return lax.fori_loop(1, SUB_CHUNK, step, (zero, acc))[1]


def band(m, delta, *, upward: bool):
    """The entries M_{i, i - delta} (upward: M_{i + delta, i}) of a [C, C] m, by row i, [C]."""
    at = iota(m.shape, 0) - iota(m.shape, 1)          # i - j
    hit = jnp.where(at == delta, m, 0.0)
    return jnp.sum(hit, axis=0) if upward else jnp.sum(hit, axis=1)


def gated_sum(m, G, z, z_rows: Callable, product, *, columns: bool, g_rows: Callable):
    """The gated sums of the module docstring for a [C, bk] block of channels, z [C, bk]
    float32 and z_rows(idx) its rows idx; product: the matrix product (fp32 operands).

        columns False:  R_id = sum_{j < i} m_ij z_jd exp(G_id - G_jd)
        columns True:   Q_jd = sum_{i > j} m_ij z_id exp(G_id - G_jd)

    Across sub-chunks, the sub-chunk factor on the summed side scales z before the product
    and the other scales the result; within a sub-chunk the loop runs downward (rows) or
    upward (columns)."""
    C, bk = G.shape
    acc = jnp.zeros((C, bk), jnp.float32)
    for sc in sub_chunks(G):
        if columns:
            acc = acc + sc.right * product(m.T, z * sc.left)
        else:
            acc = acc + sc.left * product(m, z * sc.right)

    def body(s: Step, acc):
        return acc + band(m, s.delta, upward=columns)[:, None] * z_rows(s.partner) * s.decay

    return within_sub_chunks(g_rows, C, bk, body, acc, upward=columns)
