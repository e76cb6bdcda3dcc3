"""Causal attention of one device's queries over its own keys and all earlier devices' keys,
as two flash-attention pieces merged by their log-sum-exp (one unpacked sequence under CP).

Device r holds tokens [r T, (r + 1) T). Its queries see

    A: its own keys, causally                      (the causal piece, S = T)
    B: the keys of devices 0 .. r - 1, all of them (the prefix piece over the all-gathered
       keys [0, W T), visible while j < r T; none on device 0)

    lse = logaddexp(lse_A, lse_B),   o = e^(lse_A - lse) o_A + e^(lse_B - lse) o_B

The backward runs each piece's flash backward with the merged o and lse (``jaxcp.attention.pieces``)
and adds the pieces' dq; the all-gather's transpose returns the prefix piece's dk, dv to the
devices that own those keys. Device r does T^2 / 2 + r T^2 of the W^2 T^2 / 2 query-key
products of the whole sequence (the last device most), with no [T, W T] array.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.attention.pieces import AttentionPieces
from jaxcp.vma import match_cotangent


def _merge(o_a, lse_a, o_b, lse_b, has_prefix):
    lse_b = jnp.where(has_prefix, lse_b, -jnp.inf)
    lse = jnp.logaddexp(lse_a, lse_b)                                   # [B, N, T]
    weight = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]   # [B, T, N, 1]
    o_b = jnp.where(has_prefix, weight(lse_b) * o_b.astype(jnp.float32), 0.0)
    return (weight(lse_a) * o_a.astype(jnp.float32) + o_b).astype(o_a.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(0, 7))
def _prefix_causal(pieces: AttentionPieces, q, k, v, k_all, v_all, prefix, scale):
    return _prefix_causal_fwd(pieces, q, k, v, k_all, v_all, prefix, scale)[0]


def _prefix_causal_fwd(pieces, q, k, v, k_all, v_all, prefix, scale):
    # device 0 has no prefix: its prefix piece runs over one key and is weighted out
    prefix_keys = jnp.maximum(prefix, 1)
    o_a, lse_a = pieces.forward(q, k, v, None, scale)
    o_b, lse_b = pieces.forward(q, k_all, v_all, prefix_keys, scale)
    o, lse = _merge(o_a, lse_a, o_b, lse_b, prefix > 0)
    return o, (q, k, v, k_all, v_all, prefix, o, lse)


def _prefix_causal_bwd(pieces, scale, res, do):
    q, k, v, k_all, v_all, prefix, o, lse = res
    dq_a, dk, dv = pieces.backward(q, k, v, None, scale, o, lse, do)
    dq_b, dk_all, dv_all = pieces.backward(q, k_all, v_all, jnp.maximum(prefix, 1), scale, o,
                                           lse, do)
    has_prefix = prefix > 0
    dq = dq_a.astype(jnp.float32) + jnp.where(has_prefix, dq_b.astype(jnp.float32), 0.0)
    dk_all, dv_all = (jnp.where(has_prefix, x, jnp.zeros((), x.dtype)) for x in (dk_all, dv_all))
    grads = (dq.astype(q.dtype), dk, dv, dk_all, dv_all)
    return (*(match_cotangent(g, p) for g, p in zip(grads, (q, k, v, k_all, v_all))), None)


_prefix_causal.defvjp(_prefix_causal_fwd, _prefix_causal_bwd)


def prefix_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_all: jax.Array,
                            v_all: jax.Array, prefix: jax.Array, pieces: AttentionPieces,
                            scale: float | None = None) -> jax.Array:
    """Queries q [B, T, N, D] at positions prefix + [0, T) attend causally to their own keys
    k, v [B, T, G, D] and to keys [0, prefix) of k_all, v_all [B, S, G, D] (int32 prefix,
    0 <= prefix <= S - T; k_all[:, prefix:prefix + T] is k). Returns [B, T, N, D] in q's
    dtype; scale defaults to D^-1/2."""
    if q.ndim != 4 or k.shape != v.shape or k_all.shape != v_all.shape:
        raise ValueError(f"q must be [B, T, N, D], k == v and k_all == v_all in shape; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}, k_all {k_all.shape}, "
                         f"v_all {v_all.shape}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _prefix_causal(pieces, q, k, v, k_all, v_all, jnp.asarray(prefix, jnp.int32), scale)


def gathered_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str,
                              pieces: AttentionPieces, scale: float | None = None) -> jax.Array:
    """Inside shard_map with the sequence split over `axis` (this device's slices q
    [B, T, N, D], k, v [B, T, G, D] of one unpacked sequence): all-gather k and v over the
    axis and attend causally to every earlier token of the sequence."""
    gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)
    prefix = lax.axis_index(axis) * q.shape[1]
    return prefix_causal_attention(q, k, v, gather(k), gather(v), prefix, pieces, scale)
