"""Layers with CP on 4 fake devices == the same layers without CP: outputs, parameter gradients."""
import chex
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxcp import from_layout, to_layout
from jaxcp.cp.split import pieces as split_pieces
from jaxcp.models import LM, CausalSelfAttention, GatedDeltaNet, KimiDeltaAttention, ShortConvolution
from helpers import assert_rel
from jaxcp.models import attention

HIDDEN = 32
VOCAB = 64


def mesh_of(W):
    return Mesh(np.array(jax.devices()[:W]), ("seq",))


def compare_cp(make, W, T, cu, *, tol=1e-4, tokens=False, cp_layout="contiguous"):
    """make(cp_axis) -> module; same parameters with and without CP. tokens: the module takes
    int tokens [1, T] (an LM) rather than [1, T, HIDDEN] activations. cp_layout: the CP
    module's (make("seq") must build it so); its input is permuted into the layout and its
    output back."""
    plain, sharded = make(None), make("seq")
    graph_plain, params = nnx.split(plain)
    graph_cp, params_cp = nnx.split(sharded)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params, params_cp)
    rng = np.random.default_rng(0)
    if tokens:
        x = jnp.asarray(rng.integers(0, VOCAB, (1, T)), jnp.int32)
        wo = jnp.asarray(rng.standard_normal((1, T, VOCAB)), jnp.float32)
    else:
        x = jnp.asarray(rng.standard_normal((1, T, HIDDEN)), jnp.float32)
        wo = jnp.asarray(rng.standard_normal((1, T, HIDDEN)), jnp.float32)
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)

    def run_plain(params, x):
        return nnx.merge(graph_plain, params)(x, cu)

    def run_cp(params, x):
        body = lambda params, x: nnx.merge(graph_cp, params)(x, cu)
        y = jax.shard_map(body, mesh=mesh_of(W), in_specs=(P(), P(None, "seq")),
                          out_specs=P(None, "seq"))(params, to_layout(x, cp_layout, W))
        return from_layout(y, cp_layout, W)

    def outputs_and_grads(run):
        """One program: the output and the gradients of <output, wo> (x's too, unless it
        holds tokens)."""
        def f(params, x):
            if tokens:
                y, vjp = jax.vjp(lambda p: run(p, x), params)
                return y, *vjp(wo), None
            y, vjp = jax.vjp(run, params, x)
            return y, *vjp(wo)
        return jax.jit(f)(params, x)

    (y1, gp1, gx1), (y2, gp2, gx2) = (outputs_and_grads(run) for run in (run_plain, run_cp))
    assert_rel(y2, y1, tol, "output")
    if not tokens:
        assert_rel(gx2, gx1, tol, "d x")
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(gp1),
                                 jax.tree_util.tree_leaves_with_path(gp2)):
        assert_rel(b, a, tol, f"d {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("T_local,cu", [(2, [0, 3, 8]), (5, [0, 1, 9, 20])])
def test_short_conv_halo(T_local, cu):
    """T_local < conv_size - 1: the halo comes from several devices back, never across a
    sequence start."""
    compare_cp(lambda ax: ShortConvolution(HIDDEN, 4, "silu", ax, rngs=nnx.Rngs(0)), 4,
               4 * T_local, cu)


def test_short_conv_respects_sequence_starts():
    conv = ShortConvolution(HIDDEN, 4, None, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 10, HIDDEN)), jnp.float32)
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    y = conv(x, cu)
    np.testing.assert_allclose(y[:, 4:], conv(x[:, 4:]), rtol=1e-6)
    np.testing.assert_allclose(y[:, :4], conv(x[:, :4]), rtol=1e-6)


@pytest.mark.parametrize("cu", [None, [0, 5, 30, 31, 48]])
def test_gated_deltanet_cp(cu):
    compare_cp(lambda ax: GatedDeltaNet(HIDDEN, 2, 16, num_v_heads=4, expand_v=1.0, cp_axis=ax,
                                        rngs=nnx.Rngs(0)), 4, 48, cu)


@pytest.mark.parametrize("safe_gate", [False, True])
def test_kimi_delta_attention_cp(safe_gate):
    compare_cp(lambda ax: KimiDeltaAttention(HIDDEN, 2, 16, safe_gate=safe_gate,
                                             lower_bound=-5.0 if safe_gate else None,
                                             cp_axis=ax, rngs=nnx.Rngs(0)),
               4, 48, [0, 5, 30, 31, 48])


@pytest.mark.parametrize("cu", [None, [0, 5, 30, 31, 48]])
def test_causal_self_attention_cp(cu):
    """Blocks of 5 tokens: several query chunks and key blocks per device, ragged last ones."""
    compare_cp(lambda ax: CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, cp_axis=ax,
                                              block_size=5, rngs=nnx.Rngs(0)), 4, 48, cu)


def test_fused_attention_path(monkeypatch):
    """One unpacked sequence without CP goes through jax.nn.dot_product_attention (cuDNN on a
    GPU; its XLA form here) and equals the blockwise softmax, gradients included. The
    gradient (entries up to about 16, some near 0.03 as differences of large terms) is held
    to 1e-5 of its norm: entrywise, a float32 ulp at its scale (2e-6) would exceed 1e-6."""
    from jaxcp.attention import select
    if jax.default_backend() == "cpu":
        assert select.fused_attention_impl(jnp.zeros((1, 4, 2, 16), jnp.bfloat16)) is None
    attn = CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, block_size=5, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, HIDDEN)), jnp.float32)
    cu = jnp.asarray([0, 5, 12], jnp.int32)
    loss = lambda x: jnp.sum(attn(x) ** 2)
    want, want_grad, want_packed = attn(x), jax.grad(loss)(x), attn(x[:1], cu)
    calls = []
    dpa = jax.nn.dot_product_attention
    monkeypatch.setattr(select, "fused_attention_impl", lambda q: "xla")
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or dpa(*a, **kw))
    got, got_grad = attn(x), jax.grad(loss)(x)
    assert calls and all(kw["is_causal"] and kw["implementation"] == "xla" for kw in calls)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_shape(got_grad, want_grad.shape)
    assert_rel(got_grad, want_grad, 1e-5, "d x")
    calls.clear()
    chex.assert_trees_all_close(attn(x[:1], cu), want_packed, rtol=1e-5, atol=1e-6)
    assert not calls, "packed sequences must keep the blockwise softmax"


def test_lm_computes_in_its_parameters_dtype(monkeypatch):
    """With its parameters cast to bf16 (the train step's --dtype bfloat16) the LM computes in
    bf16: the attention sees bf16 queries (nnx.Embed alone would return float32)."""
    from jaxcp.attention import select
    from jaxcp.train.step import _compute_params
    seen = []
    monkeypatch.setattr(select, "fused_attention_impl", lambda q: seen.append(q.dtype))
    graph, params = nnx.split(LM(64, HIDDEN, "attn", 2, 16, rngs=nnx.Rngs(0)))
    model = nnx.merge(graph, _compute_params(params, jnp.bfloat16))
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert seen == [jnp.bfloat16] and logits.dtype == jnp.float32


def test_attention_is_per_sequence():
    """Packed sequences attend only within themselves, with positions restarting at each."""
    attn = CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 12, HIDDEN)), jnp.float32)
    y = attn(x, jnp.asarray([0, 5, 12], jnp.int32))
    np.testing.assert_allclose(y[:, :5], attn(x[:, :5]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[:, 5:], attn(x[:, 5:]), rtol=1e-5, atol=1e-6)


def test_hybrid_lm_cp():
    """A GDN / KDA / attention hybrid under one sequence mesh axis, packed sequences, the
    delta-rule layers' pieces in 2 segments (the LM passes segments to their ops; the
    zigzag test below runs them whole)."""
    compare_cp(lambda ax: LM(VOCAB, HIDDEN, "gdn,kda,attn", 2, 16, 64, cp_axis=ax,
                             segments=None if ax is None else 2, rngs=nnx.Rngs(0)),
               4, 48, [0, 5, 30, 31, 48], tokens=True)


def test_lm_rejects_unknown_mixer():
    with pytest.raises(ValueError, match="layer_pattern"):
        LM(VOCAB, HIDDEN, "gdn,mamba", 2, 16, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", ["gdn", "kda", "attn"])
def test_layer_enters_shard_map_under_jit_on_a_mesh(kind):
    """cp_axis set, called under jax.jit with jax.set_mesh: the layer shards itself."""
    make = {"gdn": lambda ax: GatedDeltaNet(HIDDEN, 2, 16, cp_axis=ax, rngs=nnx.Rngs(0)),
            "kda": lambda ax: KimiDeltaAttention(HIDDEN, 2, 16, cp_axis=ax, rngs=nnx.Rngs(0)),
            "attn": lambda ax: CausalSelfAttention(HIDDEN, 2, cp_axis=ax, rngs=nnx.Rngs(0))}[kind]
    plain, sharded = make(None), make("seq")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 48, HIDDEN)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: sharded(x))(x)
    assert_rel(y, plain(x), 1e-4, "output")


ZIGZAG = dict(cp_layout="zigzag")


@pytest.mark.parametrize("T_local,cu", [(2, [0, 3, 8]), (8, [0, 1, 9, 20, 32])])
def test_short_conv_halo_zigzag(T_local, cu):
    """Pieces of 1 token (the halo from several pieces back, across devices both ways) and of
    4 tokens, sequence starts on and inside pieces."""
    compare_cp(lambda ax: ShortConvolution(HIDDEN, 4, "silu", ax, "zigzag", rngs=nnx.Rngs(0)),
               4, 4 * T_local, cu, cp_layout="zigzag")


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
def test_short_conv_window_reaches_short_pieces(cp_layout):
    """A window before the sequence (a decoding cache's) reaches every piece within
    conv_size - 1 tokens of the sequence's start, pieces of one token (zigzag) and two
    included: CP equals one device convolving the window followed by x."""
    W, T = 4, 8
    make = lambda ax: ShortConvolution(HIDDEN, 4, "silu", ax, cp_layout, rngs=nnx.Rngs(0))
    plain, split = make(None), make("seq")
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((2, T, HIDDEN)), jnp.float32)
    window = jnp.asarray(rng.standard_normal((2, 3, HIDDEN)), jnp.float32)
    want = plain(jnp.concatenate([window, x], axis=1))[:, 3:]
    y = jax.shard_map(lambda x, w: split(x, window=w), mesh=mesh_of(W),
                      in_specs=(P(None, "seq"), P()), out_specs=P(None, "seq"))(
        to_layout(x, cp_layout, W), window)
    chex.assert_trees_all_close(from_layout(y, cp_layout, W), want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(plain.extend(x, window)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cu", [None, [0, 5, 30, 31, 48]])
def test_gated_deltanet_cp_zigzag(cu):
    compare_cp(lambda ax: GatedDeltaNet(HIDDEN, 2, 16, num_v_heads=4, expand_v=1.0, cp_axis=ax,
                                        rngs=nnx.Rngs(0), **ZIGZAG), 4, 48, cu, **ZIGZAG)


def test_kimi_delta_attention_cp_zigzag():
    compare_cp(lambda ax: KimiDeltaAttention(HIDDEN, 2, 16, cp_axis=ax, rngs=nnx.Rngs(0),
                                             **ZIGZAG), 4, 48, [0, 5, 30, 31, 48], **ZIGZAG)


@pytest.mark.parametrize("cu", [None, [0, 5, 30, 31, 48]])
def test_causal_self_attention_cp_zigzag(cu):
    """The blockwise softmax on the zigzag layout's positions."""
    compare_cp(lambda ax: CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, cp_axis=ax,
                                              block_size=5, rngs=nnx.Rngs(0), **ZIGZAG),
               4, 48, cu, **ZIGZAG)


def test_causal_self_attention_cp_zigzag_pieces(monkeypatch):
    """One unpacked sequence with a fused implementation (cuDNN on a GPU; here the dense
    pieces): each device's two pieces attend over the early and late pieces gathered in
    sequence order."""
    from jaxcp.attention import prefix, select
    calls = []
    gathered = prefix.gathered_causal_attention
    monkeypatch.setattr(select, "fused_attention_impl", lambda q: "xla")
    monkeypatch.setattr(attention, "gathered_causal_attention",
                        lambda *a, **kw: calls.append(kw) or gathered(*a, **kw))
    compare_cp(lambda ax: CausalSelfAttention(HIDDEN, 4, num_kv_heads=2, cp_axis=ax,
                                              rngs=nnx.Rngs(0), **ZIGZAG), 4, 48, None,
               **ZIGZAG)
    assert calls and all(kw["cp_layout"] == "zigzag" for kw in calls)


def test_hybrid_lm_cp_zigzag():
    compare_cp(lambda ax: LM(VOCAB, HIDDEN, "gdn,kda,attn", 2, 16, 64, cp_axis=ax,
                             rngs=nnx.Rngs(0), **ZIGZAG), 4, 48, [0, 5, 30, 31, 48],
               tokens=True, **ZIGZAG)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_zigzag_balances_causal_attention(W):
    """Query-key pairs of a causal attention over one sequence, per device: zigzag within 5 %
    of the mean on every device (contiguous: the last device does 2W - 1 times the first)."""
    T_local = 64
    work = lambda layout, r: sum(int(p.start) * p.length + p.length * (p.length + 1) // 2
                                 for p in split_pieces(layout, r, W, T_local))
    total = W * T_local * (W * T_local + 1) // 2
    zigzag = [work("zigzag", r) for r in range(W)]
    contiguous = [work("contiguous", r) for r in range(W)]
    assert sum(zigzag) == sum(contiguous) == total
    assert max(abs(w - total / W) for w in zigzag) <= 0.05 * total / W
    assert contiguous[-1] > 1.4 * total / W
