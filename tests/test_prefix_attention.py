"""Attention under CP as two pieces merged by their log-sum-exp == the causal softmax over the
whole sequence: outputs and gradients, each device's share simulated on one device, and the
layer under shard_map."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcp.attention import cudnn, select
from jaxcp.attention.pieces import DensePieces
from jaxcp.attention.prefix import prefix_causal_attention
from jaxcp.models import CausalSelfAttention
from jaxcp.models import attention
from helpers import assert_rel, attention_inputs, whole_causal_attention
from test_models import HIDDEN, compare_cp, mesh_of


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
def test_prefix_pieces_equalwhole_causal_attention_attention(W, N, G):
    q, k, v, wo = attention_inputs(6 * W, N, G, 16)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * wo)
    got, want = _by_devices(W)(q, k, v), whole_causal_attention(q, k, v)
    assert_rel(got, want, 1e-5, "o")
    grads = jax.grad(loss(_by_devices(W)), argnums=(0, 1, 2))(q, k, v)
    grads_want = jax.grad(loss(whole_causal_attention), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_want):
        assert_rel(a, b, 1e-5, name)


def test_dense_piece_backward_is_its_vjp():
    """Alone (its own o and lse) a piece's backward is the gradient of its forward."""
    q, k, v, do = attention_inputs(10, 4, 2, 8, seed=1)
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
    monkeypatch.setattr(select, "fused_attention_impl", lambda q: "xla")
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
    """This jax has the cuDNN attention rules in one of the forms CudnnPieces calls (CI runs
    the suite on jax 0.11 and 0.12, one form each)."""
    assert cudnn.rules() in cudnn.FORMS
    assert isinstance(select.cp_pieces("cudnn"), cudnn.CudnnPieces)


@pytest.mark.parametrize("form", cudnn.FORMS, ids=lambda f: f.name)
def test_cudnn_pieces_bind_each_rule_form(monkeypatch, form):
    """CudnnPieces passes each argument of the rules to the parameter of that name, in both
    known forms (the rules themselves need a GPU: here stand-ins with their parameters)."""
    fwd_calls, bwd_calls = [], []

    def fwd(*args):
        assert len(args) == len(form.fwd_args())
        fwd_calls.append(dict(zip(form.fwd_args(), args)))
        return (args[0], "lse"), None

    def bwd(*args):
        assert len(args) == len(form.bwd_args())
        bwd_calls.append(dict(zip(form.bwd_args(), args)))
        return "dq", "dk", "dv", None

    monkeypatch.setattr(cudnn._fa, "_dot_product_attention_fwd_rule", fwd)
    monkeypatch.setattr(cudnn._fa, "_dot_product_attention_bwd_rule", bwd)
    monkeypatch.setattr(cudnn._fa, "check_cudnn_version", lambda: "cudnn-version")
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    pieces = cudnn.CudnnPieces(form)
    o, lse = pieces.forward(q, q, q, None, 0.5)
    assert o is q and lse == "lse"
    assert pieces.backward(q, q, q, None, 0.5, q, "lse", q)[0] == "dq"
    (f,), (b,) = fwd_calls, bwd_calls
    assert f["scale"] == b["scale"] == 0.5 and f["mask_type"] == cudnn._fa.MaskType.CAUSAL
    assert f["cudnn_version"] == "cudnn-version" and f["return_residual"] is True
    assert b["return_residual"] is False and b["grad_output"].shape == q.shape
    if form.score_mod:
        assert f["score_mod_args"] == () and f["score_mod"] is None and b["score_mod"] is None
    # the residuals as the real forward rule returns them: its operands, then lse and o
    residuals = (*(f[name] for name in cudnn._OPERANDS), *form.extra_operands(), "lse", q)
    assert len(b["res"]) == len(residuals) and b["res"][-2] == "lse"
    assert all(a is q for a in b["res"][:3])
    assert b["res"][len(cudnn._OPERANDS):-2] == form.extra_operands()


def test_cp_attention_warns_once_without_cudnn_rules(monkeypatch):
    """A jax whose cuDNN rules are unknown: CP attention keeps the blockwise softmax and says
    so once."""
    monkeypatch.setattr(cudnn, "rules", lambda: None)
    select._warn_no_cudnn_rules.cache_clear()
    with pytest.warns(RuntimeWarning, match="blockwise softmax") as record:
        assert select.cp_pieces("cudnn") is None
        assert select.cp_pieces("cudnn") is None
    assert len(record) == 1
