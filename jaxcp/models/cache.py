"""What a layer carries from one call to the next when it decodes: explicit pytrees, so that a
cache jits, shards and passes through ``lax.scan`` like any array.

A call with a cache continues the sequences the cache holds: a prompt (prefill, the chunk op
for long inputs) or a few new tokens (decode, the recurrent op). ``init_cache`` of each layer
gives the empty one.
"""
from __future__ import annotations

from typing import NamedTuple

import jax


class DeltaRuleCache(NamedTuple):
    """A GDN / KDA layer's: conv, the last conv_size - 1 inputs of its q, k and v short
    convolutions ([B, conv_size - 1, dim] each, in the activations' dtype; () without short
    convolutions); state, the recurrent state [B, HV, K, V] float32."""
    conv: tuple
    state: jax.Array


class KVCache(NamedTuple):
    """A softmax attention layer's: keys and values [B, max_len, G, D] of the tokens so far
    (rows past `length` unused) and length, the number of tokens held (int32 scalar)."""
    k: jax.Array
    v: jax.Array
    length: jax.Array
