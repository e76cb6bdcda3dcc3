"""The chunk output in jnp, alone and fused with the forward state recurrence.

o_c = qg_c S_c + attn_c v_new_c, with qg [..., C, K], S [..., K, V], attn [..., C, C],
v_new [..., C, V] -> o [..., C, V]: the inter-chunk part through the state entering the
chunk, the intra-chunk part through the gated causal attention of the chunk.
"""
from __future__ import annotations

import jax

from jaxcp.layout import ChunkLayout
from jaxcp.terms import ChunkTerms, einsum
from jaxcp.xla.state import final_states, state_fwd


def chunk_output(qg: jax.Array, attn: jax.Array, h: jax.Array, v_new: jax.Array) -> jax.Array:
    """o = qg h + attn v_new, per chunk."""
    return einsum("...ck,...kv->...cv", qg, h) + einsum("...ij,...jv->...iv", attn, v_new)


def state_output(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                 h0: jax.Array, with_finals: bool):
    """The forward pass after the intra-chunk terms: run the chunks from h0 [B, HV, K, V]
    and return (o [NT, B, HV, C, V], final states [N, HV, K, V] or None)."""
    h, v_new, _ = state_fwd(terms, layout, init, h0)
    o = chunk_output(terms.qg, terms.attn, h, v_new)
    return o, (final_states(terms, layout, h, v_new) if with_finals else None)
