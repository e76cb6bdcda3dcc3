"""Multi-query associative recall (MQAR, as in the Zoology benchmark), generated on the fly.

A sequence of length T holds n_pairs key-value pairs in its first half (k1 v1 k2 v2 ...) and,
in its second half, queries: keys of the first half in a random order, each followed by its
value. The model is scored on predicting each queried value from its key, so under context
parallelism the answer of a query on a late device sits on an early device. Keys come from
[1, vocab / 2), values from [vocab / 2, vocab); 0 pads. The pairs sit at the start of each
half, or, spread, one every (T / 2) // n_pairs tokens, so that every device of a long
sequence holds keys or queries.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Batch(NamedTuple):
    """tokens, targets (next token), mask (1 where the target is a queried value): [B, T]."""
    tokens: jax.Array
    targets: jax.Array
    mask: jax.Array


def mqar_batch(key: jax.Array, batch: int, seq_len: int, vocab: int, n_pairs: int,
               spread: bool = False) -> Batch:
    """One batch; deterministic in key. spread: pairs evenly spaced over each half (module
    docstring), else packed at its start."""
    half = seq_len // 2
    if n_pairs < 1 or 2 * n_pairs > half:
        raise ValueError(f"n_pairs must be in [1, seq_len / 4 = {seq_len // 4}], got {n_pairs}")
    if vocab < 4 or vocab // 2 - 1 < n_pairs:
        raise ValueError(f"vocab {vocab} too small for {n_pairs} distinct keys")
    k_key, v_key, q_key = jax.random.split(key, 3)
    n_keys = vocab // 2 - 1
    keys = jax.vmap(lambda k: jax.random.permutation(k, n_keys)[:n_pairs] + 1)(
        jax.random.split(k_key, batch))
    values = jax.random.randint(v_key, (batch, n_pairs), vocab // 2, vocab)
    order = jax.vmap(lambda k: jax.random.permutation(k, n_pairs))(jax.random.split(q_key, batch))
    q_keys = jnp.take_along_axis(keys, order, axis=1)
    q_values = jnp.take_along_axis(values, order, axis=1)
    stride = half // n_pairs if spread else 2
    at = jnp.arange(n_pairs) * stride             # each pair's first token within its half
    place = lambda length, a, b: (jnp.zeros((batch, length), jnp.int32)
                                  .at[:, at].set(a).at[:, at + 1].set(b))
    tokens = jnp.concatenate([place(half, keys, values),
                              place(seq_len - half, q_keys, q_values)], axis=1)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
    pos = jnp.arange(seq_len) - half
    is_query = (pos >= 0) & (pos < n_pairs * stride) & (pos % stride == 0)
    mask = jnp.broadcast_to(is_query, (batch, seq_len)).astype(jnp.float32)
    return Batch(tokens, targets, mask)
