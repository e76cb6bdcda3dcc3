"""A kernel's operands by name and its pallas_call.

A kernel's inputs and outputs are added by name with their BlockSpecs (``Operands``); the
kernel gets its refs back as a NamedTuple of those names (``named``), so no kernel depends
on the order in which a caller appended optional operands. ``call`` runs the pallas_call
and returns the outputs by name.
"""
from __future__ import annotations

import collections
from functools import partial
from typing import Callable, NamedTuple

import jax
from jax.experimental import pallas as pl

from jaxcp.vma import unify


class Operands:
    """The inputs (or outputs) of one pallas_call by name, in call order: their BlockSpecs
    and arrays (or ShapeDtypeStructs)."""

    def __init__(self):
        self.names: list[str] = []
        self.specs: list = []
        self.values: list = []

    def add(self, name: str, spec, value) -> None:
        if name in self.names:
            raise ValueError(f"operand {name!r} added twice")
        self.names.append(name)
        self.specs.append(spec)
        self.values.append(value)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def unified(self) -> tuple[list, object]:
        """The arrays cast to one vma type (``vma.unify``) and the manual axis type their
        outputs take."""
        return unify(self.values)


def refs_type(name: str, required: str, optional: str = "") -> type:
    """The NamedTuple type of a kernel's refs: the operands every call has (space-separated
    names), then those a call may leave out (None in the kernel when it does)."""
    optional_names = optional.split()
    return collections.namedtuple(name, required.split() + optional_names,
                                  defaults=(None,) * len(optional_names))


def named(structure: type, names: tuple[str, ...], refs) -> NamedTuple:
    """A kernel's refs as the NamedTuple `structure`, ref i under names[i]; fields that no
    operand has are left at their default (None)."""
    return structure(**dict(zip(names, refs)))


def call(kernel, grid, ins: Operands, outs: Callable, *, name: str, params: dict,
         aliases: dict[str, str] | None = None, **static):
    """pallas_call of kernel(*refs, names=..., **static) over ins and the outputs that
    outs(struct) adds (struct(shape, dtype) makes an output's ShapeDtypeStruct with the
    inputs' vma type); aliases maps an input name to the output name it is written as.
    Returns the outputs as a dict by name."""
    args, mat = ins.unified()
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), dtype,
                                                       manual_axis_type=mat)
    out = Operands()
    outs(out, struct)
    alias_idx = {ins.index(i): out.index(o) for i, o in (aliases or {}).items()}
    result = pl.pallas_call(
        partial(kernel, names=tuple(ins.names + out.names), **static), grid=grid,
        in_specs=ins.specs, out_specs=out.specs, out_shape=out.values,
        input_output_aliases=alias_idx, name=name, **params)(*args)
    return dict(zip(out.names, result)), args

