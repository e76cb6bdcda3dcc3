"""Which implementation runs each stage of the chunked delta rule, per backend.

"xla": everything in jnp (``jaxcp.xla``). "pallas" / "interpret": the chunk state recurrences
(forward, backward, CP summary) are Pallas kernels (``jaxcp.pallas``), compiled for the GPU or
run in interpret mode; the intra-chunk terms and the output stay in jnp.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import jax.numpy as jnp

from jaxcp import xla


class Stages(NamedTuple):
    """The stage functions of one backend, with the signatures of ``jaxcp.xla.state``."""
    state_fwd: Callable
    state_last: Callable
    cp_summary: Callable
    state_bwd: Callable


@lru_cache(maxsize=None)
def stages_for(backend: str, dot_dtype: str = "float32") -> Stages:
    """dot_dtype: the operand dtype of the kernels' matrix products ("bfloat16" for bf16
    inputs, as FLA does; accumulation and the state stay float32)."""
    if backend == "xla":
        return Stages(xla.state_fwd, xla.state_last, xla.cp_summary, xla.state_bwd)
    from jaxcp.pallas import state as pallas_state

    kw = dict(interpret=backend == "interpret", dot_dtype=jnp.dtype(dot_dtype))
    return Stages(*(partial(f, **kw) for f in (
        pallas_state.state_fwd, pallas_state.state_last, pallas_state.cp_summary,
        pallas_state.state_bwd)))
