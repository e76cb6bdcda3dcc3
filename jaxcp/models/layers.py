"""Gated DeltaNet and Kimi Delta Attention layers (Flax NNX), parameterised like FLA's.

Both map x [B, T, hidden] -> [B, T, hidden]:
  q, k = L2norm(silu(conv(W_q x))), L2norm(silu(conv(W_k x)))    [B, T, H, K]
  v    = silu(conv(W_v x))                                        [B, T, HV, V]
  beta = sigmoid(W_b x) (x2 with allow_neg_eigval)                [B, T, HV]
  o    = delta rule (jaxcp ops) -> gated RMS norm -> W_o
GDN:  g = -exp(A_log) * softplus(W_a x + dt_bias)                 [B, T, HV]
      output gate: swish(W_g x)
KDA:  g = -exp(A_log) * softplus(W_f2 W_f1 x + dt_bias)           [B, T, HV, K]
      (safe_gate: g = lower_bound * sigmoid(exp(A_log) (W_f2 W_f1 x + dt_bias)))
      output gate: sigmoid(W_g2 W_g1 x + b_g2)
With cp_axis, inside a jax.shard_map with that axis manual x is this device's tokens of the
sequence in cp_layout ("contiguous" or "zigzag", ``jaxcp.cp.split``; the short convolutions
fetch their halo, the delta rule merges state maps across devices); outside one, under jax.set_mesh, the layer enters shard_map itself (models.enter).
cu_seqlens (global offsets, B == 1) packs sequences. With a cache (``models.cache``,
``init_cache``) a call continues the sequences the cache holds and returns the new cache:
a prompt runs through the chunk op, a few tokens through the recurrent op (decoding, one
device, no packing). Inside a shard_map where cp_axis is manual, a call with a cache is a
prefill of the sequence split over the axis (the CP op, from the cache's state and windows);
the cache it returns is the same on every device.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcp.cp.halo import sequence_tail
from jaxcp.cp.split import check_layout
from jaxcp.models.cache import DeltaRuleCache
from jaxcp.models.conv import ShortConvolution
from jaxcp.models.inputs import check_hidden_states
from jaxcp.models.enter import call_with_cp, split_over_axis
from jaxcp.models.norm import RMSNorm, RMSNormGated
from jaxcp.ops import chunk_gated_delta_rule, chunk_kda
from jaxcp.recurrent import recurrent_gated_delta_rule, recurrent_kda

# calls with a cache and fewer tokens than this take the recurrent op (the chunk op beyond)
RECURRENT_MAX_TOKENS = 64


def _dt_bias(key: jax.Array, size: int, dt_min: float = 1e-3, dt_max: float = 0.1,
             floor: float = 1e-4) -> jax.Array:
    """FLA's init: dt log-uniform in [dt_min, dt_max] (>= floor), stored as softplus^-1(dt)."""
    u = jax.random.uniform(key, (size,), jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
    return dt + jnp.log(-jnp.expm1(-dt))


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, rngs=rngs)


class _DeltaRuleLayer(nnx.Module):
    """What GDN and KDA share: q/k/v/b projections, short convs, the op call, the output."""

    def __init__(self, hidden_size, num_heads, head_dim, num_v_heads, expand_v, use_short_conv,
                 conv_size, allow_neg_eigval, norm_eps, cp_axis, backend, gate_activation,
                 cp_layout, segments, *, rngs):
        check_layout(cp_layout)
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads or num_heads
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_heads={num_heads}")
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        key_dim = num_heads * head_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.q_proj = _linear(hidden_size, key_dim, rngs)
        self.k_proj = _linear(hidden_size, key_dim, rngs)
        self.v_proj = _linear(hidden_size, value_dim, rngs)
        self.b_proj = _linear(hidden_size, self.num_v_heads, rngs)
        self.use_short_conv = use_short_conv
        if use_short_conv:
            conv = lambda n: ShortConvolution(n, conv_size, "silu", cp_axis, cp_layout,
                                              rngs=rngs)
            self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(key_dim), conv(key_dim), conv(value_dim)
        self.o_norm = (RMSNormGated(self.head_v_dim, norm_eps, gate_activation)
                       if gate_activation else RMSNorm(self.head_v_dim, norm_eps))
        self.o_proj = _linear(value_dim, hidden_size, rngs)
        self.allow_neg_eigval = allow_neg_eigval
        self.hidden_size = hidden_size
        self.cp_axis = cp_axis
        self.cp_layout = cp_layout
        self.backend = backend
        self.segments = segments

    def init_cache(self, batch_size: int, dtype=jnp.float32) -> DeltaRuleCache:
        """The empty cache of `batch_size` sequences (activations in `dtype`)."""
        convs = ((self.q_conv1d, self.k_conv1d, self.v_conv1d) if self.use_short_conv else ())
        return DeltaRuleCache(
            tuple(jnp.zeros((batch_size, c.conv_size - 1, c.hidden_size), dtype) for c in convs),
            jnp.zeros((batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim),
                      jnp.float32))

    def _call(self, x, cu_seqlens, cache, forward, name):
        check_hidden_states(x, self.hidden_size, name)
        if cache is None:
            return call_with_cp(self, self.cp_axis, x, cu_seqlens, forward)
        if cu_seqlens is not None:
            raise ValueError(f"{name}: a call with a cache continues one sequence per batch "
                             f"row: cu_seqlens must be None")
        if not isinstance(cache, DeltaRuleCache):
            raise TypeError(f"{name}: cache must be a DeltaRuleCache (init_cache), got "
                            f"{type(cache).__name__}")
        return forward(self, x, None, cache)

    def _qkv_beta(self, x, cu_seqlens, windows=None):
        """q, k, v, beta and, with the convolutions' windows (decoding), the new windows."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_windows = ()
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d) if self.use_short_conv else ()
        if convs and windows is not None and not split_over_axis(self.cp_axis):
            (q, wq), (k, wk), (v, wv) = (c.extend(y, w) for c, y, w in zip(convs, (q, k, v),
                                                                          windows))
            new_windows = (wq, wk, wv)
        elif convs:
            if windows is None:
                windows = (None,) * 3
            else:
                # a prefill split over the axis: the windows are the sequence's last inputs
                new_windows = tuple(sequence_tail(y, c.conv_size - 1, self.cp_axis, self.cp_layout)
                                    for c, y in zip(convs, (q, k, v)))
            q, k, v = (c(y, cu_seqlens, window=w) for c, y, w in zip(convs, (q, k, v), windows))
        else:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return (q.reshape(B, T, self.num_heads, self.head_k_dim),
                k.reshape(B, T, self.num_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim), beta.astype(x.dtype),
                new_windows)

    def _finish(self, ops, x, q, k, v, g, beta, gate, cu_seqlens, cache, windows,
                chunk_kw, gate_kw):
        """The delta rule (ops: the chunk and the recurrent op; chunk_kw: what only the chunk
        op takes), the output norm and projection; with a cache also the new cache."""
        B, T, _ = x.shape
        chunk, recurrent = ops
        args = (q, k, v, g, beta)
        # without a cache the layer runs inside shard_map whenever it has a cp_axis
        split = split_over_axis(self.cp_axis)
        if cache is not None and not split and T < RECURRENT_MAX_TOKENS:
            o, state = recurrent(*args, initial_state=cache.state,
                                 use_qk_l2norm_in_kernel=True, backend=self.backend, **gate_kw)
        else:
            o, state = chunk(*args, cu_seqlens=cu_seqlens,
                             initial_state=None if cache is None else cache.state,
                             output_final_state=cache is not None, use_qk_l2norm_in_kernel=True,
                             cp_axis=self.cp_axis if split else None, cp_layout=self.cp_layout,
                             backend=self.backend, segments=self.segments, **chunk_kw,
                             **gate_kw)
        if gate is None:
            o = self.o_norm(o)
        else:
            o = self.o_norm(o, gate.reshape(B, T, self.num_v_heads, self.head_v_dim))
        y = self.o_proj(o.reshape(B, T, -1).astype(x.dtype))
        return y if cache is None else (y, DeltaRuleCache(windows, state))


class GatedDeltaNet(_DeltaRuleLayer):
    """Gated DeltaNet layer (scalar decay per head and token); see the module docstring."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int,
                 num_v_heads: int | None = None, expand_v: float = 2.0, use_gate: bool = True,
                 use_short_conv: bool = True, conv_size: int = 4, allow_neg_eigval: bool = False,
                 norm_eps: float = 1e-5, cp_axis: str | None = None, backend: str | None = None,
                 cp_layout: str = "contiguous", segments: int | None = None, *,
                 rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads, head_dim, num_v_heads, expand_v, use_short_conv,
                         conv_size, allow_neg_eigval, norm_eps, cp_axis, backend,
                         "swish" if use_gate else None, cp_layout, segments, rngs=rngs)
        self.a_proj = _linear(hidden_size, self.num_v_heads, rngs)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.num_v_heads,),
                                                          jnp.float32, 1e-4, 16.0)))
        self.dt_bias = nnx.Param(_dt_bias(rngs.params(), self.num_v_heads))
        self.g_proj = _linear(hidden_size, self.num_v_heads * self.head_v_dim, rngs) if use_gate else None

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array | None = None, *,
                 cache: DeltaRuleCache | None = None):
        """x [B, T, hidden] -> [B, T, hidden]; with a cache, (that, the new cache)."""
        return self._call(x, cu_seqlens, cache, GatedDeltaNet._forward, "GatedDeltaNet")

    def _forward(self, x, cu_seqlens, cache=None):
        q, k, v, beta, windows = self._qkv_beta(x, cu_seqlens,
                                                None if cache is None else cache.conv)
        gate = None if self.g_proj is None else self.g_proj(x)
        # the decay is computed inside the op from a_proj(x), A_log and dt_bias
        return self._finish((chunk_gated_delta_rule, recurrent_gated_delta_rule), x, q, k, v,
                            self.a_proj(x), beta, gate, cu_seqlens, cache, windows, {},
                            dict(use_gate_in_kernel=True, A_log=self.A_log[...],
                                 dt_bias=self.dt_bias[...]))


class KimiDeltaAttention(_DeltaRuleLayer):
    """Kimi Delta Attention layer (per-channel decay through a low-rank projection)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int,
                 num_v_heads: int | None = None, expand_v: float = 1.0,
                 use_short_conv: bool = True, conv_size: int = 4, allow_neg_eigval: bool = False,
                 safe_gate: bool = False, lower_bound: float | None = None,
                 norm_eps: float = 1e-5, cp_axis: str | None = None, backend: str | None = None,
                 cp_layout: str = "contiguous", segments: int | None = None, *,
                 rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads, head_dim, num_v_heads, expand_v, use_short_conv,
                         conv_size, allow_neg_eigval, norm_eps, cp_axis, backend, "sigmoid",
                         cp_layout, segments, rngs=rngs)
        if safe_gate and (lower_bound is None or not -5.0 <= lower_bound < 0.0):
            raise ValueError(f"safe_gate needs lower_bound in [-5, 0), got {lower_bound!r}")
        HV, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
        self.f_proj1 = _linear(hidden_size, V, rngs)
        self.f_proj2 = _linear(V, HV * K, rngs)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (HV,), jnp.float32,
                                                          1.0, 16.0)))
        self.dt_bias = nnx.Param(_dt_bias(rngs.params(), HV * K))
        self.g_proj1 = _linear(hidden_size, V, rngs)
        self.g_proj2 = _linear(V, HV * V, rngs, bias=True)
        self.safe_gate = safe_gate
        self.lower_bound = lower_bound

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array | None = None, *,
                 cache: DeltaRuleCache | None = None):
        """x [B, T, hidden] -> [B, T, hidden]; with a cache, (that, the new cache)."""
        return self._call(x, cu_seqlens, cache, KimiDeltaAttention._forward,
                          "KimiDeltaAttention")

    def _forward(self, x, cu_seqlens, cache=None):
        B, T, _ = x.shape
        q, k, v, beta, windows = self._qkv_beta(x, cu_seqlens,
                                                None if cache is None else cache.conv)
        f = self.f_proj2(self.f_proj1(x)).reshape(B, T, self.num_v_heads, self.head_k_dim)
        gate = self.g_proj2(self.g_proj1(x))
        # the decay is computed inside the op from f, A_log and dt_bias
        return self._finish((chunk_kda, recurrent_kda), x, q, k, v, f, beta, gate, cu_seqlens,
                            cache, windows, dict(safe_gate=self.safe_gate),
                            dict(use_gate_in_kernel=True, A_log=self.A_log[...],
                                 dt_bias=self.dt_bias[...],
                                 lower_bound=self.lower_bound if self.safe_gate else None))
