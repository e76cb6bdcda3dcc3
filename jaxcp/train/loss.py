"""Cross-entropy over a large vocabulary without the [B, T, vocab] logits in memory.

The head's logits are computed one block of tokens at a time inside a ``lax.scan`` whose body
is ``jax.checkpoint``-ed: the forward keeps only the running sums, and the backward computes
each block's logits again. Peak memory for the loss is one block's [B, block, vocab] float32
logits instead of the whole sequence's (at 262144 tokens and vocab 8192, 8 GiB a copy).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.models.token_blocks import to_token_blocks
from jaxcp.vma import vary_like


def masked_token_sums(features: jax.Array, head: jax.Array, targets: jax.Array,
                      mask: jax.Array, block_tokens: int) -> jax.Array:
    """[sum(mask * ce), sum(mask * correct)] float32 over all tokens.

    features [B, T, D] (the final norm's output), head [D, vocab] (logits = features @ head,
    in float32 from features' dtype), targets [B, T] int, mask [B, T] float; ce is the
    softmax cross-entropy of the target and correct is 1 where the argmax is the target.
    block_tokens: tokens per block (the last block is padded with mask 0)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    blocks = lambda x: to_token_blocks(x, min(block_tokens, features.shape[1]))
    head = head.astype(features.dtype)

    @jax.checkpoint
    def block_sums(feat, tgt, msk):
        logits = jnp.dot(feat, head, preferred_element_type=jnp.float32)
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
            logits, tgt[..., None], axis=-1)[..., 0]
        correct = (jnp.argmax(logits, -1) == tgt).astype(jnp.float32)
        return jnp.stack([jnp.sum(ce * msk), jnp.sum(correct * msk)])

    def body(total, xs):
        return total + block_sums(*xs), None

    xs = (blocks(features), blocks(targets), blocks(mask.astype(jnp.float32)))
    total, _ = lax.scan(body, vary_like(jnp.zeros((2,), jnp.float32), xs[0]), xs)
    return total
