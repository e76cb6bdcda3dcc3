"""Keeping ``shard_map``'s varying-manual-axes (vma) types consistent inside jaxcp.

Under ``shard_map(check_vma=True)`` a value created inside the body (a zero state, say) is
invariant across the manual axes while the data is varying; scan carries and custom_vjp
cotangents must agree. Under ``check_vma=False`` every value reports no varying axes and these
helpers do nothing.
"""
import jax
from jax import lax


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes over which x varies (empty outside shard_map)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset() if mat is None else frozenset(mat.varying)


def manual_axis_size(axis: str) -> int | None:
    """Size of `axis` if it is a manual axis of an enclosing shard_map, else None."""
    try:
        return lax.axis_size(axis)
    except NameError:
        return None


def _vary_over(leaf: jax.Array, axes: frozenset) -> jax.Array:
    missing = tuple(sorted(axes - varying_axes(leaf)))
    return lax.pcast(leaf, missing, to="varying") if missing else leaf


def vary_like(x, ref: jax.Array):
    """Cast every leaf of x to vary over the axes ref varies over and it does not."""
    want = varying_axes(ref)
    return jax.tree.map(lambda leaf: _vary_over(leaf, want), x)


def match_cotangent(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Give a cotangent the vma type of its primal: sum over axes the primal is invariant on,
    broadcast over axes it varies on."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    if extra:
        ct = lax.psum(ct, extra)
    return vary_like(ct, primal)


def inside_shard_map() -> bool:
    """Whether a manual mesh axis is in scope (a shard_map body), with check_vma or without."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def unify(args: list) -> tuple[list, object]:
    """Cast all arrays in args to vary over the union of their varying axes, for a
    pallas_call inside shard_map(check_vma=True). Returns the cast args and the manual axis
    type to give the call's output ShapeDtypeStructs: None outside shard_map; inside it,
    the inputs' own where none varies (a pallas_call there needs one, invariant or not)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    if not axes:
        return args, (jax.typeof(args[0]).manual_axis_type if inside_shard_map() else None)
    cast = [_vary_over(a, axes) for a in args]
    return cast, jax.typeof(cast[0]).manual_axis_type
