"""Which softmax attention kernels a layer runs on: cuDNN's fused kernels where the device and
the inputs allow them, else the blockwise softmax (``jaxcp.attention.blockwise``)."""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from jaxcp.attention import cudnn
from jaxcp.attention.pieces import AttentionPieces, DensePieces


def fused_attention_impl(q: jax.Array) -> str | None:
    """"cudnn" (cuDNN's fused flash kernels) on an NVIDIA GPU of compute capability >= 8.0
    for bf16 / fp16 and head_dim a multiple of 8 up to 128, else None: blockwise_attention,
    which also serves packed sequences (segment masks), which the fused kernel does not take
    without a [T, T] mask."""
    D = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or D > 128 or D % 8:
        return None
    device = jax.devices()[0]
    if device.platform != "gpu" or "rocm" in device.client.platform_version.lower():
        return None
    return "cudnn" if float(getattr(device, "compute_capability", 0)) >= 8.0 else None


@functools.cache
def _warn_no_cudnn_rules() -> None:
    warnings.warn(f"jax {jax.__version__} has no cuDNN attention rules of a form jaxcp knows "
                  f"({', '.join(f.name for f in cudnn.FORMS)}): context-parallel attention "
                  f"runs the blockwise softmax instead of cuDNN's kernels (slower)",
                  RuntimeWarning, stacklevel=3)


def cp_pieces(impl: str) -> AttentionPieces | None:
    """The attention pieces that CP runs on for a ``fused_attention_impl`` result: cuDNN's
    ("cudnn", when ``cudnn.available()``), or the dense reference for "xla" (the fused
    path's XLA form, which tests select); None: keep the blockwise softmax (with a warning,
    once per process, when cuDNN was wanted but jax's rules are not there)."""
    if impl == "cudnn":
        if cudnn.available():
            return cudnn.CudnnPieces()
        _warn_no_cudnn_rules()
        return None
    return DensePieces()
