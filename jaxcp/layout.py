"""Chunk layout of a device's tokens: packed sequences become whole chunks, inside jit.

Every chunk of C tokens holds tokens of one sequence only. A sequence's local part (its
tokens on this device) starts a new chunk and its last chunk is padded with zero tokens
(k = v = q = 0, beta = 0, g = 0), which leave the state unchanged. The transition of a chunk
that holds a sequence's first token is a reset: the state entering it is that sequence's
initial state, whatever came before. A device's first chunk continues the state of the
device before it unless a sequence starts exactly at the device's first token.

All of it is computed from ``cu_seqlens`` with jnp ops: no host round trip, and new values
with the same number of sequences N reuse the compiled program. The number of chunks is
static: a device with T_local tokens and at most m = min(N, T_local) local sequences needs
at most (T_local + m (C - 1)) // C chunks; unused tail chunks are all padding.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ChunkLayout(NamedTuple):
    """Per-chunk sequence bookkeeping, chunks on axis 0 and the batch on axis 1.

    chunk_seq [NT, B] int32: sequence index (into initial/final states) of each chunk.
    chunk_starts [NT, B] bool: the chunk holds its sequence's first token (a reset).
    chunk_ends [NT, B] bool: the chunk holds its sequence's last token.
    seq_last_chunk [N] int32: flat index (chunk * B + batch) of each sequence's last chunk here.
    seq_ends_here [N] bool: the sequence's last token is on this device.
    token_start [NT, B] int32: local index of the chunk's first token.
    token_count [NT, B] int32: the chunk's real tokens, 0 to C (the rest is padding).

    Token ``token_start + i`` is row i of the chunk for i < token_count: the token-major
    kernels read a chunk as rows of the [B, T_local, ...] tensors, in place. Both are None
    when chunk c is the whole tokens [c C, (c + 1) C) (no cu_seqlens, T_local a multiple of
    C): the kernels then know where chunks are without reading it.
    """
    chunk_seq: jax.Array
    chunk_starts: jax.Array
    chunk_ends: jax.Array
    seq_last_chunk: jax.Array
    seq_ends_here: jax.Array
    token_start: jax.Array | None
    token_count: jax.Array | None


class TokenMap(NamedTuple):
    """Where tokens go in the padded chunk stream (varlen only).

    slot_token [NT * C] int32: local token in each padded slot, -1 for padding.
    token_slot [T_local] int32: padded slot of each local token.
    """
    slot_token: jax.Array
    token_slot: jax.Array


def sequence_of(cu_seqlens: jax.Array, positions: jax.Array) -> jax.Array:
    """Index of the sequence holding each global token position (cu_seqlens: [N + 1] offsets)."""
    return jnp.searchsorted(cu_seqlens[1:], positions, side="right").astype(jnp.int32)


def num_chunks(t_local: int, chunk_size: int, num_seqs: int | None) -> int:
    """Static number of chunks for a device of t_local tokens (num_seqs None: no varlen)."""
    if num_seqs is None:
        return -(-t_local // chunk_size)
    return (t_local + min(num_seqs, t_local) * (chunk_size - 1)) // chunk_size


def build_layout(batch: int, t_local: int, chunk_size: int, cu_seqlens: jax.Array | None,
                 device_start: jax.Array | int, total: int) -> tuple[ChunkLayout, TokenMap | None]:
    """Layout of the tokens [device_start, device_start + t_local) of a stream of `total`
    tokens; cu_seqlens (global offsets, B == 1) or None (each batch row one sequence)."""
    C = chunk_size
    if cu_seqlens is None:
        NT = num_chunks(t_local, C, None)
        c = jnp.arange(NT)[:, None]
        last = (t_local - 1) // C
        starts_here = jnp.asarray(device_start == 0)
        ends_here = jnp.asarray(device_start + t_local == total)
        per_chunk = lambda x: jnp.broadcast_to(x, (NT, batch))
        layout = ChunkLayout(
            chunk_seq=per_chunk(jnp.arange(batch, dtype=jnp.int32)[None]),
            chunk_starts=per_chunk((c == 0) & starts_here),
            chunk_ends=per_chunk((c == last) & ends_here),
            seq_last_chunk=(last * batch + jnp.arange(batch)).astype(jnp.int32),
            seq_ends_here=jnp.broadcast_to(ends_here, (batch,)),
            token_start=None if t_local % C == 0 else per_chunk((c * C).astype(jnp.int32)),
            token_count=(None if t_local % C == 0
                         else per_chunk(jnp.clip(t_local - c * C, 0, C).astype(jnp.int32))),
        )
        return layout, None

    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    NT = num_chunks(t_local, C, N)
    local_start = jnp.clip(cu[:-1] - device_start, 0, t_local)
    local_end = jnp.clip(cu[1:] - device_start, 0, t_local)
    length = local_end - local_start
    chunks = (length + C - 1) // C
    chunk_end = jnp.cumsum(chunks)
    chunk_begin = chunk_end - chunks
    begins_here = (local_start + device_start == cu[:-1]) & (length > 0)
    ends_here = (local_end + device_start == cu[1:]) & (length > 0)

    c = jnp.arange(NT)
    seq = jnp.searchsorted(chunk_end, c, side="right")
    used = seq < N
    seq = jnp.minimum(seq, N - 1).astype(jnp.int32)
    first = (c - chunk_begin[seq]) * C          # the chunk's first token within its sequence
    layout = ChunkLayout(
        chunk_seq=seq[:, None],
        chunk_starts=(used & (c == chunk_begin[seq]) & begins_here[seq])[:, None],
        chunk_ends=(used & (c == chunk_end[seq] - 1) & ends_here[seq])[:, None],
        seq_last_chunk=jnp.maximum(chunk_end - 1, 0).astype(jnp.int32),
        seq_ends_here=ends_here,
        token_start=jnp.minimum(local_start[seq] + first, t_local)[:, None].astype(jnp.int32),
        token_count=jnp.where(used, jnp.clip(length[seq] - first, 0, C), 0)[:, None].astype(
            jnp.int32),
    )

    slot = jnp.arange(NT * C)
    slot_seq = seq[slot // C]
    offset = slot - chunk_begin[slot_seq] * C
    valid = (slot % C) < layout.token_count[slot // C, 0]
    t = jnp.arange(t_local)
    token_seq = sequence_of(cu, device_start + t)
    token_map = TokenMap(
        slot_token=jnp.where(valid, local_start[slot_seq] + offset, -1).astype(jnp.int32),
        token_slot=(chunk_begin[token_seq] * C + t - local_start[token_seq]).astype(jnp.int32),
    )
    return layout, token_map


def _slots_from_tokens(x: jax.Array, token_map: TokenMap) -> jax.Array:
    """[B, T_local, ...] -> [B, NT * C, ...]: each slot's token, zero in padding slots."""
    src = token_map.slot_token
    valid = (src >= 0).reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(valid, jnp.take(x, jnp.maximum(src, 0), axis=1), jnp.zeros((), x.dtype))


def _tokens_from_slots(y: jax.Array, token_map: TokenMap) -> jax.Array:
    """[B, NT * C, ...] -> [B, T_local, ...]: each token's slot."""
    return jnp.take(y, token_map.token_slot, axis=1)


# The two gathers are each other's transpose (tokens and real slots are in bijection, padding
# slots get zero cotangents). Autodiff would transpose a gather into a scatter-add, which on
# GPUs runs as atomics; these VJPs keep both directions gathers.
@jax.custom_vjp
def _gather_to_slots(x, token_map):
    return _slots_from_tokens(x, token_map)


@jax.custom_vjp
def _gather_to_tokens(y, token_map):
    return _tokens_from_slots(y, token_map)


_gather_to_slots.defvjp(lambda x, tm: (_slots_from_tokens(x, tm), tm),
                        lambda tm, dy: (_gather_to_tokens(dy, tm), None))
_gather_to_tokens.defvjp(lambda y, tm: (_tokens_from_slots(y, tm), tm),
                         lambda tm, dx: (_gather_to_slots(dx, tm), None))


def to_chunks(x: jax.Array, token_map: TokenMap | None, n_chunks: int, chunk_size: int) -> jax.Array:
    """[B, T_local, HV, *tail] -> [NT, B, HV, C, *tail], padding slots zero."""
    B, T = x.shape[:2]
    if token_map is None:
        x = jnp.pad(x, [(0, 0), (0, n_chunks * chunk_size - T)] + [(0, 0)] * (x.ndim - 2))
    else:
        x = _gather_to_slots(x, token_map)
    x = x.reshape(B, n_chunks, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, (1, 3), (0, 2))


def from_chunks(y: jax.Array, token_map: TokenMap | None, t_local: int) -> jax.Array:
    """[NT, B, HV, C, *tail] -> [B, T_local, HV, *tail] (inverse of to_chunks on real tokens)."""
    y = jnp.moveaxis(y, (0, 2), (1, 3))
    B, NT, C = y.shape[:3]
    y = y.reshape(B, NT * C, *y.shape[3:])
    if token_map is None:
        return y[:, :t_local]
    return _gather_to_tokens(y, token_map)


def chunks_by_table(x: jax.Array, layout: ChunkLayout, chunk_size: int) -> jax.Array:
    """[B, T_local, HV, *tail] -> [NT, B, HV, C, *tail] from the layout alone (a token table
    and no TokenMap, as the kernels that read chunks in place have): row i of chunk c is
    token token_start + i for i < token_count, zero past."""
    B, T = x.shape[:2]
    i = jnp.arange(chunk_size)
    tokens = jnp.minimum(layout.token_start[..., None] + i, T - 1)           # [NT, B, C]
    rows = x[jnp.arange(B)[None, :, None], tokens]                           # [NT, B, C, HV, ...]
    real = (i < layout.token_count[..., None]).reshape(tokens.shape + (1,) * (x.ndim - 2))
    return jnp.moveaxis(jnp.where(real, rows, jnp.zeros((), x.dtype)), 3, 2)
