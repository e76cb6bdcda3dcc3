"""The gate as the jnp stages take it: the per-token decay g <= 0, float32, in the token
layout of the caller's gate ([B, T, HV, 1] for a scalar gate, [B, T, HV, K] per channel).
The stages take its cumsum over each chunk themselves (``intra.chunk_local_cumsum``).
Twin of the Pallas KDA gate stage, which returns that cumsum (``stages``)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxcp.gate import Gate, decay_from_raw


def per_token_decay(g, layout, activation=None, *, gate: Gate):
    """g [B, T, HV] or [B, T, HV, K] as the decay, float32; activation: None (g is the
    decay), or (A_log, dt_bias, lower_bound) that turn the raw g into it
    (``gate.decay_from_raw``). The layout is not read (the stages chunk the decay as they
    chunk the other token tensors)."""
    g = g.astype(jnp.float32) if activation is None else decay_from_raw(gate, g, *activation)
    return g[..., None] if gate is Gate.SCALAR else g
