"""Blockwise softmax attention == a dense masked softmax: outputs and gradients, varlen, GQA,
several query chunks and key blocks with ragged last ones, and under CP (queries offset)."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxcp.attention.blockwise import blockwise_attention
from helpers import assert_rel


def dense_attention(q, k, v, q_pos, q_seq, k_pos, k_seq):
    """softmax(q k^T / sqrt(D) masked to k_pos <= q_pos and k_seq == q_seq) v, all [T_q, T_k]."""
    H, G = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_seq[None, :] == q_seq[:, None])
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def sequence_ids(cu, positions):
    return jnp.asarray(np.searchsorted(np.asarray(cu)[1:], positions, side="right"), jnp.int32)


@pytest.mark.parametrize("q_start,T_q", [(0, 23), (13, 10)])
def test_blockwise_equals_dense(q_start, T_q):
    """T_k = 23 keys in blocks of 5, queries in chunks of 4; q_start > 0 is a CP device's
    slice of the queries against all keys. Packed sequences of lengths 5, 1, 11, 6."""
    B, T_k, H, G, D = 2, 23, 4, 2, 8
    cu = [0, 5, 6, 17, 23]
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v, w = r(B, T_q, H, D), r(B, T_k, G, D), r(B, T_k, G, D), r(B, T_q, H, D)
    q_pos = jnp.arange(q_start, q_start + T_q, dtype=jnp.int32)
    k_pos = jnp.arange(T_k, dtype=jnp.int32)
    ids = (q_pos, sequence_ids(cu, q_pos), k_pos, sequence_ids(cu, k_pos))

    def run(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) * w)
        return jax.jit(fn)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    o, grads = run(lambda q, k, v: blockwise_attention(q, k, v, *ids, block_q=4, block_k=5))
    o_ref, grads_ref = run(lambda q, k, v: dense_attention(q, k, v, *ids))
    assert_rel(o, o_ref, 1e-5, "o")
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert_rel(g, g_ref, 1e-5, f"d{name}")


def test_row_without_visible_key_is_zero():
    """A query before every key of its sequence sees nothing: zeros, finite gradients."""
    x = jnp.ones((1, 3, 1, 4), jnp.float32)
    pos = jnp.arange(3, dtype=jnp.int32)
    o, g = jax.value_and_grad(
        lambda x: jnp.sum(blockwise_attention(x, x, x, pos, pos * 0, pos + 1, pos * 0)))(x)
    np.testing.assert_allclose(o, 8.0)        # rows 1 and 2 average ones (4 each), row 0 zeros
    assert np.all(np.isfinite(g))


def test_blockwise_rejects_bad_arguments():
    x = jnp.zeros((1, 4, 2, 8))
    pos = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="k_pos"):
        blockwise_attention(x, x, x, pos, pos, pos[:3], pos)
    with pytest.raises(ValueError, match="block_k"):
        blockwise_attention(x, x, x, pos, pos, pos, pos, block_k=0)
    with pytest.raises(ValueError, match="H % G"):
        blockwise_attention(x, jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 3, 8)), pos, pos, pos,
                            pos)
