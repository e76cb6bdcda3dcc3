"""The conv halo: the last tokens before each of this device's pieces, fetched from the devices
that hold the pieces before them; and the sequence's last tokens, for a decoding cache.

A causal convolution of width W at a piece's first tokens needs the W - 1 tokens before it.
They may sit in several earlier pieces when a piece is shorter than W - 1, so the window is
passed on hop by hop with ``lax.ppermute``: after hop n every piece holds the last W - 1
tokens of everything up to n pieces back. Gradients flow back through the same permutes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.cp.split import axis_pieces, next_piece_shift


def previous_tokens(x: jax.Array, width: int, axis: str, cp_layout: str = "contiguous",
                    before: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """x [B, T_local, ...] -> one [B, width, ...] window per local piece (``cp.split``): the
    `width` tokens just before the piece in the sequence. before [B, width, ...]: the tokens
    before the sequence's first piece (a decoding cache's window; None: zeros)."""
    local = axis_pieces(cp_layout, axis, x.shape[1])
    xs = [x[:, p.offset:p.offset + p.length] for p in local]
    zeros = jnp.zeros((x.shape[0], width) + x.shape[2:], x.dtype)
    first = lambda p, w: w if before is None else jnp.where(p.index == 0, before, w)
    windows = tuple(first(p, zeros) for p in local)
    n_pieces = lax.axis_size(axis) * len(local)
    hops = min(n_pieces - 1, -(-width // local[0].length))
    for _ in range(hops):
        tails = tuple(jnp.concatenate([w, xp[:, -width:]], axis=1)[:, -width:]
                      for w, xp in zip(windows, xs))
        windows = tuple(first(p, w) for p, w in
                        zip(local, next_piece_shift(cp_layout, axis, tails)))
    return windows


def sequence_tail(x: jax.Array, width: int, axis: str,
                  cp_layout: str = "contiguous") -> jax.Array:
    """x [B, T_local, ...] of every device -> the sequence's last `width` tokens
    [B, width, ...], the same on every device (a decoding cache's window after a prefill
    split over the axis). The sequence's last piece must hold `width` tokens."""
    local = axis_pieces(cp_layout, axis, x.shape[1])
    last = local[-1]
    if last.length < width:
        raise ValueError(f"the window of the last {width} tokens needs pieces of at least "
                         f"{width} tokens per device, got {last.length}")
    tail = x[:, last.offset + last.length - width:last.offset + last.length]
    holds = last.index == lax.axis_size(axis) * len(local) - 1
    return lax.psum(jnp.where(holds, tail, jnp.zeros((), x.dtype)), axis)
