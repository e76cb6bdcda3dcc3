"""The reader of a chunk's rows: token-major tensors read and written in place, or chunks.

A token tensor x [B, T, HV, d] (or [B, T, HV] for g, beta and their cotangents) is handed
to a kernel as the [T, d] (or [T]) slab of one (batch, head); chunk c of that slab is its
rows [start_c, start_c + C), of which the first count_c are the chunk's tokens
(``ChunkLayout.token_start``, ``token_count``). Reads give zeros in the rows past count_c,
the padding tokens (q = k = v = g = beta = 0) that leave the state unchanged; writes touch
only the first count_c rows. So packed sequences, whose chunks start at any token and end
early, need no gathered copy, and neither does T % C != 0.

Where the layout has no such table (every chunk whole, at c C), the rows are c C on and
nothing is masked: those loads are the plain block loads of a chunk-layout kernel.

A kernel whose every sum over the chunk's rows already has a factor that is zero past
count_c (beta, or row factors it zeroes there: ``ChunkRows.valid``) may read its [C, d]
tiles "loose": unmasked, the rows past count_c holding the tokens that follow (rows past
T repeat row T - 1). Those rows then add exact zeros, so the results are those of masked
loads, as long as the products stay finite: an inf in the next sequence, or values so
large that its products overflow float32, would reach this one as 0 * inf (that sequence's
own results are not finite then either). GDN's intra kernel does: its [C, d] load masks
cost it registers it spilled (docs/benchmarks/kernels.md).

One reader serves every kernel. ``ChunkRows`` says where a chunk's rows are in a slab
(``program_rows`` for the chunk of a per-chunk program, ``loop_rows`` for step i of a loop
over the chunks); ``ChunkRef`` reads and writes a chunk's [C, d] tile with the indexing of
the chunk-layout block it stands for, from the token slab at those rows or, given no rows,
from a chunk-layout block itself.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def slab_spec(T: int, d: int | None, index_map) -> pl.BlockSpec:
    """BlockSpec of the whole [T, d] (d None: [T]) slab of one (batch, head) of a
    [B, T, HV, d] token tensor; index_map returns (batch, head, column block)."""
    if d is None:
        return pl.BlockSpec((None, T, None), lambda *ids: _slab_index(index_map(*ids))[:3])
    return pl.BlockSpec((None, T, None, d), lambda *ids: _slab_index(index_map(*ids)))


def _slab_index(bhj):
    b, h, j = bhj
    return b, 0, h, j


def has_table(layout) -> bool:
    """Whether the layout places chunks by table (packed sequences, or T % C != 0)."""
    return layout.token_start is not None


class ChunkRows(NamedTuple):
    """The rows of one chunk in a token slab: first row `start`, `count` real rows of C
    (None: all C, no mask); reverse: tiles list the rows last first (``reversed``)."""
    start: jax.Array
    count: jax.Array | None
    size: int
    reverse: bool = False

    def sub(self, first, size: int) -> "ChunkRows":
        """Its rows first .. first + size - 1 (first may be traced) as rows of their own."""
        if self.reverse:
            raise ValueError("ChunkRows.sub: the rows of a reversed view are not sliced")
        count = None if self.count is None else self.count - first
        return ChunkRows(self.start + first, count, size)

    def reversed(self) -> "ChunkRows":
        """The same rows, read and written last first: row i of a tile is the chunk's row
        C - 1 - i (a reverse scan is then ``jnp.cumsum``, which Pallas lowers forward only)."""
        return self._replace(reverse=not self.reverse)

    def _positions(self, shape):
        """The chunk row each tile row stands for, broadcast to shape."""
        i = lax.broadcasted_iota(jnp.int32, shape, 0)
        return self.size - 1 - i if self.reverse else i

    def _at(self, ref, cols):
        if len(ref.shape) == 1:
            shape = (self.size,)
            if self.reverse:
                return ref.at[self.start + self._positions(shape)], shape
            return ref.at[pl.ds(self.start, self.size)], shape
        first, n = cols if cols is not None else (0, ref.shape[1])
        shape = (self.size, n)
        if self.reverse:
            # whole-tile index arrays, row and column (a masked access by a row array and
            # a column slice has no interpret-mode rule)
            columns = first + lax.broadcasted_iota(jnp.int32, shape, 1)
            return ref.at[self.start + self._positions(shape), columns], shape
        return ref.at[pl.ds(self.start, self.size), pl.ds(first, n)], shape

    def _mask(self, shape):
        return self._positions(shape) < self.count

    def valid(self) -> jax.Array | None:
        """[C] float32: 1 on the chunk's tokens, 0 past count (None: all C are tokens), in
        the view's row order."""
        if self.count is None:
            return None
        return self._mask((self.size,)).astype(jnp.float32)

    def load(self, ref, cols: tuple[int, int] | None = None, *, loose: bool = False) -> jax.Array:
        """The chunk's [C, n] tile of columns cols = (first, n) (all columns if None), or
        its [C] vector of a [T] slab; zero in the rows past count, or (loose, tiles only)
        the following tokens there."""
        if loose and self.reverse:
            raise ValueError("ChunkRows.load: a reversed view reads masked, not loose")
        if loose and self.count is not None and len(ref.shape) == 2:
            first, n = cols if cols is not None else (0, ref.shape[1])
            rows = self.start + lax.broadcasted_iota(jnp.int32, (self.size,), 0)
            return ref[jnp.minimum(rows, ref.shape[0] - 1), pl.ds(first, n)]
        at, shape = self._at(ref, cols)
        if self.count is None:
            return at[...]
        return pltriton.load(at, mask=self._mask(shape), other=0)

    def store(self, ref, value: jax.Array, cols: tuple[int, int] | None = None) -> None:
        """Write the first count rows of value [C, n] (or [C]) to the chunk's rows."""
        at, shape = self._at(ref, cols)
        if self.count is None:
            at[...] = value.astype(ref.dtype)
        else:
            pltriton.store(at, value.astype(ref.dtype), mask=self._mask(shape))


class ChunkRef:
    """A chunk's [C, d] tile (or [C] vector), read and written with the indexing of a
    chunk-layout block: x[rows, cols] with rows all (:) or a ``pl.ds`` inside the chunk and
    cols a slice or a ``pl.ds`` (or absent), or by blocks of n columns (``cols``,
    ``set_cols``). Behind it, a block ref of the chunk layout (rows None), or a token slab
    [T, d] (or [T]) and the chunk's ``ChunkRows`` in it: loads give zeros in the rows past
    the chunk's tokens (loose: the tokens that follow, ``ChunkRows.load``) and stores skip
    them, so a kernel written for the chunk layout runs on the tokens in place."""

    def __init__(self, ref, rows: ChunkRows | None = None, *, loose: bool = False):
        self.ref, self.rows, self.loose = ref, rows, loose
        self.shape = tuple(ref.shape) if rows is None else (rows.size,) + tuple(ref.shape[1:])
        self.dtype = ref.dtype

    @property
    def width(self) -> int:
        return self.shape[-1]

    def _rows_cols(self, index) -> tuple[ChunkRows, tuple | None]:
        """The indexed rows as ``ChunkRows`` and the columns as (first, n), or None for
        all (or for a [T] slab)."""
        if index is Ellipsis:
            index = ()
        index = index if isinstance(index, tuple) else (index,)
        row = index[0] if index else slice(None)
        if isinstance(row, slice):
            if row != slice(None):
                raise ValueError("ChunkRef: rows must be all (:) or a pl.ds")
            rows = self.rows
        else:
            rows = self.rows.sub(row.start, row.size)
        col = index[1] if len(index) > 1 else slice(None)
        return rows, None if isinstance(col, slice) else (col.start, col.size)

    def __getitem__(self, index):
        if self.rows is None:
            return self.ref[index]
        rows, cols = self._rows_cols(index)
        return rows.load(self.ref, cols, loose=self.loose)

    def __setitem__(self, index, value):
        if self.rows is None:
            self.ref[index] = value.astype(self.ref.dtype)
        else:
            rows, cols = self._rows_cols(index)
            rows.store(self.ref, value, cols)

    def cols(self, j: int, n: int) -> jax.Array:
        """Columns [j n, (j + 1) n) as stored."""
        return self[:, pl.ds(j * n, n)]

    def set_cols(self, j: int, n: int, value: jax.Array) -> None:
        self[:, pl.ds(j * n, n)] = value

    def all(self) -> jax.Array:
        """The whole tile (or vector) as stored."""
        return self[...]

    def set_all(self, value: jax.Array) -> None:
        self[...] = value


def chunk_refs(refs, rows: ChunkRows, names: tuple[str, ...]):
    """The kernel refs (a NamedTuple) with each token slab among `names` that the kernel
    takes and the call has read and written as the chunk's rows (``ChunkRef``)."""
    return refs._replace(**{name: ChunkRef(getattr(refs, name), rows) for name in names
                            if getattr(refs, name, None) is not None})


def chunk_grid(NT: int, B: int, HV: int, heads_first: bool) -> tuple[int, int, int]:
    """The grid of one program per (chunk, batch, head) in launch order (Triton's first
    launch axis varies fastest): (NT, B, HV), or (HV, B, NT) with heads_first, where the
    programs of one chunk's heads launch side by side and read whole rows of the token
    tensors [B, T, HV, d] together."""
    return (HV, B, NT) if heads_first else (NT, B, HV)


def chunk_grid_axis(heads_first: bool) -> int:
    """The axis of the chunk in ``chunk_grid``."""
    return 2 if heads_first else 0


def chunk_ids(index_map, heads_first: bool):
    """index_map(t, b, h, *rest) as a function of the program ids of a grid that is
    ``chunk_grid`` followed by the rest's axes."""
    if heads_first:
        return lambda h, b, t, *rest: index_map(t, b, h, *rest)
    return index_map


def program_rows(refs, C: int, chunk_axis: int = 0) -> ChunkRows:
    """The rows of this program's chunk (grid axis chunk_axis) in the token slabs: from the
    refs' token_start, token_count [1, 1] when the layout has a table, else c C on."""
    if refs.token_start is None:
        return ChunkRows(pl.program_id(chunk_axis) * C, None, C)
    return ChunkRows(refs.token_start[0, 0], refs.token_count[0, 0], C)


def loop_rows(refs, C: int, i) -> ChunkRows:
    """The rows of chunk i in the token slabs, for a program that loops over the chunks:
    from the refs' token_start, token_count [NT] when the layout has a table, else i C on."""
    if refs.token_start is None:
        return ChunkRows(i * C, None, C)
    return ChunkRows(refs.token_start[i], refs.token_count[i], C)


class ChunkSpecs(NamedTuple):
    """A grid of one program per (chunk, batch, head), `grid(NT, B, HV)` in launch order
    (``chunk_grid``), and its BlockSpecs: `block(*s)` for a per-chunk array [NT, B, HV, *s],
    `tile(d)` and `vec` for chunk terms [NT, B, HV, C, d] and [NT, B, HV, C]; `token(d)` for
    the slab of a token tensor [B, T, HV, d] (d None: [B, T, HV]); `chunk_rows` for the
    layout's token_start and token_count [NT, B]; `scalar` for [NT, B, HV]."""
    grid: Callable
    block: Callable
    tile: Callable
    vec: pl.BlockSpec
    token: Callable
    chunk_rows: pl.BlockSpec
    scalar: pl.BlockSpec


def chunk_specs(C: int, T: int, heads_first: bool = False) -> ChunkSpecs:
    at = lambda index_map: chunk_ids(index_map, heads_first)

    def block(*shape):
        zeros = (0,) * len(shape)
        return pl.BlockSpec((None, None, None) + shape, at(lambda t, b, h: (t, b, h) + zeros))

    return ChunkSpecs(
        grid=lambda NT, B, HV: chunk_grid(NT, B, HV, heads_first),
        block=block,
        tile=lambda d: block(C, d),
        vec=block(C),
        token=lambda d: slab_spec(T, d, at(lambda t, b, h: (b, h, 0))),
        chunk_rows=pl.BlockSpec((1, 1), at(lambda t, b, h: (t, b))),
        scalar=block(),
    )


def add_chunk_rows(ins, sp: ChunkSpecs, layout) -> None:
    """The layout's token_start, token_count as inputs, when it places chunks by table."""
    if layout.token_start is not None:
        ins.add("token_start", sp.chunk_rows, layout.token_start)
        ins.add("token_count", sp.chunk_rows, layout.token_count)
