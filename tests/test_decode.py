"""Decoding with caches: a prefill and then a few tokens per call equal one forward over the
whole sequence, for each layer and for the LM; generation is the greedy continuation."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxcp.cp.split import from_layout, to_layout
from jaxcp.models import LM, CausalSelfAttention, GatedDeltaNet, KimiDeltaAttention
from jaxcp.models.cache import DeltaRuleCache, KVCache
from jaxcp.models.layers import RECURRENT_MAX_TOKENS
from test_models import mesh_of

HIDDEN, B = 32, 2
LAYERS = {
    "gdn": lambda **cp: GatedDeltaNet(HIDDEN, 2, 16, rngs=nnx.Rngs(0), **cp),
    "kda": lambda **cp: KimiDeltaAttention(HIDDEN, 2, 16, rngs=nnx.Rngs(0), **cp),
    "attn": lambda **cp: CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, block_size=8,
                                             rngs=nnx.Rngs(0), **cp),
}


def _init_cache(layer, max_len):
    if isinstance(layer, CausalSelfAttention):
        return layer.init_cache(B, max_len)
    return layer.init_cache(B)


def _in_calls(call, x, cache, sizes):
    """Run x through call in calls of the given token counts, carrying the cache."""
    outs, t = [], 0
    for n in sizes:
        y, cache = call(x[:, t:t + n], cache)
        outs.append(y)
        t += n
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_prefill_then_decode_equals_one_forward(kind):
    """A prompt long enough for the chunk op, then single tokens and a pair (the recurrent
    op), equals the layer over the whole sequence."""
    layer = LAYERS[kind]()
    sizes = [RECURRENT_MAX_TOKENS, 1, 2, 1]
    T = sum(sizes)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, HIDDEN)), jnp.float32)
    want = layer(x)
    got, cache = jax.jit(lambda x, c: _in_calls(lambda a, c: layer(a, cache=c), x, c, sizes))(
        x, _init_cache(layer, T))
    chex.assert_shape(got, (B, T, HIDDEN))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    if kind == "attn":
        assert isinstance(cache, KVCache) and int(cache.length) == T
    else:
        assert isinstance(cache, DeltaRuleCache) and len(cache.conv) == 3


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_cp_prefill_fills_one_devices_cache(kind, cp_layout):
    """A prompt split over 4 devices prefills with the CP op: the output is the layer's, the
    cache (the same on every device) is a one-device prefill's, and the next tokens decode
    alike from either."""
    W, T = 4, 32
    plain, split = LAYERS[kind](), LAYERS[kind](cp_axis="seq", cp_layout=cp_layout)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, T + 2, HIDDEN)), jnp.float32)
    prompt, nxt = x[:, :T], x[:, T:]
    want_y, want_cache = plain(prompt, cache=_init_cache(plain, T + 2))
    body = lambda x, c: split(x, cache=c)
    y, cache = jax.jit(jax.shard_map(body, mesh=mesh_of(W), in_specs=(P(None, "seq"), P()),
                                     out_specs=(P(None, "seq"), P())))(
        to_layout(prompt, cp_layout, W), _init_cache(split, T + 2))
    chex.assert_trees_all_close(from_layout(y, cp_layout, W), want_y, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(cache, want_cache, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(plain(nxt, cache=cache), plain(nxt, cache=want_cache),
                                rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_cp_prefill_continues_a_cache(kind, cp_layout):
    """A prompt split over 4 devices continues a cache that one device filled (a first
    prompt and a decoded token): the output and the new cache are a one-device call's, and
    the next token decodes alike from either."""
    W, T0, T = 4, 7, 32
    plain, split = LAYERS[kind](), LAYERS[kind](cp_axis="seq", cp_layout=cp_layout)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T0 + 1 + T + 1, HIDDEN)),
                    jnp.float32)
    first, prompt, nxt = x[:, :T0 + 1], x[:, T0 + 1:T0 + 1 + T], x[:, T0 + 1 + T:]
    _, cache = _in_calls(lambda a, c: plain(a, cache=c), first,
                         _init_cache(plain, x.shape[1]), [T0, 1])
    want_y, want_cache = plain(prompt, cache=cache)
    body = lambda x, c: split(x, cache=c)
    y, got_cache = jax.jit(jax.shard_map(body, mesh=mesh_of(W), in_specs=(P(None, "seq"), P()),
                                         out_specs=(P(None, "seq"), P())))(
        to_layout(prompt, cp_layout, W), cache)
    chex.assert_trees_all_close(from_layout(y, cp_layout, W), want_y, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(got_cache, want_cache, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(plain(nxt, cache=got_cache), plain(nxt, cache=want_cache),
                                rtol=1e-4, atol=1e-5)


def test_layer_cache_errors():
    layer = LAYERS["gdn"]()
    x = jnp.ones((B, 3, HIDDEN))
    with pytest.raises(ValueError, match="cu_seqlens must be None"):
        layer(x, jnp.asarray([0, 3], jnp.int32), cache=layer.init_cache(B))
    with pytest.raises(TypeError, match="DeltaRuleCache"):
        layer(x, cache=(1, 2))
    window = jnp.zeros((B, layer.q_conv1d.conv_size - 1, layer.q_conv1d.hidden_size))
    with pytest.raises(ValueError, match="cu_seqlens must be None"):
        layer.q_conv1d(jnp.ones((1, 3, window.shape[-1])), jnp.asarray([0, 3], jnp.int32),
                       window=window[:1])
    with pytest.raises(ValueError, match="window must be"):
        layer.q_conv1d(jnp.ones((B, 3, window.shape[-1])), window=window[:, :1])


def _lm():
    return LM(64, HIDDEN, "gdn,attn,kda", 2, 16, rngs=nnx.Rngs(1))


def test_lm_prefill_then_decode_equals_one_forward():
    model = _lm()
    T = 9
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (B, T)), jnp.int32)
    want = jax.jit(model)(tokens)
    got, _ = jax.jit(lambda t, c: _in_calls(lambda a, c: model(a, cache=c), t, c,
                                            [5, 1, 1, 2]))(tokens, model.init_cache(B, T))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


def test_generate_is_the_greedy_continuation():
    """Greedy generation gives, token by token, the argmax of the full forward over the
    prompt and the tokens so far."""
    model = _lm()
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 64, (B, 5)), jnp.int32)
    got = model.generate(prompt, 3)
    chex.assert_shape(got, (B, 3))
    seq = prompt
    for _ in range(3):
        nxt = jnp.argmax(jax.jit(model)(seq)[:, -1], axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    chex.assert_trees_all_equal(got, seq[:, 5:])


def test_generate_samples_with_a_key():
    model = _lm()
    prompt = jnp.zeros((B, 3), jnp.int32)
    a = model.generate(prompt, 3, temperature=1.0, rng=jax.random.key(7))
    b = model.generate(prompt, 3, temperature=1.0, rng=jax.random.key(7))
    chex.assert_trees_all_equal(a, b)
    assert bool(jnp.all((a >= 0) & (a < 64)))
    with pytest.raises(ValueError, match="pass rng"):
        model.generate(prompt, 3, temperature=1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, 0)


def test_lm_cp_prefill_then_decode():
    """The LM inside shard_map with an empty cache: the prompt's logits and every block's
    cache equal a one-device prefill's, and decoding from either gives the same logits."""
    W, T = 4, 32
    plain = _lm()
    split = LM(64, HIDDEN, "gdn,attn,kda", 2, 16, cp_axis="seq", cp_layout="zigzag",
               rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (B, T + 1)), jnp.int32)
    want_logits, want_cache = plain(tokens[:, :T], cache=plain.init_cache(B, T + 1))
    body = lambda t, c: split(t, cache=c)
    logits, cache = jax.jit(jax.shard_map(body, mesh=mesh_of(W), in_specs=(P(None, "seq"), P()),
                                          out_specs=(P(None, "seq"), P())))(
        to_layout(tokens[:, :T], "zigzag", W), split.init_cache(B, T + 1))
    chex.assert_trees_all_close(from_layout(logits, "zigzag", W), want_logits, rtol=1e-4,
                                atol=1e-5)
    chex.assert_trees_all_close(cache, want_cache, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(plain(tokens[:, T:], cache=cache)[0],
                                plain(tokens[:, T:], cache=want_cache)[0], rtol=1e-4, atol=1e-5)
