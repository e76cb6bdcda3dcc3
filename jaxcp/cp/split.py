"""How a sequence is split over the devices of the CP axis: the contiguous or zigzag layout.

Of a sequence of T = W * T_local tokens on W devices,
  contiguous: device r holds tokens [r T_local, (r + 1) T_local);
  zigzag:     the sequence is cut into 2W pieces of P = T_local / 2 tokens, and device r
              holds piece r, then piece 2W - 1 - r.
Under causal attention every device of the zigzag layout does the same work (the early piece
of one device pairs with the late piece of another); under the contiguous one the last device
does 2W - 1 times the first one's.

A device's tokens form ``Piece``s, runs of tokens that are contiguous in the sequence: one
under the contiguous layout, two under zigzag. Arrays stay in the layout's order everywhere
(the batch is permuted once, at the input: ``to_layout``); what depends on positions (the
delta rule's state, the convolution's halo, attention's mask) asks ``pieces`` and
``positions`` where each token sits.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CP_LAYOUTS = ("contiguous", "zigzag")


class Piece(NamedTuple):
    """A run of a device's tokens that is contiguous in the sequence: local tokens
    [offset, offset + length) are global tokens [start, start + length). index: the piece's
    place in the sequence (0 .. n_pieces - 1, traced), start = index * length."""
    index: jax.Array
    start: jax.Array
    offset: int
    length: int


def check_layout(cp_layout: str, t_local: int | None = None) -> None:
    if cp_layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
    if cp_layout == "zigzag" and t_local is not None and t_local % 2:
        raise ValueError(f"cp_layout='zigzag' needs an even number of tokens per device, got "
                         f"{t_local}")


def pieces(cp_layout: str, rank: jax.Array, world: int, t_local: int) -> tuple[Piece, ...]:
    """The pieces of device `rank` (traced) of `world`, in local order."""
    if cp_layout == "contiguous":
        return (Piece(rank, rank * t_local, 0, t_local),)
    half = t_local // 2
    late = 2 * world - 1 - rank
    return Piece(rank, rank * half, 0, half), Piece(late, late * half, half, half)


def positions(cp_layout: str, rank: jax.Array, world: int, t_local: int) -> jax.Array:
    """Global position of each of the device's tokens, int32 [t_local]."""
    return jnp.concatenate([p.start + jnp.arange(p.length, dtype=jnp.int32)
                            for p in pieces(cp_layout, rank, world, t_local)]).astype(jnp.int32)


def axis_pieces(cp_layout: str, axis: str | None, t_local: int) -> tuple[Piece, ...]:
    """``pieces`` of this device inside shard_map, over the manual mesh axis `axis`; axis
    None (no CP): the whole sequence, one piece."""
    if axis is None:
        return pieces("contiguous", 0, 1, t_local)
    return pieces(cp_layout, lax.axis_index(axis), lax.axis_size(axis), t_local)


def axis_piece_indices(cp_layout: str, axis: str) -> tuple[jax.Array, ...]:
    """The places in the sequence of this device's pieces, inside shard_map over `axis`."""
    rank = lax.axis_index(axis)
    if cp_layout == "contiguous":
        return (rank,)
    return rank, 2 * lax.axis_size(axis) - 1 - rank


def axis_positions(cp_layout: str, axis: str | None, t_local: int) -> jax.Array:
    """``positions`` of this device's tokens inside shard_map over `axis` (axis None: no
    CP, 0 .. t_local - 1)."""
    if axis is None:
        return positions("contiguous", 0, 1, t_local)
    return positions(cp_layout, lax.axis_index(axis), lax.axis_size(axis), t_local)


def in_sequence_order(per_device: jax.Array, cp_layout: str) -> jax.Array:
    """[W, pieces per device, ...] (device, local piece) -> [n_pieces, ...] in sequence
    order: under zigzag the devices' early pieces, then their late pieces reversed."""
    if cp_layout == "contiguous":
        return per_device[:, 0]
    return jnp.concatenate([per_device[:, 0], per_device[::-1, 1]])


def piece_order(cp_layout: str, world: int, n_tokens: int) -> np.ndarray:
    """order [n_tokens]: the layout's token stream, as sequence positions. x[:, order] laid
    contiguously over the axis gives device r its tokens of the layout."""
    check_layout(cp_layout)
    if cp_layout == "contiguous":
        return np.arange(n_tokens)
    if n_tokens % (2 * world):
        raise ValueError(f"zigzag over {world} devices needs a length divisible by "
                         f"{2 * world}, got {n_tokens}")
    half = n_tokens // (2 * world)
    return np.concatenate([np.arange(p * half, (p + 1) * half)
                           for r in range(world) for p in (r, 2 * world - 1 - r)])


def to_layout(x, cp_layout: str, world: int, axis: int = 1):
    """Sequence order -> the layout's order along `axis` (numpy or jax arrays)."""
    order = piece_order(cp_layout, world, x.shape[axis])
    return x if cp_layout == "contiguous" else x.take(order, axis=axis)


def from_layout(x, cp_layout: str, world: int, axis: int = 1):
    """The layout's order -> sequence order along `axis` (inverse of to_layout)."""
    order = piece_order(cp_layout, world, x.shape[axis])
    return x if cp_layout == "contiguous" else x.take(np.argsort(order), axis=axis)


def gather_in_order(x: jax.Array, cp_layout: str, axis: str) -> tuple[jax.Array, ...]:
    """x [B, T_local, ...] of every device, all-gathered over `axis` as runs of consecutive
    sequence positions: contiguous, one run, the whole sequence; zigzag, the early pieces
    (tokens [0, W P)) and the late ones (tokens [W P, 2 W P)), each late piece first sent
    to the device mirroring its own so that the gather lays them in order."""
    gather = lambda y: lax.all_gather(y, axis, axis=1, tiled=True)
    if cp_layout == "contiguous":
        return (gather(x),)
    W, P = lax.axis_size(axis), x.shape[1] // 2
    mirror = lax.ppermute(x[:, P:], axis, [(i, W - 1 - i) for i in range(W)])
    return gather(x[:, :P]), gather(mirror)


def whole_sequence(x: jax.Array, cp_layout: str, axis: str) -> jax.Array:
    """x [B, T_local, ...] of every device -> the whole sequence [B, W T_local, ...] in order,
    the same on every device: each device's tokens at their positions, summed over the axis
    (an all-reduce rather than an all-gather, so that shard_map knows the result replicated)."""
    T = x.shape[1]
    pos = axis_positions(cp_layout, axis, T)
    placed = jnp.zeros((x.shape[0], lax.axis_size(axis) * T) + x.shape[2:], x.dtype)
    return lax.psum(placed.at[:, pos].set(x), axis)


def next_piece_shift(cp_layout: str, axis: str, tails: tuple) -> tuple:
    """tails: one array per local piece (in local order). Returns, per local piece, the array
    of the piece just before it in the sequence (zeros for piece 0), moved with ppermute."""
    W = lax.axis_size(axis)
    forward = [(i, i + 1) for i in range(W - 1)]
    if cp_layout == "contiguous":
        return (lax.ppermute(tails[0], axis, forward),)
    early, late = tails
    rank = lax.axis_index(axis)
    # piece r follows piece r - 1 (device r - 1's early piece); piece 2W - 1 - r follows
    # piece 2W - 2 - r: device r + 1's late piece, or, on the last device, its own early one
    from_early = lax.ppermute(early, axis, forward)
    from_late = lax.ppermute(late, axis, [(i + 1, i) for i in range(W - 1)])
    return from_early, jnp.where(rank == W - 1, early, from_late)
