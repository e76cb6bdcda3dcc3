"""Causal softmax self-attention with RoPE and GQA, context-parallel by K/V all-gather or ring."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxcp.attention import select
from jaxcp.attention.blockwise import blockwise_attention
from jaxcp.attention.prefix import gathered_causal_attention
from jaxcp.attention.ring import ring_causal_attention
from jaxcp.attention.rope import rope
from jaxcp.cp.split import axis_positions, check_layout, gather_in_order, whole_sequence
from jaxcp.layout import sequence_of
from jaxcp.models.cache import KVCache
from jaxcp.models.enter import call_with_cp, split_over_axis
from jaxcp.models.inputs import check_hidden_states

CP_KV = ("allgather", "ring")


class CausalSelfAttention(nnx.Module):
    """softmax(q k^T / sqrt(D) + causal/segment mask) v, q/k rotated by RoPE at each token's
    position inside its own sequence; num_kv_heads < num_heads shares K/V heads (GQA).
    The softmax runs blockwise (``jaxcp.attention.blockwise``, query chunks and key blocks of
    block_size tokens), so memory grows linearly in T; one unpacked sequence on a GPU (bf16 /
    fp16) takes cuDNN's fused kernels instead (``jaxcp.attention.select``).

    With cp_axis (inside shard_map, x is this device's tokens of the sequence in cp_layout,
    ``cp.split``; outside one, the layer enters shard_map over the current mesh) K and V are
    all-gathered over the axis and the mask uses global positions, so each device attends from its queries to every earlier key of
    the same sequence: for one unpacked sequence on a GPU as cuDNN pieces merged by their
    log-sum-exp (``jaxcp.attention.prefix``), else blockwise. cu_seqlens: global offsets (B == 1).
    cp_kv: how that one unpacked sequence's keys and values reach the other devices:
    "allgather" (all at once) or "ring" (one device's block at a time, memory O(T_local):
    ``jaxcp.attention.ring``); packed sequences always take the all-gather.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope_theta: float = 10000.0,
                 cp_axis: str | None = None, block_size: int = 1024,
                 cp_layout: str = "contiguous", cp_kv: str = "allgather", *, rngs: nnx.Rngs):
        check_layout(cp_layout)
        if cp_kv not in CP_KV:
            raise ValueError(f"cp_kv must be one of {CP_KV}, got {cp_kv!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.head_dim = head_dim or hidden_size // num_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        lin = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)
        self.q_proj = lin(hidden_size, num_heads * self.head_dim)
        self.k_proj = lin(hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = lin(hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = lin(num_heads * self.head_dim, hidden_size)
        self.rope_theta = rope_theta
        self.hidden_size = hidden_size
        self.cp_axis = cp_axis
        self.cp_layout = cp_layout
        self.block_size = block_size
        self.cp_kv = cp_kv

    def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """The empty cache of `batch_size` sequences of up to `max_len` tokens."""
        shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.int32(0))

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array | None = None, *,
                 cache: KVCache | None = None):
        """x [B, T, hidden] -> [B, T, hidden]; with a cache (``init_cache``) x continues the
        sequences it holds (on one device, or split over cp_axis inside shard_map: a
        prefill), and the call returns (that, the new cache). The cache must have room:
        tokens past its max_len are not kept."""
        check_hidden_states(x, self.hidden_size, "CausalSelfAttention")
        if cache is None:
            return call_with_cp(self, self.cp_axis, x, cu_seqlens, CausalSelfAttention._forward)
        if cu_seqlens is not None:
            raise ValueError("CausalSelfAttention: a call with a cache continues one sequence "
                             "per batch row: cu_seqlens must be None")
        if not isinstance(cache, KVCache):
            raise TypeError(f"CausalSelfAttention: cache must be a KVCache (init_cache), got "
                            f"{type(cache).__name__}")
        if split_over_axis(self.cp_axis):
            # an empty cache takes the layer's CP attention (cuDNN pieces where they run)
            return lax.cond(cache.length == 0, lambda: self._forward(x, None, cache),
                            lambda: self._forward_cached(x, cache))
        return self._forward_cached(x, cache)

    def _rotated_qkv(self, x, positions):
        """q [B, T, N, D], k, v [B, T, G, D] of x, q and k rotated at `positions` [T]."""
        B, T, _ = x.shape
        heads = lambda y, n: y.reshape(B, T, n, self.head_dim)
        return (rope(heads(self.q_proj(x), self.num_heads), positions, self.rope_theta),
                rope(heads(self.k_proj(x), self.num_kv_heads), positions, self.rope_theta),
                heads(self.v_proj(x), self.num_kv_heads))

    def _forward_cached(self, x, cache):
        """x continues the cache's sequences, on one device or, inside shard_map, split over
        cp_axis (a prefill: each device's queries attend to the cached keys and the whole
        prompt's, which the new cache holds on every device)."""
        B, T, _ = x.shape
        split = split_over_axis(self.cp_axis)
        pos = cache.length + axis_positions(self.cp_layout, self.cp_axis if split else None, T)
        q, k, v = self._rotated_qkv(x, pos)
        if split:
            k, v = (whole_sequence(a, self.cp_layout, self.cp_axis) for a in (k, v))
        at = (0, cache.length, 0, 0)
        k_all = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), at)
        v_all = lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), at)
        # keys past the new tokens sit at later positions: the causal mask hides them
        k_pos = jnp.arange(k_all.shape[1], dtype=jnp.int32)
        o = blockwise_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), pos,
                                jnp.zeros_like(pos), k_pos, jnp.zeros_like(k_pos),
                                block_q=self.block_size, block_k=self.block_size)
        return self.o_proj(o.reshape(B, T, -1)), KVCache(k_all, v_all, cache.length + k.shape[1])

    def _forward(self, x, cu_seqlens, cache=None):
        """The layer over x; with an empty cache (inside shard_map: a prefill of the sequence
        split over cp_axis), also the cache holding the whole sequence's K, V."""
        B, T, _ = x.shape
        pos = axis_positions(self.cp_layout, self.cp_axis, T)
        seq = jnp.zeros_like(pos) if cu_seqlens is None else sequence_of(cu_seqlens, pos)
        offset = 0 if cu_seqlens is None else cu_seqlens[seq]
        q, k, v = self._rotated_qkv(x, pos - offset)
        fused = select.fused_attention_impl(q) if cu_seqlens is None else None
        pieces = None if fused is None or self.cp_axis is None else select.cp_pieces(fused)
        if fused is not None and self.cp_axis is None:
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=fused)
        elif pieces is not None:
            attend = ring_causal_attention if self.cp_kv == "ring" else gathered_causal_attention
            o = attend(q, k, v, self.cp_axis, pieces, cp_layout=self.cp_layout)
        else:
            k_all, v_all, k_pos, k_seq = k, v, pos, seq
            if self.cp_axis is not None:
                # the whole sequence in order: each query block's visible keys are one run
                in_order = lambda a: jnp.concatenate(
                    gather_in_order(a, self.cp_layout, self.cp_axis), axis=1)
                k_all, v_all = in_order(k), in_order(v)
                k_pos = jnp.arange(k_all.shape[1], dtype=jnp.int32)
                k_seq = (jnp.zeros_like(k_pos) if cu_seqlens is None
                         else sequence_of(cu_seqlens, k_pos))
            o = blockwise_attention(q, k_all, v_all, pos, seq, k_pos, k_seq,
                                    block_q=self.block_size, block_k=self.block_size)
        y = self.o_proj(o.reshape(B, T, -1))
        if cache is None:
            return y
        put = lambda c, a: lax.dynamic_update_slice(
            c, whole_sequence(a, self.cp_layout, self.cp_axis).astype(c.dtype), (0, 0, 0, 0))
        length = jnp.int32(T * lax.axis_size(self.cp_axis))
        return y, KVCache(put(cache.k, k), put(cache.v, v), length)
