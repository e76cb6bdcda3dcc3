"""Token-by-token gated delta-rule recurrences in float32: the oracle every test ends at.

Per value head, the state S is [K, V]. For each token t of a sequence:

    S   <- S * exp(g_t)                      (GDN: a scalar; KDA: exp(g_t) scales row d of S)
    v'  =  (v_t - S^T k_t) * beta_t
    S   <- S + k_t v'^T
    o_t =  S^T (scale * q_t)

Shapes follow the public ops: q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV];
g [B, T, HV] (GDN) or [B, T, HV, K] (KDA); value head hv reads q/k head hv // (HV // H).
With ``cu_seqlens`` (B == 1) the state restarts at every sequence start, from that sequence's
``initial_state`` (or zero). States are [N, HV, K, V] float32, one per sequence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.l2norm import l2_normalize

_HIGHEST = lax.Precision.HIGHEST


def _recurrence(q, k, v, g, beta, starts, seq, ends, init, num_seqs):
    """Scan one token stream. q, k [T, HV, K]; v [T, HV, V]; g [T, HV, Kg]; beta [T, HV];
    starts/ends [T] bool, seq [T] int (sequence of each token); init [N, HV, K, V].
    Returns o [T, HV, V] and the state after each sequence's last token [N, HV, K, V]."""
    hv, kd = k.shape[1], k.shape[2]
    vd = v.shape[2]

    def step(carry, xs):
        state, finals = carry
        q_t, k_t, v_t, g_t, b_t, start, n, end = xs
        state = jnp.where(start, init[n], state)
        state = state * jnp.exp(g_t)[..., None]
        v_new = (v_t - jnp.einsum("hkv,hk->hv", state, k_t, precision=_HIGHEST)) * b_t[:, None]
        state = state + k_t[..., None] * v_new[:, None, :]
        o_t = jnp.einsum("hkv,hk->hv", state, q_t, precision=_HIGHEST)
        finals = finals.at[n].add(jnp.where(end, state, 0.0))   # each sequence ends once
        return (state, finals), o_t

    carry0 = (jnp.zeros((hv, kd, vd), jnp.float32), jnp.zeros((num_seqs, hv, kd, vd), jnp.float32))
    (_, finals), o = lax.scan(step, carry0, (q, k, v, g, beta, starts, seq, ends))
    return o, finals


def token_recurrence(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                     use_qk_l2norm_in_kernel):
    """Either gate (g [B, T, HV] or [B, T, HV, K]): the public references' arguments."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q, k, v, g, beta = map(f32, (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = K ** -0.5 if scale is None else scale
    group = HV // H
    q = jnp.repeat(q, group, axis=2) * scale
    k = jnp.repeat(k, group, axis=2)
    if g.ndim == 3:
        g = g[..., None]

    if cu_seqlens is None:
        N = B
        init = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else f32(initial_state)
        starts = jnp.arange(T) == 0
        ends = jnp.arange(T) == T - 1
        seq = jnp.zeros((T,), jnp.int32)

        def one(qb, kb, vb, gb, bb, ib):
            return _recurrence(qb, kb, vb, gb, bb, starts, seq, ends, ib[None], 1)

        o, finals = jax.vmap(one)(q, k, v, g, beta, init)
        finals = finals[:, 0]
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        N = cu.shape[0] - 1
        init = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else f32(initial_state)
        pos = jnp.arange(T)
        seq = jnp.searchsorted(cu[1:], pos, side="right").astype(jnp.int32)
        starts = pos == cu[seq]
        ends = pos == cu[seq + 1] - 1
        o, finals = _recurrence(q[0], k[0], v[0], g[0], beta[0], starts, seq, ends, init, N)
        o = o[None]
    return o, (finals if output_final_state else None)


def gated_delta_rule_reference(q, k, v, g, beta, *, scale: float | None = None,
                               initial_state: jax.Array | None = None,
                               output_final_state: bool = False,
                               cu_seqlens: jax.Array | None = None,
                               use_qk_l2norm_in_kernel: bool = False):
    """Token recurrence of Gated DeltaNet (scalar gate g [B, T, HV]). Returns (o [B, T, HV, V]
    float32, final_state [N, HV, K, V] float32 or None)."""
    return token_recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def kda_reference(q, k, v, g, beta, *, scale: float | None = None,
                  initial_state: jax.Array | None = None, output_final_state: bool = False,
                  cu_seqlens: jax.Array | None = None, use_qk_l2norm_in_kernel: bool = False):
    """Token recurrence of Kimi Delta Attention (per-channel gate g [B, T, HV, K]). Returns
    (o [B, T, HV, V] float32, final_state [N, HV, K, V] float32 or None)."""
    return token_recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
