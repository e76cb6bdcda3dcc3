"""The chunk output in jnp, and the cotangents it sends back.

o_c = qg_c S_c + attn_c v_new_c, with qg [..., C, K], S [..., K, V], attn [..., C, C],
v_new [..., C, V] -> o [..., C, V]: the inter-chunk part through the state entering the
chunk, the intra-chunk part through the gated causal attention of the chunk.
"""
import jax

from jaxcp.xla.intra import einsum


def chunk_output(qg: jax.Array, attn: jax.Array, h: jax.Array, v_new: jax.Array) -> jax.Array:
    """o = qg h + attn v_new, per chunk."""
    return einsum("...ck,...kv->...cv", qg, h) + einsum("...ij,...jv->...iv", attn, v_new)


def chunk_output_bwd(do: jax.Array, h: jax.Array, v_new: jax.Array):
    """Cotangents of qg and attn: (do h^T [..., C, K], do v_new^T [..., C, C]). The ones of h
    and v_new enter the reverse state recurrence (state.state_bwd)."""
    return einsum("...cv,...kv->...ck", do, h), einsum("...iv,...jv->...ij", do, v_new)
