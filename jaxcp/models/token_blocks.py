"""Splitting the token axis into blocks, for work done one block at a time (the MLP, the
loss) so that its intermediates exist for one block only."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def to_token_blocks(x: jax.Array, block: int) -> jax.Array:
    """[B, T, ...] -> [ceil(T / block), B, block, ...], the last block padded with zeros."""
    B, T = x.shape[:2]
    n = -(-T // block)
    x = jnp.pad(x, [(0, 0), (0, n * block - T)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, n, block, *x.shape[2:]), 1, 0)


def from_token_blocks(y: jax.Array, tokens: int) -> jax.Array:
    """[n, B, block, ...] -> [B, tokens, ...] (inverse of to_token_blocks)."""
    n, B, block = y.shape[:3]
    return jnp.moveaxis(y, 0, 1).reshape(B, n * block, *y.shape[3:])[:, :tokens]
