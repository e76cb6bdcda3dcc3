"""Causal depthwise short convolution, segment-aware and context-parallel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcp.cp.halo import previous_tokens
from jaxcp.cp.split import axis_pieces, check_layout
from jaxcp.layout import sequence_of
from jaxcp.models.inputs import check_hidden_states


class ShortConvolution(nnx.Module):
    """y_t = act(sum_{j < W} weight[W - 1 - j] * x_{t - j}), per channel, never reaching across a
    sequence start (taps from another sequence, or before the stream, read zero).

    weight [conv_size, hidden] is FLA's Conv1d weight [hidden, 1, conv_size] transposed.
    With cp_axis (inside shard_map, x is this device's tokens of the sequence, laid out by
    cp_layout: ``cp.split``), the W - 1 tokens before each piece come from the devices that
    hold the pieces before it (``cp.halo.previous_tokens``), also when a piece is shorter.
    """

    def __init__(self, hidden_size: int, conv_size: int = 4, activation: str | None = "silu",
                 cp_axis: str | None = None, cp_layout: str = "contiguous", *,
                 rngs: nnx.Rngs):
        check_layout(cp_layout)
        if conv_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {conv_size}")
        if activation not in (None, "silu"):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        bound = conv_size ** -0.5          # PyTorch's Conv1d default for groups == channels
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (conv_size, hidden_size),
                                                   jnp.float32, -bound, bound))
        self.hidden_size = hidden_size
        self.conv_size = conv_size
        self.activation = activation
        self.cp_axis = cp_axis
        self.cp_layout = cp_layout

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array | None = None,
                 window: jax.Array | None = None) -> jax.Array:
        """x [B, T, hidden] -> [B, T, hidden]; cu_seqlens: global offsets (B == 1); window
        [B, conv_size - 1, hidden]: the inputs before the sequence, which x continues (a
        decoding cache's; None: zeros; not with cu_seqlens)."""
        return self._convolve(x, cu_seqlens, window, self.cp_axis)

    def extend(self, x: jax.Array, window: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Decoding on one device: x [B, T, hidden] continues a sequence whose last
        conv_size - 1 inputs are window [B, conv_size - 1, hidden]. Returns the outputs and
        the window after x."""
        y = self._convolve(x, None, window, None)
        return y, jnp.concatenate([window.astype(x.dtype), x], axis=1)[:, x.shape[1]:]

    def _convolve(self, x, cu_seqlens, window, axis):
        """``__call__`` over the manual mesh axis `axis` (None: on one device)."""
        check_hidden_states(x, self.hidden_size, "ShortConvolution")
        B, T, _ = x.shape
        W = self.conv_size
        shift = 0
        if window is not None:
            if cu_seqlens is not None:
                raise ValueError("ShortConvolution: a window continues one sequence per batch "
                                 "row: cu_seqlens must be None")
            if window.shape != (B, W - 1, self.hidden_size):
                raise ValueError(f"ShortConvolution: window must be [B, conv_size - 1 = "
                                 f"{W - 1}, {self.hidden_size}], got {tuple(window.shape)}")
            window = window.astype(x.dtype)
            shift = W - 1               # the stream starts with the window: its taps count
        local = axis_pieces(self.cp_layout, axis, T)
        if axis is None:
            halos = (window,)
        else:
            halos = previous_tokens(x, W - 1, axis, self.cp_layout, before=window)
        weight = self.weight[...].astype(x.dtype)
        y = jnp.concatenate([self._piece(x[:, p.offset:p.offset + p.length], halo,
                                         p.start + shift, weight, cu_seqlens)
                             for p, halo in zip(local, halos)], axis=1)
        return jax.nn.silu(y) if self.activation == "silu" else y

    def _piece(self, x, halo, start, weight, cu_seqlens):
        """The convolution of one piece x [B, L, hidden] at global tokens [start, start + L),
        halo [B, W - 1, hidden] the tokens before it (None: zeros). The piece is convolved
        as if zeros came before it, and the halo's taps are added to its first W - 1
        outputs apart, so that no [B, L + W - 1, hidden] copy of x is made."""
        W, L = self.conv_size, x.shape[1]
        zeros = lambda n: jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
        y = self._taps(jnp.concatenate([zeros(W - 1), x], axis=1), start, L, weight,
                       cu_seqlens)
        if halo is None or W == 1:
            return y
        n = min(L, W - 1)
        head = self._taps(jnp.concatenate([halo, zeros(n)], axis=1), start, n, weight,
                          cu_seqlens)
        return y + jnp.pad(head, ((0, 0), (0, L - n), (0, 0)))

    def _taps(self, ext, start, L, weight, cu_seqlens):
        """sum_j weight[W - 1 - j] * ext[W - 1 + t - j] for the outputs t < L, ext [B, L + W - 1,
        hidden] holding the tokens [start - W + 1, start + L); taps before the stream's start
        or in another sequence than t's read zero."""
        W = self.conv_size
        pos = start - (W - 1) + jnp.arange(L + W - 1)
        seq = jnp.zeros_like(pos) if cu_seqlens is None else sequence_of(cu_seqlens, pos)
        y = jnp.zeros(ext.shape[:1] + (L,) + ext.shape[2:], ext.dtype)
        for lag in range(W):
            src = slice(W - 1 - lag, W - 1 - lag + L)
            keep = (pos[src] >= 0) & (seq[src] == seq[W - 1:])
            y = y + jnp.where(keep[None, :, None], ext[:, src] * weight[W - 1 - lag], 0)
        return y
