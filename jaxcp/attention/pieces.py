"""One piece of a softmax attention: its forward with the log-sum-exp, and its backward taken
with the statistics of the whole attention it is part of.

A piece attends queries q [B, T, N, D] to keys and values k, v [B, S, G, D] (N % G == 0,
query head n reads key head n // (N / G)) under one of two masks:

    causal:      key j visible to query i iff j <= i           (S == T)
    prefix(L):   key j visible to query i iff j < L            (L >= 1, a traced int32)

    s_ij = scale q_i . k_j,   lse_i = log sum_{visible j} e^(s_ij),   o_i = sum_j e^(s_ij - lse_i) v_j

``forward`` returns o [B, T, N, D] in q's dtype and lse [B, N, T] float32. ``backward`` takes
the o and lse of the whole attention (several pieces merged by their lse) and do; with
p_ij = e^(s_ij - lse_i) the piece's slice of the whole softmax and delta_i = do_i . o_i,

    dv_j = sum_i p_ij do_i,   ds_ij = p_ij (do_i . v_j - delta_i),
    dq_i = scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i,

which summed over the pieces are the whole attention's gradients. Keys a piece does not see
get zero dk, dv.

``DensePieces`` is the reference (jnp, [T, S] logits in memory: tests and small shapes);
``jaxcp.attention.cudnn`` runs the same contract on cuDNN's fused flash kernels.
"""
from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp


class AttentionPieces(Protocol):
    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, prefix: jax.Array | None,
                scale: float) -> tuple[jax.Array, jax.Array]:
        """(o, lse) of the causal piece (prefix None) or of the prefix(prefix) piece."""

    def backward(self, q: jax.Array, k: jax.Array, v: jax.Array, prefix: jax.Array | None,
                 scale: float, o: jax.Array, lse: jax.Array,
                 do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(dq, dk, dv) of the piece, given the whole attention's o, lse and do."""


def _visible(T: int, S: int, prefix: jax.Array | None) -> jax.Array:
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    return j <= i if prefix is None else jnp.broadcast_to(j < prefix, (T, S))


def _grouped(q: jax.Array, G: int) -> jax.Array:
    B, T, N, D = q.shape
    return q.reshape(B, T, G, N // G, D)


class DensePieces:
    """The pieces in jnp with the full [T, S] logits (float32 softmax)."""

    @staticmethod
    def _probs(q, k, prefix, scale, lse=None):
        G = k.shape[2]
        s = scale * jnp.einsum("btgrd,bsgd->bgrts", _grouped(q, G).astype(jnp.float32),
                               k.astype(jnp.float32))
        seen = _visible(q.shape[1], k.shape[1], prefix)
        s = jnp.where(seen, s, -jnp.inf)
        if lse is None:
            lse = jax.nn.logsumexp(s, axis=-1)
        else:
            B, N, T = lse.shape
            lse = lse.reshape(B, G, N // G, T)
        return jnp.where(seen, jnp.exp(s - lse[..., None]), 0.0), lse

    def forward(self, q, k, v, prefix, scale):
        p, lse = self._probs(q, k, prefix, scale)
        o = jnp.einsum("bgrts,bsgd->btgrd", p, v.astype(jnp.float32))
        B, T, N, D = q.shape
        return o.reshape(B, T, N, D).astype(q.dtype), lse.reshape(B, N, T)

    def backward(self, q, k, v, prefix, scale, o, lse, do):
        G = k.shape[2]
        f32 = lambda x: x.astype(jnp.float32)
        p, _ = self._probs(q, k, prefix, scale, lse)
        do_g = _grouped(f32(do), G)
        delta = jnp.einsum("btgrd,btgrd->bgrt", do_g, _grouped(f32(o), G))
        dv = jnp.einsum("bgrts,btgrd->bsgd", p, do_g)
        ds = p * (jnp.einsum("btgrd,bsgd->bgrts", do_g, f32(v)) - delta[..., None])
        dq = scale * jnp.einsum("bgrts,bsgd->btgrd", ds, f32(k)).reshape(q.shape)
        dk = scale * jnp.einsum("bgrts,btgrd->bsgd", ds, _grouped(f32(q), G))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
