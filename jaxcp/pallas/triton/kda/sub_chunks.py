"""KDA's sub-chunks: the chunk's C rows cut into sub-chunks of S = 16 rows, the grid of
the kernels with one program per (chunk, batch, head, sub-chunk) and the loaders of a
sub-chunk's rows (``SubChunk``). The gate factors over sub-chunks are in ``gates``."""
from __future__ import annotations

from typing import Callable, NamedTuple

from jax.experimental import pallas as pl

from jaxcp.pallas.triton.common.chunk_rows import chunk_grid, chunk_ids, slab_spec
from jaxcp.pallas.triton.common.launch import ChunkBlocks
from jaxcp.pallas.triton.common.tiles import f32, iota

SUB_CHUNK = 16


def check_chunk(C: int) -> None:
    if C % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK} for the Pallas KDA "
                         f"kernels, got {C}")


class SubChunkSpecs(NamedTuple):
    """The grid of one program per (chunk, batch, head, sub-chunk), in the order
    ``sub_chunk_axis`` gives, and its BlockSpecs: `chunk(d)` the whole chunk [C, d] of a
    chunk-layout [NT, B, HV, C, d], `square_flat` a [C, C] matrix per chunk as
    [NT, B, HV, C * C], `rows(d)` the program's sub-chunk, S rows of a chunk-layout array;
    `token(d)` the [T, d] slab of a token tensor [B, T, HV, d] (d None: [B, T, HV]) and
    `chunk_rows` the layout's token_start, token_count [NT, B] (``chunk_rows.ChunkSpecs``)."""
    grid: tuple
    chunk: Callable
    square_flat: pl.BlockSpec
    rows: Callable
    token: Callable
    chunk_rows: pl.BlockSpec


def sub_chunk_axis(sub_chunks_first: bool) -> int:
    """The grid axis of the sub-chunk: 0 (sub_chunks_first) or 3 (after chunk, batch and
    head in ``chunk_rows.chunk_grid``'s order). Triton's first launch axis varies fastest,
    and Pallas folds the leading grid axes into it, the first of them fastest: with the
    sub-chunk first, the programs of one chunk launch next to each other and share the
    chunk's rows in L2; last, they launch NT * B * HV programs apart."""
    return 0 if sub_chunks_first else 3


def chunk_axis(blocks: ChunkBlocks) -> int:
    """The grid axis of the chunk in a sub-chunk kernel's grid (``sub_chunk_specs``)."""
    return (1 if blocks.sub_chunks_first else 0) + blocks.chunk_axis


def sub_chunk_specs(NT: int, B: int, HV: int, C: int, T: int,
                    blocks: ChunkBlocks) -> SubChunkSpecs:
    """The grid and BlockSpecs of a sub-chunk kernel launched with blocks
    (``ChunkBlocks.sub_chunks_first``, ``heads_first``)."""
    S = SUB_CHUNK
    chunks = chunk_grid(NT, B, HV, blocks.heads_first)
    at_chunk = lambda index_map: chunk_ids(index_map, blocks.heads_first)
    grid = (C // S,) + chunks if blocks.sub_chunks_first else chunks + (C // S,)

    def at(index_map):
        """index_map(t, b, h, s) as a function of the program ids in grid order."""
        if blocks.sub_chunks_first:
            return lambda s, *ids: at_chunk(lambda t, b, h: index_map(t, b, h, s))(*ids)
        return at_chunk(index_map)

    return SubChunkSpecs(
        grid=grid,
        chunk=lambda d: pl.BlockSpec((None, None, None, C, d),
                                     at(lambda t, b, h, s: (t, b, h, 0, 0))),
        square_flat=pl.BlockSpec((None, None, None, C * C),
                                 at(lambda t, b, h, s: (t, b, h, 0))),
        rows=lambda d: pl.BlockSpec((None, None, None, S, d),
                                    at(lambda t, b, h, s: (t, b, h, s, 0))),
        token=lambda d: slab_spec(T, d, at(lambda t, b, h, s: (b, h, 0))),
        chunk_rows=pl.BlockSpec((1, 1), at(lambda t, b, h, s: (t, b))),
    )


class SubChunk:
    """This program's sub-chunk b (grid axis `axis`, ``sub_chunk_axis``): first row
    r = b S, local rows l = 0 .. S - 1 [S]; loaders of its rows of a block of columns, and
    of the entries of a flat [C, C] matrix in its rows, columns and diagonal."""

    def __init__(self, axis: int):
        self.index = pl.program_id(axis)
        self.first = self.index * SUB_CHUNK
        self.local = iota((SUB_CHUNK,), 0)
        self.own = pl.ds(self.first, SUB_CHUNK)

    @staticmethod
    def of(s: int, count: int = SUB_CHUNK):
        """The first `count` rows of sub-chunk s (static), as a slice."""
        return pl.ds(s * SUB_CHUNK, count)

    def rows(self, ref, cols):
        """Its S rows of the chunk tile ref, float32 [S, bk]."""
        return f32(ref[self.own, cols])

    def diagonal_of(self, m_flat, C: int):
        """m[i, i] on the sub-chunk's rows i of a [C, C] m given as m_flat [C * C], [S]."""
        return f32(m_flat[(self.first + self.local) * (C + 1)])

    def column_of(self, m_flat, p: int, C: int):
        """m[i, first + p] on the sub-chunk's rows i of a [C, C] m given as m_flat [C * C],
        [S]."""
        return f32(m_flat[(self.first + self.local) * C + self.first + p])

    def row_of(self, m_flat, p: int, C: int):
        """m[first + p, i] on the sub-chunk's rows i of a [C, C] m given as m_flat [C * C],
        [S]."""
        return f32(m_flat[(self.first + p) * C + self.first + self.local])
