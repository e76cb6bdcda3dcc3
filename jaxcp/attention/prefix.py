"""Causal attention of one device's queries over its own keys and all earlier devices' keys,
as flash-attention pieces merged by their log-sum-exp (one unpacked sequence under CP).

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

from functools import partial, reduce

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.attention.pieces import AttentionPieces
from jaxcp.cp.split import gather_in_order
from jaxcp.vma import match_cotangent


def _merge(parts):
    """parts: (o [B, T, N, D], lse [B, N, T], present) of each piece -> the whole attention's
    o and lse; a piece that is not present (a traced bool) weighs nothing."""
    lses = [jnp.where(present, lse, -jnp.inf) for _, lse, present in parts]
    lse = reduce(jnp.logaddexp, lses)                             # [B, N, T]
    weight = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]       # [B, T, N, 1]
    o = sum(jnp.where(present, weight(l) * o_p.astype(jnp.float32), 0.0)
            for (o_p, _, present), l in zip(parts, lses))
    return o.astype(parts[0][0].dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _prefix_causal(pieces: AttentionPieces, q, k, v, prefixes, scale):
    return _prefix_causal_fwd(pieces, q, k, v, prefixes, scale)[0]


def _prefix_causal_fwd(pieces, q, k, v, prefixes, scale):
    # a prefix of no keys runs over one key and is weighted out
    parts = [(*pieces.forward(q, k, v, None, scale), True)]
    for k_all, v_all, length in prefixes:
        parts.append((*pieces.forward(q, k_all, v_all, jnp.maximum(length, 1), scale),
                      length > 0))
    o, lse = _merge(parts)
    return o, (q, k, v, prefixes, o, lse)


def _prefix_causal_bwd(pieces, scale, res, do):
    q, k, v, prefixes, o, lse = res
    dq, dk, dv = pieces.backward(q, k, v, None, scale, o, lse, do)
    dq = dq.astype(jnp.float32)
    d_prefixes = []
    for k_all, v_all, length in prefixes:
        # one flash backward after the other: each waits for the dq of the one before, so
        # that their workspaces (a float32 dq accumulator each) are never alive together
        dq, k_all, v_all = lax.optimization_barrier((dq, k_all, v_all))
        dq_b, dk_all, dv_all = pieces.backward(q, k_all, v_all, jnp.maximum(length, 1), scale,
                                               o, lse, do)
        present = length > 0
        dq = dq + jnp.where(present, dq_b.astype(jnp.float32), 0.0)
        dk_all, dv_all = (jnp.where(present, x, jnp.zeros((), x.dtype)) for x in (dk_all, dv_all))
        d_prefixes.append((match_cotangent(dk_all, k_all), match_cotangent(dv_all, v_all), None))
    grads = (dq.astype(q.dtype), dk, dv)
    return (*(match_cotangent(g, p) for g, p in zip(grads, (q, k, v))), tuple(d_prefixes))


_prefix_causal.defvjp(_prefix_causal_fwd, _prefix_causal_bwd)


def prefix_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_all: jax.Array,
                            v_all: jax.Array, prefix: jax.Array, pieces: AttentionPieces,
                            scale: float | None = None) -> jax.Array:
    """Queries q [B, T, N, D] at positions prefix + [0, T) attend causally to their own keys
    k, v [B, T, G, D] and to keys [0, prefix) of k_all, v_all [B, S, G, D] (int32 prefix,
    0 <= prefix <= S - T; k_all[:, prefix:prefix + T] is k). Returns [B, T, N, D] in q's
    dtype; scale defaults to D^-1/2."""
    return multi_prefix_causal_attention(q, k, v, ((k_all, v_all, prefix),), pieces, scale)


def multi_prefix_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, prefixes,
                                  pieces: AttentionPieces,
                                  scale: float | None = None) -> jax.Array:
    """Queries q [B, T, N, D] attend causally to their own keys k, v [B, T, G, D] and to keys
    [0, length) of each (k_all, v_all, length) of prefixes (k_all, v_all [B, S, G, D], int32
    length, 0 <= length <= S; the prefixes' keys all come before the queries' own). Returns
    [B, T, N, D] in q's dtype; scale defaults to D^-1/2."""
    if q.ndim != 4 or k.shape != v.shape or any(ka.shape != va.shape for ka, va, _ in prefixes):
        raise ValueError(f"q must be [B, T, N, D], k == v and each k_all == v_all in shape; "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}, prefixes "
                         f"{[(ka.shape, va.shape) for ka, va, _ in prefixes]}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    prefixes = tuple((ka, va, jnp.asarray(n, jnp.int32)) for ka, va, n in prefixes)
    return _prefix_causal(pieces, q, k, v, prefixes, scale)


def gathered_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str,
                              pieces: AttentionPieces, scale: float | None = None,
                              cp_layout: str = "contiguous") -> jax.Array:
    """Inside shard_map with the sequence split over `axis` in cp_layout (``cp.split``; this
    device's q [B, T, N, D], k, v [B, T, G, D] of one unpacked sequence): all-gather k and v
    over the axis and attend causally to every earlier token of the sequence."""
    T = q.shape[1]
    rank = lax.axis_index(axis)
    k_runs, v_runs = gather_in_order(k, cp_layout, axis), gather_in_order(v, cp_layout, axis)
    if cp_layout == "contiguous":
        return prefix_causal_attention(q, k, v, k_runs[0], v_runs[0], rank * T, pieces, scale)
    # zigzag: the early piece r sees early pieces 0..r - 1; the late piece 2W - 1 - r sees
    # every early piece and the late pieces W..2W - 2 - r
    W, P = lax.axis_size(axis), T // 2
    (early_k, late_k), (early_v, late_v) = k_runs, v_runs
    o_early = multi_prefix_causal_attention(
        q[:, :P], k[:, :P], v[:, :P], ((early_k, early_v, rank * P),), pieces, scale)
    o_late = multi_prefix_causal_attention(
        q[:, P:], k[:, P:], v[:, P:],
        ((early_k, early_v, W * P), (late_k, late_v, (W - 1 - rank) * P)), pieces, scale)
    return jnp.concatenate([o_early, o_late], axis=1)
