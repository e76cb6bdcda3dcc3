"""One sequence over the whole device: a piece of the sequence run as S segments in parallel.

The state recurrences run one program per (batch row, value head, block of state columns),
each looping over all its chunks; with few rows (16 heads, one long sequence) most of the
GPU idles. Cut each piece of P tokens (the sequence, or a device's piece under CP) into S
segments of P / S tokens and lay them out as batch rows,

    [B, P, ...] -> [B S, P / S, ...]   (row b S + s: segment s of row b; a free reshape),

and every stage runs S times the programs over 1 / S of the chunks. The segments are joined
as CP joins devices (``cp.exchange``, ``cp.merge``): each row's affine map (S_ext, M), a
prefix merge in sequence order, then the recurrences again from each row's entry state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcp.gate import Gate
from jaxcp.layout import ChunkLayout, TokenMap, build_layout, from_chunks, to_chunks

# The fewest tokens a segment keeps (measured down to 8192: GDN, H200)
MIN_SEGMENT_TOKENS = 8192
# The fewest segments worth a split: the summary pass and the second recurrence cost about
# what two segments save (GDN, 16 heads, H200: forward 4 % slower at S = 2, 18 % faster at 4)
MIN_SEGMENTS = 4


def choose_segments(segments: int | None, *, backend: str, gate: Gate, across_devices: bool,
                    batch: int, heads: int, k_dim: int, v_dim: int, piece_len: int) -> int:
    """S for a piece of piece_len tokens of `batch` rows of `heads` value heads. segments:
    the caller's (1: no split), or None: on the GPU backends, the largest power of two S at
    which B HV S times the blocks of state columns (GDN's blocks) fill the GPU at most once,
    if it is at least MIN_SEGMENTS, divides piece_len and leaves segments of
    MIN_SEGMENT_TOKENS; 1 otherwise, and at head widths other than K = V = 128 (the ones
    measured). KDA splits only across devices (across_devices: the allgather strategy,
    whose summary pass runs anyway): on one device its transition M costs more than the
    parallel recurrences save (docs/benchmarks/segments.md)."""
    if segments is not None:
        return segments
    if (backend not in ("pallas", "mosaic") or (k_dim, v_dim) != (128, 128)
            or (gate is Gate.CHANNEL and not across_devices)):
        return 1
    from jaxcp.pallas.triton.common.launch import FULL_GRID, StateBlocks
    programs = batch * heads * (v_dim // StateBlocks.default(k_dim).cols(v_dim))
    s = 1
    while (programs * 2 * s <= FULL_GRID and piece_len % (2 * s) == 0
           and piece_len // (2 * s) >= MIN_SEGMENT_TOKENS):
        s *= 2
    return s if s >= MIN_SEGMENTS else 1


def to_rows(x: jax.Array, segments: int) -> jax.Array:
    """[B, P, ...] -> [B S, P / S, ...]."""
    B, P = x.shape[:2]
    return x.reshape(B * segments, P // segments, *x.shape[2:])


def from_rows(x: jax.Array, segments: int) -> jax.Array:
    """[B S, P / S, ...] -> [B, P, ...] (inverse of to_rows)."""
    rows, L = x.shape[:2]
    return x.reshape(rows // segments, L * segments, *x.shape[2:])


def split_rows(x: jax.Array, segments: int) -> jax.Array:
    """A per-row array [B S, ...] -> [S, B, ...], segments in sequence order."""
    return jnp.swapaxes(x.reshape(-1, segments, *x.shape[1:]), 0, 1)


def join_rows(x: jax.Array) -> jax.Array:
    """[S, B, ...] -> [B S, ...] (inverse of split_rows)."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def _interleave(per_segment: list, axis: int) -> jax.Array:
    """S arrays [..., B, ...] (B at `axis`) -> [..., B S, ...], row b S + s from segment s."""
    stacked = jnp.stack(per_segment, axis=axis + 1)
    return stacked.reshape(*stacked.shape[:axis], -1, *stacked.shape[axis + 2:])


def segment_layouts(batch: int, piece_len: int, segments: int, chunk_size: int,
                    cu_seqlens: jax.Array | None, piece_start, total: int
                    ) -> tuple[ChunkLayout, tuple[TokenMap, ...] | None]:
    """The chunk layout of a piece's tokens [piece_start, piece_start + piece_len) of a stream
    of `total` run as ``to_rows`` gives them: [NT, B S] (``layout.build_layout`` per
    segment, rows interleaved), and each segment's TokenMap (varlen) or None."""
    L = piece_len // segments
    built = [build_layout(batch, L, chunk_size, cu_seqlens, piece_start + s * L, total)
             for s in range(segments)]
    parts = [lay for lay, _ in built]
    per_chunk = lambda name: (None if getattr(parts[0], name) is None
                              else _interleave([getattr(p, name) for p in parts], axis=1))
    rows = batch * segments
    # a sequence's last chunk as a flat index (chunk * rows + row), from the segment it ends in
    flat = lambda p, s: ((p.seq_last_chunk // batch) * rows
                         + (p.seq_last_chunk % batch) * segments + s)
    seq_last_chunk = flat(parts[-1], segments - 1)
    for s, p in enumerate(parts[:-1]):
        seq_last_chunk = jnp.where(p.seq_ends_here, flat(p, s), seq_last_chunk)
    layout = ChunkLayout(
        chunk_seq=per_chunk("chunk_seq"), chunk_starts=per_chunk("chunk_starts"),
        chunk_ends=per_chunk("chunk_ends"), seq_last_chunk=seq_last_chunk.astype(jnp.int32),
        seq_ends_here=jnp.any(jnp.stack([p.seq_ends_here for p in parts]), axis=0),
        token_start=per_chunk("token_start"), token_count=per_chunk("token_count"))
    maps = None if built[0][1] is None else tuple(tm for _, tm in built)
    return layout, maps


def rows_to_chunks(x: jax.Array, token_maps: tuple[TokenMap, ...] | None, n_chunks: int,
                   chunk_size: int) -> jax.Array:
    """The chunk layout of rows [B S, P / S, HV, ...] -> [NT, B S, HV, C, ...] (varlen, B = 1:
    each row, a segment, through its own TokenMap)."""
    if token_maps is None:
        return to_chunks(x, None, n_chunks, chunk_size)
    return jnp.concatenate([to_chunks(x[s:s + 1], tm, n_chunks, chunk_size)
                            for s, tm in enumerate(token_maps)], axis=1)


def rows_from_chunks(y: jax.Array, token_maps: tuple[TokenMap, ...] | None,
                     segment_len: int) -> jax.Array:
    """[NT, B S, HV, C, ...] -> rows [B S, P / S, HV, ...] (inverse of rows_to_chunks)."""
    if token_maps is None:
        return from_chunks(y, None, segment_len)
    return jnp.concatenate([from_chunks(y[:, s:s + 1], tm, segment_len)
                            for s, tm in enumerate(token_maps)])
