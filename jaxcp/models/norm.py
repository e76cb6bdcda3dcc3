"""RMS norms: plain, and gated (the output norm of GDN and KDA)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

_GATES = {"swish": jax.nn.silu, "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2, -1) + eps) in float32."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * weight over the last axis; weight starts at ones."""

    def __init__(self, size: int, eps: float = 1e-5):
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalize(x, self.eps) * self.weight[...]).astype(x.dtype)


class RMSNormGated(RMSNorm):
    """y = x / rms(x) * weight * act(gate), act in {"swish", "sigmoid"} (FLA's FusedRMSNormGated)."""

    def __init__(self, size: int, eps: float = 1e-5, activation: str = "swish"):
        if activation not in _GATES:
            raise ValueError(f"activation must be one of {sorted(_GATES)}, got {activation!r}")
        super().__init__(size, eps)
        self.activation = activation

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        act = _GATES[self.activation](gate.astype(jnp.float32))
        return (rms_normalize(x, self.eps) * self.weight[...] * act).astype(x.dtype)
