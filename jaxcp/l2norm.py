"""L2 normalisation of q/k over the head dimension (FLA's ``use_qk_l2norm_in_kernel``)."""
import jax
import jax.numpy as jnp
from jax import lax

L2NORM_EPS = 1e-6


def l2_row_scales(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """1 / sqrt(sum(x^2, -1) + eps), float32, the shape of x without its last axis."""
    x = x.astype(jnp.float32)
    return lax.rsqrt(jnp.sum(x * x, axis=-1) + eps)


def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2, -1) + eps), computed in float32; the shape of x is kept."""
    return x.astype(jnp.float32) * l2_row_scales(x, eps)[..., None]


def normalized_copy(x: jax.Array, dtype) -> jax.Array:
    """l2_normalize(x) in dtype: the op's unit-row copy of q or k by XLA (the Pallas stages
    make it with one kernel each way, ``pallas.triton.common.l2norm``)."""
    return l2_normalize(x).astype(dtype)
