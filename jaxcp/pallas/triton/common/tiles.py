"""Elementwise helpers on register tiles: float32, index grids, lower triangles."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def f32(x):
    return x.astype(jnp.float32)


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def lower(x, *, strict: bool):
    """x [n, n] below the diagonal (strict) or on and below it, 0 elsewhere."""
    rows, cols = iota(x.shape, 0), iota(x.shape, 1)
    return jnp.where(rows > cols if strict else rows >= cols, x, 0.0)
