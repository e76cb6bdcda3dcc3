"""The conv halo: the last tokens before this device's shard, fetched from earlier devices.

A causal convolution of width W at a device's first tokens needs the W - 1 tokens before its
shard. They may sit on several earlier devices when T_local < W - 1, so the window is passed on
hop by hop with ``lax.ppermute``: after hop n every device holds the last W - 1 tokens of
everything up to n devices back. Gradients flow back through the same permutes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def previous_tokens(x: jax.Array, width: int, axis: str) -> jax.Array:
    """x [B, T_local, ...] -> [B, width, ...]: the `width` tokens just before this device's
    shard along axis 1 (zeros before the first device's start)."""
    W = lax.axis_size(axis)
    t_local = x.shape[1]
    perm = [(i, i + 1) for i in range(W - 1)]
    window = jnp.zeros((x.shape[0], width) + x.shape[2:], x.dtype)
    hops = min(W - 1, -(-width // t_local))
    for _ in range(hops):
        tail = jnp.concatenate([window, x], axis=1)[:, -width:]
        window = lax.ppermute(tail, axis, perm)
    return window
