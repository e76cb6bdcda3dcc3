"""The cross-device step of the chunked delta rule, inside its custom_vjp (``core``).

Forward, the state entering each of this device's pieces of the sequence (``cp.split``);
backward, the cotangent of the state leaving each piece, from the pieces after it:

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


def entry_states(ex: Exchange | None, stages, terms: list, layouts: list, init):
    """The state entering each local piece's first chunk, and each piece's transition M with
    its resets ([B]: a sequence starts in the piece) for the backward (allgather; None
    otherwise). ex None: no CP, zero states."""
    zeros = [zero_state(t) for t in terms]
    if ex is None:
        return zeros, [None] * len(terms)
    pieces = axis_piece_indices(ex.layout, ex.axis)
    if ex.strategy == "allgather":
        n_pieces = lax.axis_size(ex.axis) * len(pieces)
        # no piece after the last one reads its summary
        summaries = [(*stages.cp_summary(t, lay, init, unused=p == n_pieces - 1), _resets(lay))
                     for t, lay, p in zip(terms, layouts, pieces)]
        ext_all, m_all, resets_all = _gather_summaries(ex, summaries)
        return ([merge_prefix(ext_all, m_all, resets_all, p) for p in pieces],
                [(m, resets) for _, m, resets in summaries])
    (t,), (lay,) = terms, layouts
    relay = lambda _, s_in: _shift(ex.axis, stages.state_last(t, lay, init, s_in), +1)
    return [lax.fori_loop(0, lax.axis_size(ex.axis) - 1, relay, zeros[0])], [None]


def exit_cotangents(ex: Exchange | None, stages, terms: list, layouts: list, do: tuple,
                    d_final, ms: list):
    """The cotangent of the state leaving each local piece's last chunk, from the pieces
    after it (ms: the pieces' transitions and resets from ``entry_states``). ex None: zeros."""
    zeros = [zero_state(t) for t in terms]
    if ex is None:
        return zeros
    entry_grad = lambda t, lay, d, d_last, unused=None: stages.state_bwd(
        t, lay, d, d_final, d_last, entry_only=True, unused=unused)
    pieces = axis_piece_indices(ex.layout, ex.axis)
    if ex.strategy == "allgather":
        # no piece before the first one reads its entry cotangent
        d_ext_all, m_all, resets_all = _gather_summaries(ex, [
            (entry_grad(t, lay, d, z, p == 0), m, resets)
            for t, lay, d, z, p, (m, resets) in zip(terms, layouts, do, zeros, pieces, ms)])
        return [merge_suffix(d_ext_all, m_all, resets_all, p) for p in pieces]
    (t,), (lay,), (d,) = terms, layouts, do
    relay = lambda _, d_last: _shift(ex.axis, entry_grad(t, lay, d, d_last), -1)
    return [lax.fori_loop(0, lax.axis_size(ex.axis) - 1, relay, zeros[0])]
