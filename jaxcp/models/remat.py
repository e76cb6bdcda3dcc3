"""Recompute a module in the backward pass, and only once its output's cotangent exists.

``jax.checkpoint`` keeps a module's inputs and recomputes its activations in the backward,
but XLA is then free to schedule every recomputation as early as it likes: under context
parallelism the GPU's latency-hiding scheduler moves the recomputed forwards of all blocks
ahead of the backward chain (to overlap them with its collectives), so every block's
activations are alive at once and remat saves nothing. ``remat_call`` ties each recomputation to the
cotangent arriving from the layers after it with an ``optimization_barrier``, and releases
the cotangent of its input only with its parameters' cotangents: the backward of block i
starts its forward again only when block i + 1's backward is done, weight gradients
included (otherwise the scheduler defers every block's weight gradients to the end of the
step, and with them the activations they read), so one block's activations are alive at a
time whatever the scheduler does.
"""
from __future__ import annotations

from functools import partial

import jax
from flax import nnx
from jax import lax


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _apply(graph, state, x, cu_seqlens):
    return nnx.merge(graph, state)(x, cu_seqlens)


def _apply_fwd(graph, state, x, cu_seqlens):
    return _apply(graph, state, x, cu_seqlens), (state, x, cu_seqlens)


def _apply_bwd(graph, residuals, ct):
    state, x, cu_seqlens, ct = lax.optimization_barrier((*residuals, ct))
    _, vjp = jax.vjp(lambda s, y: nnx.merge(graph, s)(y, cu_seqlens), state, x)
    d_state, dx = lax.optimization_barrier(vjp(ct))
    return d_state, dx, None


_apply.defvjp(_apply_fwd, _apply_bwd)


def remat_call(module: nnx.Module, x: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    """module(x, cu_seqlens), keeping only its parameters and inputs for the backward, which
    recomputes it after the cotangent of its output is complete (module docstring)."""
    graph, state = nnx.split(module)
    return _apply(graph, state, x, cu_seqlens)
