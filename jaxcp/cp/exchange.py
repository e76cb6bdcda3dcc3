"""The cross-device step of the chunked delta rule, inside its custom_vjp (``core``).

Forward, the state entering each of this device's pieces of the sequence (``cp.split``);
backward, the cotangent of the state leaving each piece, from the pieces after it. A piece
run as S segments (``cp.segments``) has them per row: every segment is a piece of its own in
the merge, and without CP the merge of the device's segments is the whole step:

  allgather: each piece's summary (S_ext, M) (backward: its entry cotangent dS_ext and M),
             one all-gather, stacked in sequence order, a prefix (suffix) merge (``merge``);
  relay:     W - 1 sequential hand-offs of the state (cotangent) with ``ppermute``, the
             baseline; contiguous layout only.

(all_to_all splits heads instead and runs the op without CP: ``cp.all_to_all``.)
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.cp.merge import merge_prefix, merge_suffix
from jaxcp.cp.segments import join_rows, split_rows
from jaxcp.cp.split import axis_piece_indices, in_sequence_order
from jaxcp.terms import ChunkTerms
from jaxcp.vma import vary_like


@dataclass(frozen=True)
class Exchange:
    """axis: the manual mesh axis of the sequence; strategy: "allgather" or "relay";
    layout: how the sequence is split over the axis (``cp.split``)."""
    axis: str
    strategy: str
    layout: str


def zero_state(terms: ChunkTerms) -> jax.Array:
    B, HV, _, K = terms.w.shape[1:]
    return vary_like(jnp.zeros((B, HV, K, terms.u.shape[-1]), jnp.float32), terms.w)


def _shift(axis: str, x: jax.Array, step: int) -> jax.Array:
    """Send x from device r to device r + step (devices with no sender get zeros)."""
    W = lax.axis_size(axis)
    perm = [(i, i + step) for i in range(W) if 0 <= i + step < W]
    return lax.ppermute(x, axis, perm)


def _resets(layout) -> jax.Array:
    """[B] int32: 1 where a sequence starts in the piece (its M is zero)."""
    return jnp.any(layout.chunk_starts, axis=0).astype(jnp.int32)


def _gather_summaries(ex: Exchange, per_piece: list):
    """All-gather each local piece's arrays (a pytree per piece) over the axis, in one
    collective, and stack them in sequence order: [n_pieces, ...]."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_piece)
    gathered = lax.all_gather(stacked, ex.axis)                        # [W, local, ...]
    return jax.tree.map(lambda a: in_sequence_order(a, ex.layout), gathered)


def _in_order(ex: Exchange | None, per_piece: list, segments: int):
    """Each local piece's per-row arrays [B S, ...] (a tuple per piece) -> those of every
    segment of every piece of the sequence, in sequence order, [n_pieces S, B, ...]."""
    per_piece = [tuple(split_rows(x, segments) for x in arrays) for arrays in per_piece]
    if ex is None:
        ordered = jax.tree.map(lambda *xs: jnp.stack(xs), *per_piece)
    else:
        ordered = _gather_summaries(ex, per_piece)
    return tuple(a.reshape(-1, *a.shape[2:]) for a in ordered)


def _rows_of(all_pieces: jax.Array, piece: jax.Array, segments: int) -> jax.Array:
    """[n_pieces S, B, ...] -> the rows [B S, ...] of the piece at place `piece`."""
    return join_rows(lax.dynamic_slice_in_dim(all_pieces, piece * segments, segments))


def _piece_places(ex: Exchange | None) -> tuple:
    """The places in the sequence of this device's pieces, and their number."""
    if ex is None:
        return (0,), 1
    places = axis_piece_indices(ex.layout, ex.axis)
    return places, lax.axis_size(ex.axis) * len(places)


def entry_states(ex: Exchange | None, stages, terms: list, layouts: list, init,
                 segments: int = 1):
    """The state entering each local piece's first chunk (per row: [B S, HV, K, V] with
    ``segments``), and each piece's transition M with its resets ([B S]: a sequence starts
    in the row) for the backward (None without a merge). ex None and one segment: zero
    states."""
    zeros = [zero_state(t) for t in terms]
    if ex is None and segments == 1:
        return zeros, [None] * len(terms)
    places, n_pieces = _piece_places(ex)
    if ex is None or ex.strategy == "allgather":
        # no piece after the last one reads its summary
        summaries = [(*stages.cp_summary(t, lay, init, unused=_unused(p == n_pieces - 1,
                                                                       segments)),
                      _resets(lay)) for t, lay, p in zip(terms, layouts, places)]
        entries = merge_prefix(*_in_order(ex, summaries, segments))
        return ([_rows_of(entries, p, segments) for p in places],
                [(m, resets) for _, m, resets in summaries])
    (t,), (lay,) = terms, layouts
    relay = lambda _, s_in: _shift(ex.axis, stages.state_last(t, lay, init, s_in), +1)
    return [lax.fori_loop(0, lax.axis_size(ex.axis) - 1, relay, zeros[0])], [None]


def _unused(unused_piece, segments: int):
    """A piece's summary is unused by the merge only when the piece is one row."""
    return unused_piece if segments == 1 else None


def exit_cotangents(ex: Exchange | None, stages, terms: list, layouts: list, do: tuple,
                    d_final, ms: list, segments: int = 1):
    """The cotangent of the state leaving each local piece's last chunk (per row), from the
    pieces after it (ms: the pieces' transitions and resets from ``entry_states``). ex None
    and one segment: zeros."""
    zeros = [zero_state(t) for t in terms]
    if ex is None and segments == 1:
        return zeros
    entry_grad = lambda t, lay, d, d_last, unused=None: stages.state_bwd(
        t, lay, d, d_final, d_last, entry_only=True, unused=unused)
    places, _ = _piece_places(ex)
    if ex is None or ex.strategy == "allgather":
        # no piece before the first one reads its entry cotangent
        exits = merge_suffix(*_in_order(ex, [
            (entry_grad(t, lay, d, z, _unused(p == 0, segments)), m, resets)
            for t, lay, d, z, p, (m, resets) in zip(terms, layouts, do, zeros, places, ms)],
            segments))
        return [_rows_of(exits, p, segments) for p in places]
    (t,), (lay,), (d,) = terms, layouts, do
    relay = lambda _, d_last: _shift(ex.axis, entry_grad(t, lay, d, d_last), -1)
    return [lax.fori_loop(0, lax.axis_size(ex.axis) - 1, relay, zeros[0])]
