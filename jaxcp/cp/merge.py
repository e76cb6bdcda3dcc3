"""Composing the pieces' affine state maps.

Piece j of the sequence (a device's tokens, one of its two zigzag pieces, or a segment of
either run as a batch row: ``cp.split``, ``segments``) maps the state entering its tokens to
the state leaving them: S_out_j = M_j S_in_j + E_j, with M [..., K, K] and E [..., K, V].
Since S_in_{j+1} = S_out_j, piece r's entry state is the prefix composition of the maps of
pieces 0..r-1 applied to zero (piece 0 always starts a sequence). The backward mirrors it:
the cotangent of piece r's exit state is dS_in_{r+1} = dE_{r+1} + M_{r+1}^T dS_out_{r+1}, a
suffix composition of the later pieces' (dE_j, M_j^T), where dE_j is the cotangent of piece
j's entry state from its own outputs. The arrays are [n_pieces, ...] in sequence order.

A piece in which a sequence starts has M = 0: nothing before it reaches its exit state, and
nothing after it reaches its entry's cotangent. The merges select there (``resets``) rather
than multiply by M, so that a NaN or Inf in one sequence never reaches another.
"""
import jax
import jax.numpy as jnp

from jaxcp.terms import einsum


def _per_row(resets: jax.Array, like: jax.Array) -> jax.Array:
    """resets [B] of one piece, broadcast against a [B, HV, ...] state."""
    return resets.reshape(resets.shape + (1,) * (like.ndim - resets.ndim)).astype(bool)


def merge_prefix(ext_all: jax.Array, m_all: jax.Array, resets_all: jax.Array) -> jax.Array:
    """ext_all [n, B, HV, K, V], m_all [n, B, HV, K, K], resets_all [n, B] (a sequence starts
    in the piece) -> [n, B, HV, K, V], the state entering each piece."""
    states = [jnp.zeros_like(ext_all[0])]
    for j in range(ext_all.shape[0] - 1):
        carried = einsum("...ij,...jv->...iv", m_all[j], states[-1]) + ext_all[j]
        states.append(jnp.where(_per_row(resets_all[j], carried), ext_all[j], carried))
    return jnp.stack(states)


def merge_suffix(d_ext_all: jax.Array, m_all: jax.Array, resets_all: jax.Array) -> jax.Array:
    """d_ext_all [n, B, HV, K, V], m_all [n, B, HV, K, K], resets_all [n, B] -> [n, B, HV, K,
    V], the cotangent of each piece's exit state from the pieces after it."""
    d = [jnp.zeros_like(d_ext_all[0])]
    for j in reversed(range(1, d_ext_all.shape[0])):
        carried = einsum("...ji,...jv->...iv", m_all[j], d[0]) + d_ext_all[j]
        d.insert(0, jnp.where(_per_row(resets_all[j], carried), d_ext_all[j], carried))
    return jnp.stack(d)
