"""The layers' input checks: a bad x gets a ValueError / TypeError naming it and the layer."""
from __future__ import annotations

import jax.numpy as jnp


def check_hidden_states(x, hidden_size: int, layer: str) -> None:
    """x must be a float array [B, T, hidden_size]."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{layer}: x must be a jax array [B, T, {hidden_size}], got "
                        f"{type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{layer}: x must be a float array (float32, bfloat16 or float16), got "
                        f"{x.dtype}")
    if x.ndim != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"{layer}: x must be [B, T, hidden_size = {hidden_size}], got shape "
                         f"{tuple(x.shape)}")


def check_tokens(tokens) -> None:
    """tokens must be an integer array [B, T]."""
    if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
        raise TypeError(f"LM: tokens must be a jax array [B, T], got {type(tokens).__name__}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"LM: tokens must be an integer array [B, T], got {tokens.dtype}")
    if tokens.ndim != 2:
        raise ValueError(f"LM: tokens must be [B, T], got shape {tuple(tokens.shape)}")
