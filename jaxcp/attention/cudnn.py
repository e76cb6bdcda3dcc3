"""The attention pieces of ``jaxcp.attention.pieces`` on cuDNN's fused flash-attention kernels.

The backward of a piece must use the merged o and lse of the whole attention, not its own:
``jax.nn.dot_product_attention`` (``return_residual=True``) gives a piece's o and lse, but its
backward recomputes from the piece's own statistics and gives the lse no gradient. So this
module calls the forward and backward rules behind it (``jax._src.cudnn``) and hands the
backward the merged statistics. Two forms of those rules are known:

    jax 0.11:  fwd(q, k, v, bias, ..., page_table_v, scale, ..., window, cudnn_version,
                   return_residual);  bwd(scale, ..., window, is_training, return_residual,
                   res, grad_output)
    jax 0.12:  fwd adds the operand score_mod_args after page_table_v and the static
               score_mod after window; bwd adds score_mod after window and names the next
               slot cudnn_version

``rules()`` says which form this jax has (None: neither, and the layers keep the blockwise
softmax). With no score modifier the 0.12 form takes score_mod_args = () and score_mod = None.

Shapes and masks as in ``jaxcp.attention.pieces``: q [B, T, N, D], k, v [B, S, G, D] bf16 or
fp16, D <= 128 and a multiple of 8; the causal piece is cuDNN's CAUSAL mask (S == T), the
prefix piece its PADDING mask with kv_seqlen = prefix (every query row valid).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import jax.numpy as jnp

try:
    from jax._src.cudnn import fused_attention_stablehlo as _fa
except ImportError:     # a jax without the module: rules() is None
    _fa = None

_OPERANDS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets",
             "kv_offsets", "page_table_k", "page_table_v")
_STATIC = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
           "sliding_window_length")
_HELPERS = ("MaskType", "_normalize_layout", "check_cudnn_version")


@dataclass(frozen=True)
class RuleForm:
    """One known signature of the cuDNN attention rules. score_mod: the 0.12 form, with the
    score_mod_args operand and the score_mod static argument."""
    name: str
    score_mod: bool

    def fwd_args(self) -> tuple[str, ...]:
        if self.score_mod:
            return (_OPERANDS + ("score_mod_args",) + _STATIC
                    + ("score_mod", "cudnn_version", "return_residual"))
        return _OPERANDS + _STATIC + ("cudnn_version", "return_residual")

    def bwd_args(self) -> tuple[str, ...]:
        if self.score_mod:
            return _STATIC + ("score_mod", "cudnn_version", "return_residual", "res",
                              "grad_output")
        return _STATIC + ("is_training", "return_residual", "res", "grad_output")

    def extra_operands(self) -> tuple:
        """What follows the page tables among the operands (and in the residuals)."""
        return ((),) if self.score_mod else ()

    def extra_static(self) -> tuple:
        """What follows the window among the static arguments."""
        return (None,) if self.score_mod else ()


FORMS = (RuleForm("jax 0.11", score_mod=False), RuleForm("jax 0.12", score_mod=True))


@functools.cache
def rules() -> RuleForm | None:
    """The form of the cuDNN attention rules in this jax, or None when they are missing or
    have a signature this module does not know."""
    if _fa is None or not all(hasattr(_fa, name) for name in _HELPERS):
        return None
    try:
        fwd = tuple(inspect.signature(_fa._dot_product_attention_fwd_rule).parameters)
        bwd = tuple(inspect.signature(_fa._dot_product_attention_bwd_rule).parameters)
    except (AttributeError, TypeError, ValueError):
        return None
    return next((f for f in FORMS if f.fwd_args() == fwd and f.bwd_args() == bwd), None)


def available() -> bool:
    """True when jax has the cuDNN attention rules in a form this module calls."""
    return rules() is not None


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
    """``AttentionPieces`` on cuDNN (NVIDIA GPUs of compute capability >= 8.0), for jax's rules
    in the given form (``rules()`` by default)."""

    def __init__(self, form: RuleForm | None = None):
        form = form or rules()
        if form is None:
            raise ValueError("form: this jax has no cuDNN attention rules of a known form")
        self.form = form

    def forward(self, q, k, v, prefix, scale):
        operands, mask_type = _operands(q, prefix)
        (o, lse), _ = _fa._dot_product_attention_fwd_rule(
            q, k, v, *operands, *self.form.extra_operands(), *_static(scale, mask_type),
            *self.form.extra_static(), _fa.check_cudnn_version(), True)
        return o, lse

    def backward(self, q, k, v, prefix, scale, o, lse, do):
        operands, mask_type = _operands(q, prefix)
        res = (q, k, v, *operands, *self.form.extra_operands(), lse, o.astype(q.dtype))
        # jax 0.11's is_training slot receives the custom_vjp's next static argument, the
        # cuDNN version, as jax 0.12's cudnn_version slot does
        dq, dk, dv = _fa._dot_product_attention_bwd_rule(
            *_static(scale, mask_type), *self.form.extra_static(), _fa.check_cudnn_version(),
            False, res, do.astype(q.dtype))[:3]
        return dq, _hide_unseen_keys(dk, prefix), _hide_unseen_keys(dv, prefix)
