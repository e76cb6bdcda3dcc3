"""The blocked cross-entropy equals the one over whole logits, values and gradients."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcp.train.loss import masked_token_sums


def whole_logits_sums(features, head, targets, mask):
    logits = jnp.dot(features, head.astype(features.dtype), preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return jnp.stack([jnp.sum(ce * mask), jnp.sum(correct * mask)])


@pytest.mark.parametrize("T,block", [(48, 16), (50, 16), (16, 64)])
def test_blocked_sums_equal_whole_logits(T, block):
    """Blocks that divide T, a padded last block, and one block larger than T."""
    rng = np.random.default_rng(0)
    B, D, V = 2, 8, 40
    features = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((D, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) < 0.5, jnp.float32)
    blocked = lambda f, h: masked_token_sums(f, h, targets, mask, block)
    whole = lambda f, h: whole_logits_sums(f, h, targets, mask)
    chex.assert_trees_all_close(jax.jit(blocked)(features, head), whole(features, head),
                                rtol=1e-5)
    grad = lambda fn: jax.grad(lambda f, h: fn(f, h)[0], argnums=(0, 1))(features, head)
    got, want = grad(blocked), grad(whole)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_shape(got[0], (B, T, D))


def test_block_tokens_must_be_positive():
    with pytest.raises(ValueError, match="block_tokens"):
        masked_token_sums(jnp.zeros((1, 4, 2)), jnp.zeros((2, 3)), jnp.zeros((1, 4), jnp.int32),
                          jnp.ones((1, 4)), 0)
