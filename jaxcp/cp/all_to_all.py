"""The head-parallel baseline: all-to-all from sequence shards to head shards and back.

Each device gets H / W of the q/k heads (and their HV / W value heads) for the whole sequence,
runs the single-device op, and sends the outputs back to sequence shards. Final states, split
by heads, are reassembled on every device.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

from jaxcp.cp.split import from_layout, to_layout


def head_all_to_all(run: Callable, cp_axis: str, q, k, v, g, beta, initial_state,
                    cp_layout: str = "contiguous"):
    """run(q, k, v, g, beta, initial_state) -> (o, final_state) is the op without CP; inputs
    are this device's tokens [B, T_local, heads, ...] in cp_layout (``cp.split``)."""
    W = lax.axis_size(cp_axis)
    rank = lax.axis_index(cp_axis)
    # after the all-to-all the tokens are the devices' streams one after the other: the
    # layout's order of the whole sequence
    to_heads = lambda x: from_layout(lax.all_to_all(x, cp_axis, 2, 1, tiled=True), cp_layout, W)
    q, k, v, g, beta = map(to_heads, (q, k, v, g, beta))
    if initial_state is not None:
        hv = initial_state.shape[1] // W
        initial_state = lax.dynamic_slice_in_dim(initial_state, rank * hv, hv, axis=1)
    o, final = run(q, k, v, g, beta, initial_state)
    o = lax.all_to_all(to_layout(o, cp_layout, W), cp_axis, 1, 2, tiled=True)
    if final is not None:
        placed = jnp.zeros(final.shape[:1] + (final.shape[1] * W,) + final.shape[2:], final.dtype)
        final = lax.psum(lax.dynamic_update_slice_in_dim(placed, final, rank * final.shape[1], 1),
                         cp_axis)
    return o, final
