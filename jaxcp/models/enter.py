"""Letting a layer with cp_axis run both inside and outside the user's shard_map.

Inside a shard_map where cp_axis is manual the layer runs as is. Outside (plain jax.jit on a
mesh set with ``jax.set_mesh``), the layer enters shard_map itself over the current mesh: its
parameters replicated, x [B, T, ...] split over the mesh's batch axes (those of BATCH_AXES the
mesh has) and over cp_axis along T.
"""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcp.vma import manual_axis_size

BATCH_AXES = ("data",)


def split_over_axis(cp_axis: str | None) -> bool:
    """Whether this call runs inside a shard_map where cp_axis is manual."""
    return cp_axis is not None and manual_axis_size(cp_axis) is not None


def call_with_cp(module: nnx.Module, cp_axis: str | None, x: jax.Array,
                 cu_seqlens: jax.Array | None, body: Callable) -> jax.Array:
    """body(module, x, cu_seqlens) directly, or inside shard_map over the current mesh."""
    if cp_axis is None or split_over_axis(cp_axis):
        return body(module, x, cu_seqlens)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or cp_axis not in mesh.axis_names:
        raise ValueError(f"cp_axis={cp_axis!r}: call the layer inside jax.shard_map with that axis "
                         f"manual, or under jax.set_mesh(mesh) with a mesh that has the axis")
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names and a != cp_axis) or None
    spec = P(batch, cp_axis)
    graph, state = nnx.split(module)

    def inner(state, x, cu_seqlens):
        return body(nnx.merge(graph, state), x, cu_seqlens)

    return jax.shard_map(inner, mesh=mesh, in_specs=(P(), spec, P()),
                         out_specs=spec)(state, x, cu_seqlens)
