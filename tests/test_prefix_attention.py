"""Attention under CP as two pieces merged by their log-sum-exp == the causal softmax over the
whole sequence: outputs and gradients, each device's share simulated on one device, and the
layer under shard_map."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcp.models import CausalSelfAttention
from jaxcp.models import attention, cudnn_pieces
from jaxcp.models.attention_pieces import DensePieces
from jaxcp.models.blockwise import blockwise_attention
from jaxcp.models.prefix_attention import prefix_causal_attention
from helpers import assert_rel
from test_models import HIDDEN, compare_cp, mesh_of


def _inputs(T, N, G, D, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return r(1, T, N, D), r(1, T, G, D), r(1, T, G, D), r(1, T, N, D)


def _whole(q, k, v):
    pos = jnp.arange(q.shape[1])
    zero = jnp.zeros_like(pos)
    return blockwise_attention(q, k, v, pos, zero, pos, zero, block_q=8, block_k=8)


def _by_devices(W):
    """The whole sequence's attention as W devices compute it: device r's queries and keys
    are tokens [r T, (r + 1) T), its prefix the keys before them."""
    def run(q, k, v):
        T = q.shape[1] // W
        part = lambda x, r: x[:, r * T:(r + 1) * T]
        return jnp.concatenate([prefix_causal_attention(part(q, r), part(k, r), part(v, r), k, v,
                                                        r * T, DensePieces())
                                for r in range(W)], axis=1)
    return run


@pytest.mark.parametrize("W,N,G", [(1, 2, 2), (4, 4, 2), (3, 2, 1)])
def test_prefix_pieces_equal_whole_attention(W, N, G):
    q, k, v, wo = _inputs(6 * W, N, G, 16)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * wo)
    got, want = _by_devices(W)(q, k, v), _whole(q, k, v)
    assert_rel(got, want, 1e-5, "o")
    grads = jax.grad(loss(_by_devices(W)), argnums=(0, 1, 2))(q, k, v)
    grads_want = jax.grad(loss(_whole), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_want):
        assert_rel(a, b, 1e-5, name)


def test_dense_piece_backward_is_its_vjp():
    """Alone (its own o and lse) a piece's backward is the gradient of its forward."""
    q, k, v, do = _inputs(10, 4, 2, 8, seed=1)
    pieces = DensePieces()
    for prefix in (None, jnp.int32(7)):
        o, lse = pieces.forward(q, k, v, prefix, 0.3)
        want = jax.vjp(lambda q, k, v: pieces.forward(q, k, v, prefix, 0.3)[0], q, k, v)[1](do)
        got = pieces.backward(q, k, v, prefix, 0.3, o, lse, do)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert_rel(a, b, 1e-5, f"{name} prefix={prefix}")


def test_layer_cp_takes_the_pieces(monkeypatch):
    """With a fused implementation (here the XLA form, on a GPU cuDNN) the CP layer merges the
    two pieces, and equals the layer without CP; packed sequences keep the blockwise path."""
    calls = []
    merged = attention.gathered_causal_attention
    monkeypatch.setattr(attention, "fused_attention_impl", lambda q: "xla")
    monkeypatch.setattr(attention, "gathered_causal_attention",
                        lambda *a, **kw: calls.append(1) or merged(*a, **kw))
    make = lambda ax: CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, cp_axis=ax, block_size=5,
                                          rngs=nnx.Rngs(0))
    compare_cp(make, 4, 48, None)
    assert calls
    calls.clear()
    layer = make("seq")
    x = jnp.ones((1, 48, HIDDEN), jnp.float32)
    cu = jnp.asarray([0, 5, 30, 48], jnp.int32)
    jax.shard_map(lambda x: layer(x, cu), mesh=mesh_of(4), in_specs=P(None, "seq"),
                  out_specs=P(None, "seq"))(x)
    assert not calls


def test_cudnn_rules_are_there():
    """The cuDNN attention rules that CudnnPieces calls exist in this jax with the expected
    signatures (on a jax where they changed, CP attention falls back to blockwise)."""
    assert cudnn_pieces.available()
    assert isinstance(attention.cp_pieces("cudnn"), cudnn_pieces.CudnnPieces)
