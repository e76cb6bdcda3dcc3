"""Which implementation runs each stage of the chunked delta rule, per backend.

"xla": everything in jnp (``jaxcp.xla``). "pallas" / "interpret": Pallas kernels
(``jaxcp.pallas``), compiled for the GPU or run in interpret mode: the chunk state
recurrences (forward fused with the output, backward, CP summary) for both gates, and GDN's
intra-chunk terms and input cotangents; KDA's (per-channel gate) stay in jnp.

token_major (GDN, Pallas only): the token tensors q, k, v, g, beta, o, do and the input
cotangents are [B, T, HV, ...] as the caller has them, and the kernels read and write each
chunk in place, at the rows the ``ChunkLayout`` gives it (packed sequences included);
otherwise they are in chunk layout [NT, B, HV, C, ...] like the terms. ``intra`` and
``chunk_grads`` take the layout after ``scale``.
GDN's Pallas intra kernel returns row-factored terms (``ChunkTerms``), whose bare q, k are
the token tensors as given.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import jax.numpy as jnp

from jaxcp import xla


class Stages(NamedTuple):
    """The stage functions of one backend, with the signatures of ``jaxcp.xla``; and two for
    the backward's intra terms: ``keep(terms)``, what the forward keeps of its terms (from
    ``intra(..., with_inverse=True)``; None: nothing), and
    ``intra_again(q, k, v, g, beta, scale, layout, kept)``, the terms with the inverse
    again, from the kept ones (Pallas GDN: only w and u are recomputed) or from scratch."""
    intra: Callable
    keep: Callable
    intra_again: Callable
    state_output: Callable
    state_fwd: Callable
    state_last: Callable
    cp_summary: Callable
    state_bwd: Callable
    chunk_grads: Callable


@lru_cache(maxsize=None)
def stages_for(backend: str, dot_dtype: str = "float32", token_major: bool = False,
               normalize_qk: bool = False, chunk_size: int = 64) -> Stages:
    """dot_dtype: the operand dtype of the kernels' matrix products ("bfloat16" for bf16
    inputs, as FLA does; accumulation and the state stay float32). normalize_qk (GDN,
    Pallas only): ``intra`` and ``chunk_grads`` take raw q, k and L2-normalise them inside
    the kernels; the cotangents are those of the raw q, k."""
    if token_major and backend == "xla":
        raise ValueError("token_major: only the Pallas GDN stages read token-major tensors")
    if normalize_qk and backend == "xla":
        raise ValueError("normalize_qk: only the Pallas GDN stages normalise q, k themselves")
    if backend == "xla":
        # the jnp chunk_grads recomputes the terms in its vjp and never reads the inverse
        intra = lambda q, k, v, g, beta, scale, layout, with_inverse=False: xla.intra_chunk(
            q, k, v, g, beta, scale)
        chunk_grads = lambda q, k, v, g, beta, scale, layout, *rest: xla.chunk_grads(
            q, k, v, g, beta, scale, *rest)
        intra_again = lambda q, k, v, g, beta, scale, layout, kept: intra(
            q, k, v, g, beta, scale, layout)
        return Stages(intra, lambda terms: None, intra_again, xla.state_output, xla.state_fwd,
                      xla.state_last, xla.cp_summary, xla.state_bwd, chunk_grads)
    from jaxcp.pallas import grads as pallas_grads
    from jaxcp.pallas import intra as pallas_intra
    from jaxcp.pallas import state as pallas_state

    interpret = backend == "interpret"
    precise = dot_dtype == "float32"

    def per_channel_gate(g):
        """KDA (its intra terms and cotangents in jnp) or GDN (Pallas, token-major only)."""
        if g.shape[-1] == 1:
            if not token_major:
                raise ValueError("token_major: the Pallas GDN stages read token-major tensors")
            return False
        if token_major or normalize_qk:
            raise ValueError("token_major, normalize_qk: not for KDA's jnp stages")
        return True

    def intra(q, k, v, g, beta, scale, layout, with_inverse=False):
        if not per_channel_gate(g):
            return pallas_intra.intra_chunk(q, k, v, g, beta, scale, layout, chunk_size,
                                            with_inverse=with_inverse, interpret=interpret,
                                            precise=precise, out_dtype=jnp.dtype(dot_dtype),
                                            normalize_qk=normalize_qk)
        return xla.intra_chunk(q, k, v, g, beta, scale)

    def keep(terms):
        return None if terms.q_rows is None else pallas_intra.kept_for_w_u(terms)

    def intra_again(q, k, v, g, beta, scale, layout, kept):
        if kept is None:
            return intra(q, k, v, g, beta, scale, layout, with_inverse=True)
        return pallas_intra.recompute_w_u(q, k, v, g, beta, layout, chunk_size, kept,
                                          interpret=interpret, precise=precise,
                                          normalize_qk=normalize_qk)

    def chunk_grads(q, k, v, g, beta, scale, layout, *rest):
        if not per_channel_gate(g):
            return pallas_grads.chunk_grads(q, k, v, g, beta, scale, layout, chunk_size, *rest,
                                            interpret=interpret, precise=precise,
                                            normalize_qk=normalize_qk)
        return xla.chunk_grads(q, k, v, g, beta, scale, *rest)

    kw = dict(token_major=token_major, interpret=interpret, dot_dtype=jnp.dtype(dot_dtype))
    state_output, state_fwd, state_last, cp_summary, state_bwd = (partial(f, **kw) for f in (
        pallas_state.state_output, pallas_state.state_fwd, pallas_state.state_last,
        pallas_state.cp_summary, pallas_state.state_bwd))
    return Stages(intra, keep, intra_again, state_output, state_fwd, state_last, cp_summary,
                  state_bwd, chunk_grads)
