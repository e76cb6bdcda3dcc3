"""Cotangents of the chunk inputs from the results of the reverse state recurrence, in jnp.

Per chunk, with h the state entering it [K, V], v_new [C, V], X = dL/dS_out [K, V],
dvn = dL/dv_new [C, V] and do [C, V], the cotangents of the ChunkTerms are

    dw = -dvn h^T,  du = dvn,  dqg = do h^T,  dkd = v_new X^T,  dattn = do v_new^T,
    ddecay = sum over V of (h o X)        (summed over K too for a scalar gate)

and the intra-chunk stage's vjp turns them into (dq, dk, dv, dg, dbeta). The vjp recomputes
the chunk terms, so the ``terms`` argument (read by the Pallas twin) is not used here.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxcp.gate import Gate
from jaxcp.terms import ChunkTerms, einsum
from jaxcp.xla.intra import intra_chunk


def chunk_grads(q, k, v, g, beta, scale: float, terms: ChunkTerms | None, h, v_new, x, dvn,
                do, *, gate: Gate):
    """(dq, dk, dv, dg, dbeta), shapes of q, k, v, g, beta, in q's dtype (float32; float64
    for the tests' references). h, v_new, x, dvn and do may come in a lower precision (the
    Pallas recurrences store them in the dot dtype) and are brought to q's."""
    h, v_new, x, dvn, do = (a.astype(q.dtype) for a in (h, v_new, x, dvn, do))
    d_decay = jnp.sum(h * x, axis=-1)
    if gate is Gate.SCALAR:
        d_decay = jnp.sum(d_decay, axis=-1, keepdims=True)
    d_terms = ChunkTerms(
        w=-einsum("...cv,...kv->...ck", dvn, h),
        u=dvn,
        qg=einsum("...cv,...kv->...ck", do, h),
        kd=einsum("...cv,...kv->...ck", v_new, x),
        decay=d_decay,
        attn=einsum("...iv,...jv->...ij", do, v_new),
    )
    return jax.vjp(partial(intra_chunk, scale=scale, gate=gate), q, k, v, g, beta)[1](d_terms)
