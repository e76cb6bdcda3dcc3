"""Causal depthwise short convolution, segment-aware and context-parallel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxcp.cp.halo import previous_tokens
from jaxcp.layout import sequence_of


class ShortConvolution(nnx.Module):
    """y_t = act(sum_{j < W} weight[W - 1 - j] * x_{t - j}), per channel, never reaching across a
    sequence start (taps from another sequence, or before the stream, read zero).

    weight [conv_size, hidden] is FLA's Conv1d weight [hidden, 1, conv_size] transposed.
    With cp_axis (inside shard_map, x is this device's slice of the sequence), the W - 1 tokens
    before the shard come from the earlier devices (``cp.halo.previous_tokens``), also when
    T_local < W - 1.
    """

    def __init__(self, hidden_size: int, conv_size: int = 4, activation: str | None = "silu",
                 cp_axis: str | None = None, *, rngs: nnx.Rngs):
        if conv_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {conv_size}")
        if activation not in (None, "silu"):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        bound = conv_size ** -0.5          # PyTorch's Conv1d default for groups == channels
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (conv_size, hidden_size),
                                                   jnp.float32, -bound, bound))
        self.conv_size = conv_size
        self.activation = activation
        self.cp_axis = cp_axis

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array | None = None) -> jax.Array:
        """x [B, T, hidden] -> [B, T, hidden]; cu_seqlens: global offsets (B == 1)."""
        B, T, _ = x.shape
        W = self.conv_size
        if self.cp_axis is None:
            halo = jnp.zeros((B, W - 1) + x.shape[2:], x.dtype)
            start = 0
        else:
            halo = previous_tokens(x, W - 1, self.cp_axis)
            start = lax.axis_index(self.cp_axis) * T
        ext = jnp.concatenate([halo, x], axis=1)
        pos = start - (W - 1) + jnp.arange(T + W - 1)
        if cu_seqlens is None:
            seq = jnp.zeros_like(pos)
        else:
            seq = sequence_of(cu_seqlens, pos)
        weight = self.weight[...].astype(x.dtype)
        y = jnp.zeros_like(x)
        for lag in range(W):
            src = slice(W - 1 - lag, W - 1 - lag + T)
            keep = (pos[src] >= 0) & (seq[src] == seq[W - 1:])
            y = y + jnp.where(keep[None, :, None], ext[:, src] * weight[W - 1 - lag], 0)
        return jax.nn.silu(y) if self.activation == "silu" else y
