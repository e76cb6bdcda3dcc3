"""Ring attention under CP == the causal softmax over the whole sequence: outputs and
gradients on fake CPU devices, both layouts, and the layer with cp_kv="ring"."""
import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcp.attention import select
from jaxcp.attention.pieces import DensePieces
from jaxcp.attention.ring import ring_causal_attention
from jaxcp.cp.split import from_layout, to_layout
from jaxcp.models import CausalSelfAttention
from helpers import attention_inputs, whole_causal_attention
from test_models import HIDDEN, compare_cp, mesh_of

SEQ = P(None, "seq")


def _ring(W, cp_layout):
    """Sequence order in and out; the ring runs on W devices in cp_layout's order."""
    body = lambda q, k, v: ring_causal_attention(q, k, v, "seq", DensePieces(),
                                                 cp_layout=cp_layout)
    sharded = jax.shard_map(body, mesh=mesh_of(W), in_specs=(SEQ,) * 3, out_specs=SEQ)

    def run(q, k, v):
        laid = (to_layout(x, cp_layout, W) for x in (q, k, v))
        return from_layout(sharded(*laid), cp_layout, W)
    return run


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("W,N,G", [(4, 4, 2), (2, 2, 1), (1, 2, 2)])
def test_ring_equals_whole_causal_attention(cp_layout, W, N, G):
    q, k, v, wo = attention_inputs(8 * W, N, G, 16)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * wo)
    ring = _ring(W, cp_layout)
    got, want = jax.jit(ring)(q, k, v), whole_causal_attention(q, k, v)
    chex.assert_shape(got, q.shape)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(q, k, v)
    grads_want = jax.grad(loss(whole_causal_attention), argnums=(0, 1, 2))(q, k, v)
    chex.assert_tree_all_finite(grads)
    chex.assert_trees_all_close(grads, grads_want, rtol=1e-5, atol=1e-5)


def test_ring_checks_its_shapes():
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="q must be"):
        ring_causal_attention(q, q[:, :4], q[:, :4], "seq", DensePieces())


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
def test_layer_ring_equals_layer_without_cp(monkeypatch, cp_layout):
    """cp_kv="ring" with the fused pieces (the XLA form here; cuDNN's on a GPU) equals the
    layer without CP, gradients included."""
    monkeypatch.setattr(select, "fused_attention_impl", lambda q: "xla")
    make = lambda ax: CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, cp_axis=ax,
                                          cp_layout=cp_layout, cp_kv="ring", rngs=nnx.Rngs(0))
    compare_cp(make, 4, 48, None, cp_layout=cp_layout)


def test_layer_rejects_unknown_cp_kv():
    with pytest.raises(ValueError, match="cp_kv"):
        CausalSelfAttention(HIDDEN, 4, cp_kv="ulysses", rngs=nnx.Rngs(0))
