"""Which implementation runs each stage of the chunked delta rule, per backend.

"xla": everything in jnp (``jaxcp.xla``). "pallas" / "interpret": Pallas kernels
(``jaxcp.pallas``), compiled for the GPU or run in interpret mode, for the chunk state
recurrences (forward, backward, CP summary) and GDN's forward intra-chunk terms; KDA's
intra-chunk terms, the output and the intra-chunk backward (a vjp of the jnp twin) stay in jnp.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import jax.numpy as jnp

from jaxcp import xla


class Stages(NamedTuple):
    """The stage functions of one backend, with the signatures of ``jaxcp.xla``."""
    intra: Callable
    state_fwd: Callable
    state_last: Callable
    cp_summary: Callable
    state_bwd: Callable


@lru_cache(maxsize=None)
def stages_for(backend: str, dot_dtype: str = "float32") -> Stages:
    """dot_dtype: the operand dtype of the kernels' matrix products ("bfloat16" for bf16
    inputs, as FLA does; accumulation and the state stay float32)."""
    if backend == "xla":
        return Stages(xla.intra_chunk, xla.state_fwd, xla.state_last, xla.cp_summary,
                      xla.state_bwd)
    from jaxcp.pallas import intra as pallas_intra
    from jaxcp.pallas import state as pallas_state

    interpret = backend == "interpret"

    def intra(q, k, v, g, beta, scale):
        if g.shape[-1] == 1:
            return pallas_intra.intra_chunk(q, k, v, g, beta, scale, interpret=interpret,
                                            precise=dot_dtype == "float32")
        return xla.intra_chunk(q, k, v, g, beta, scale)

    kw = dict(interpret=interpret, dot_dtype=jnp.dtype(dot_dtype))
    return Stages(intra, *(partial(f, **kw) for f in (
        pallas_state.state_fwd, pallas_state.state_last, pallas_state.cp_summary,
        pallas_state.state_bwd)))
