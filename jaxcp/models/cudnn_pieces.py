"""The attention pieces of ``attention_pieces`` on cuDNN's fused flash-attention kernels.

The backward of a piece must use the merged o and lse of the whole attention, not its own:
``jax.nn.dot_product_attention`` saves its own and gives its log-sum-exp no gradient. So this
module calls the forward and backward rules behind it (``jax._src.cudnn``, checked on jax
0.11.2) and hands the backward the merged statistics. ``available()`` says whether those rules
are there with the expected signatures; without them the layers keep the blockwise softmax.

Shapes and masks as in ``attention_pieces``: q [B, T, N, D], k, v [B, S, G, D] bf16 or fp16,
D <= 128 and a multiple of 8; the causal piece is cuDNN's CAUSAL mask (S == T), the prefix
piece its PADDING mask with kv_seqlen = prefix (every query row valid).
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

try:
    from jax._src.cudnn import fused_attention_stablehlo as _fa
except ImportError:     # a jax without the module: available() is False
    _fa = None

_FWD_ARGS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets",
             "kv_offsets", "page_table_k", "page_table_v", "scale", "seed", "dropout_rate",
             "variadic_args", "mask_type", "layout", "sliding_window_length", "cudnn_version",
             "return_residual")
_BWD_ARGS = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
             "sliding_window_length", "is_training", "return_residual", "res", "grad_output")


def available() -> bool:
    """True when jax has the cuDNN attention rules this module calls, as it expects them."""
    if _fa is None:
        return False
    try:
        fwd = tuple(inspect.signature(_fa._dot_product_attention_fwd_rule).parameters)
        bwd = tuple(inspect.signature(_fa._dot_product_attention_bwd_rule).parameters)
        helpers = all(hasattr(_fa, name) for name in
                      ("MaskType", "_normalize_layout", "check_cudnn_version"))
        return fwd == _FWD_ARGS and bwd == _BWD_ARGS and helpers
    except (AttributeError, TypeError, ValueError):
        return False


def _operands(q, prefix):
    """bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page tables; the mask type."""
    unused = jnp.zeros(0, q.dtype)
    if prefix is None:
        return (unused,) * 7, _fa.MaskType.CAUSAL
    B, T = q.shape[:2]
    q_len = jnp.full((B,), T, jnp.int32)
    kv_len = jnp.broadcast_to(jnp.asarray(prefix, jnp.int32), (B,))
    return (unused, q_len, kv_len, unused, unused, unused, unused), _fa.MaskType.PADDING


def _static(scale, mask_type):
    """scale, seed, dropout_rate, variadic_args (no bias), mask type, layout, window."""
    return (scale, 42, 0.0, (False, False), mask_type, _fa._normalize_layout("BTNH").value,
            None)


def _hide_unseen_keys(x, prefix):
    if prefix is None:
        return x
    seen = jnp.arange(x.shape[1])[None, :, None, None] < prefix
    return jnp.where(seen, x, jnp.zeros((), x.dtype))


class CudnnPieces:
    """``AttentionPieces`` on cuDNN (NVIDIA GPUs of compute capability >= 8.0)."""

    def forward(self, q, k, v, prefix, scale):
        operands, mask_type = _operands(q, prefix)
        (o, lse), _ = _fa._dot_product_attention_fwd_rule(
            q, k, v, *operands, *_static(scale, mask_type), _fa.check_cudnn_version(), True)
        return o, lse

    def backward(self, q, k, v, prefix, scale, o, lse, do):
        operands, mask_type = _operands(q, prefix)
        res = (q, k, v, *operands, lse, o.astype(q.dtype))
        # the rule's is_training slot receives the custom_vjp's next static argument, the
        # cuDNN version
        dq, dk, dv = _fa._dot_product_attention_bwd_rule(
            *_static(scale, mask_type), _fa.check_cudnn_version(), False, res,
            do.astype(q.dtype))[:3]
        return dq, _hide_unseen_keys(dk, prefix), _hide_unseen_keys(dv, prefix)
