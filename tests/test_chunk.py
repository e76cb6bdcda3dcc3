"""The chunked XLA path against the token reference: outputs, final states, gradients."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jaxcp
from jaxcp.gate import Gate
from jaxcp.pallas.triton.common import l2norm as l2norm_kernels
from jaxcp.stages import IMPLEMENTATIONS
from helpers import (OPS, TOL, assert_rel, assert_sequences_isolated, cotangents, make_inputs,
                     value_and_grads)

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# (B, T, H, HV, K, V, l2norm, chunk_size)
SHAPES = [
    (2, 150, 2, 4, 16, 32, True, 64),    # GVA, T not a multiple of the chunk
    (1, 64, 1, 1, 32, 16, False, 64),    # exactly one chunk
    (1, 77, 2, 2, 64, 64, True, 32),
    (1, 33, 1, 2, 16, 128, True, 16),
]


def check_against_reference(kind, args, dtype, **kw):
    """The op (kw: its arguments) against the token reference in float32: o, final state and
    every gradient, to the dtype's tolerance. Three packed sequences or more: a NaN in one
    reaches no other (``assert_sequences_isolated``)."""
    op, ref = OPS[kind]
    B, T, HV, V = args[2].shape
    wo, wf = cotangents((B, T, HV, V), args[5].shape)
    run = jax.jit(lambda *a: value_and_grads(op, a, wo, wf, **kw))
    (o, final), grads = clean = run(*args)
    ref_args = tuple(x.astype(jnp.float32) for x in args)
    ref_kw = {k: v for k, v in kw.items() if k not in ("chunk_size", "backend")}
    (o_ref, final_ref), grads_ref = jax.jit(
        lambda *a: value_and_grads(ref, a, wo, wf, **ref_kw))(*ref_args)
    tol = TOL[dtype]
    assert o.dtype == dtype
    assert_rel(o, o_ref, tol, "o")
    assert_rel(final, final_ref, tol, "final state")
    for name, gr, gr_ref in zip(GRAD_NAMES, grads, grads_ref):
        assert gr.shape == gr_ref.shape
        assert_rel(gr, gr_ref, tol, name)
    cu = kw.get("cu_seqlens")
    if cu is not None and len(cu) > 3:          # three sequences or more
        assert_sequences_isolated(kind, run, args, cu, clean)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}HV{}K{}V{}l2{}C{}".format(*s))
def test_chunk_matches_reference_fp32(kind, shape):
    B, T, H, HV, K, V, l2, C = shape
    args = make_inputs(kind, B, T, H, HV, K, V, n_states=B)
    check_against_reference(kind, args, jnp.float32, use_qk_l2norm_in_kernel=l2, chunk_size=C)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_chunk_matches_reference_bf16(kind):
    args = make_inputs(kind, 2, 100, 2, 4, 32, 32, dtype=jnp.bfloat16, n_states=2)
    args = args[:5] + (args[5],)
    check_against_reference(kind, args, jnp.bfloat16, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_chunk_float16_inputs(backend):
    """float16 inputs run the float32 path (KDA's v reaches the Pallas kernels in float32)
    and o comes back in float16."""
    args = make_inputs("kda", 1, 40, 1, 1, 16, 16, dtype=jnp.float16, n_states=1)
    check_against_reference("kda", args, jnp.float16, use_qk_l2norm_in_kernel=True,
                            backend=backend)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_chunk_varlen_matches_reference(kind):
    cu = jnp.asarray([0, 1, 64, 65, 100, 192, 193, 250], jnp.int32)   # 1-token sequences,
    args = make_inputs(kind, 1, 250, 2, 2, 16, 32, n_states=7)       # boundaries on chunk starts
    check_against_reference(kind, args, jnp.float32, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_interpret_matches_reference(kind, dtype):
    """The whole op through the Pallas kernels (interpret mode), varlen, GVA, initial states."""
    cu = jnp.asarray([0, 1, 64, 65, 100, 130], jnp.int32)
    args = make_inputs(kind, 1, 130, 1, 2, 32, 16, dtype=dtype, n_states=5)
    check_against_reference(kind, args, dtype, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                            backend="interpret")


def test_pallas_interpret_l2norm_before_kernels(monkeypatch):
    """Above the implementation's normalize_max_k (K = 256 in use) the op normalises q, k
    before the GDN kernels (``common.l2norm``'s kernel) instead of the kernels doing it: the
    same op."""
    key = ("pallas", Gate.SCALAR)
    monkeypatch.setitem(IMPLEMENTATIONS, key,
                        dataclasses.replace(IMPLEMENTATIONS[key], normalize_max_k=16))
    normalised = []
    norm = l2norm_kernels._forward
    monkeypatch.setattr(l2norm_kernels, "_forward",
                        lambda x, *a: normalised.append(x) or norm(x, *a))
    args = make_inputs("gdn", 1, 128, 1, 2, 32, 16, n_states=1)
    check_against_reference("gdn", args, jnp.float32, use_qk_l2norm_in_kernel=True,
                            backend="interpret")
    assert normalised, "q, k were not normalised before the kernels"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_interpret_kda_norm_in_kernels(monkeypatch, dtype):
    """KDA's kernels with the norm in them (normalize_qk, raw q, k, v in the input dtype;
    not yet the table's default): the op equals the reference, and nothing normalises q, k
    before the kernels."""
    key = ("pallas", Gate.CHANNEL)
    monkeypatch.setitem(IMPLEMENTATIONS, key, dataclasses.replace(
        IMPLEMENTATIONS[key], normalize_max_k=256, narrow_qk=True))
    normalised = []
    norm = l2norm_kernels._forward
    monkeypatch.setattr(l2norm_kernels, "_forward",
                        lambda x, *a: normalised.append(x) or norm(x, *a))
    cu = jnp.asarray([0, 1, 64, 65, 100, 130], jnp.int32)
    args = make_inputs("kda", 1, 130, 1, 2, 32, 16, dtype=dtype, n_states=5)
    check_against_reference("kda", args, dtype, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                            backend="interpret")
    assert not normalised, "q, k were normalised before the kernels"


@pytest.mark.parametrize("kind, T", [("gdn", 70), ("kda", 70), ("gdn", 128)])
def test_pallas_interpret_batch(kind, T):
    """B = 2 without cu_seqlens through the Pallas kernels: one final state per batch row.
    T = 128 is whole chunks, where the GDN kernels read the tokens in place (token-major)."""
    args = make_inputs(kind, 2, T, 1, 2, 16, 16, n_states=2)
    check_against_reference(kind, args, jnp.float32, backend="interpret")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_interpret_single_sequence_cu_seqlens(dtype):
    """cu_seqlens = [0, T] is one sequence, which takes the kernels' in-place token path."""
    args = make_inputs("gdn", 1, 128, 1, 2, 16, 16, dtype=dtype, n_states=1)
    check_against_reference("gdn", args, dtype, cu_seqlens=jnp.asarray([0, 128], jnp.int32),
                            use_qk_l2norm_in_kernel=True, backend="interpret")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_pallas_interpret_correlated_keys(kind, neg_eigval):
    """Keys sharing a direction with weak decay (real data: repeated and padding tokens):
    output and gradients stay exact. GDN runs the Pallas intra kernel, whose inverse of
    (I + A) a power series could not hold here; KDA its jnp intra terms through the Pallas
    state kernels. neg_eigval: beta in (0, 2), many near 2 (allow_neg_eigval layers)."""
    args = make_inputs(kind, 1, 128, 2, 2, 32, 64, n_states=1, correlated_keys=True)
    if neg_eigval:
        beta = 2 * jax.nn.sigmoid(4 * jax.random.normal(jax.random.key(0), args[4].shape))
        args = args[:4] + (beta,) + args[5:]
    check_against_reference(kind, args, jnp.float32, use_qk_l2norm_in_kernel=True,
                            backend="interpret")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_custom_scale_and_no_state(kind):
    op, ref = OPS[kind]
    q, k, v, g, beta, _ = make_inputs(kind, 1, 70, 1, 1, 16, 16)
    o, final = op(q, k, v, g, beta, scale=0.3)
    o_ref, _ = ref(q, k, v, g, beta, scale=0.3)
    assert final is None
    assert_rel(o, o_ref, 1e-4, "o")


def test_varlen_values_do_not_retrace():
    traces = []

    @jax.jit
    def run(q, k, v, g, beta, cu):
        traces.append(1)
        return jaxcp.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                            output_final_state=True)

    q, k, v, g, beta, _ = make_inputs("gdn", 1, 90, 1, 1, 16, 16)
    for cu in ([0, 5, 70, 90], [0, 64, 65, 90], [0, 1, 2, 90]):
        cu = jnp.asarray(cu, jnp.int32)
        o, final = run(q, k, v, g, beta, cu)
        o_ref, final_ref = jaxcp.gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens=cu,
                                                            output_final_state=True)
        assert_rel(o, o_ref, 1e-4, "o")
        assert_rel(final, final_ref, 1e-4, "final state")
    assert len(traces) == 1


def _grad_temp_bytes(kind, T, HV=1, K=128, V=128):
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    g_shape = (1, T, HV) if kind == "gdn" else (1, T, HV, K)
    op = OPS[kind][0]
    loss = lambda *a: jnp.sum(op(*a)[0])
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(5))))
    compiled = grad.lower(sd(1, T, HV, K), sd(1, T, HV, K), sd(1, T, HV, V), sd(*g_shape),
                          sd(1, T, HV)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_memory_is_linear_and_has_no_per_token_state(kind):
    T = 512
    small, large = _grad_temp_bytes(kind, T), _grad_temp_bytes(kind, 2 * T)
    per_token_state = 2 * T * 128 * 128 * 4
    assert large / small < 2.1, (small, large)
    assert large < 0.5 * per_token_state, (large, per_token_state)


def _fla_gate(g_raw, A_log, dt_bias, lower_bound):
    """FLA's gate forms, written out here for the test: dt_bias per head (GDN, g [B, T, HV])
    or per head and channel (KDA, g [B, T, HV, K])."""
    if g_raw.ndim == 3:
        return -jnp.exp(A_log) * jnp.log1p(jnp.exp(g_raw + dt_bias))
    HV, K = g_raw.shape[-2:]
    x = g_raw + dt_bias.reshape(HV, K)
    if lower_bound is None:
        return -jnp.exp(A_log)[:, None] * jnp.log1p(jnp.exp(x))
    return lower_bound * (1.0 / (1.0 + jnp.exp(-jnp.exp(A_log)[:, None] * x)))


@pytest.mark.parametrize("kind, backend, lower_bound, safe_gate", [
    ("gdn", "xla", None, False), ("gdn", "interpret", None, False), ("kda", "xla", None, False),
    ("kda", "interpret", None, False), ("kda", "xla", -5.0, False),
    ("kda", "interpret", -5.0, False), ("kda", "interpret", -5.0, True)])
def test_gate_in_kernel(kind, backend, lower_bound, safe_gate):
    """use_gate_in_kernel: the op computes the decay from the raw gate, A_log and dt_bias
    (FLA's forms) and differentiates all three; it equals the token reference on the gate
    computed outside, gradients through the gate included. safe_gate: the kernels take the
    diagonal sub-chunk blocks through the bound, with the same results."""
    q, k, v, g_raw, beta, h0 = make_inputs(kind, 1, 70, 2, 2, 16, 16, n_states=1)
    keys = jax.random.split(jax.random.key(3), 2)
    A_log = jax.random.normal(keys[0], (2,)) * 0.5
    dt_bias = jax.random.normal(keys[1], (2 * (16 if kind == "kda" else 1),)) * 0.5
    wo, wf = cotangents(v.shape, h0.shape)
    op, ref = OPS[kind]
    extra = {} if kind == "gdn" else dict(lower_bound=lower_bound, safe_gate=safe_gate)

    def value_and_grads_of(call):
        def loss(*args):
            o, final = call(*args)
            return jnp.sum(o * wo) + jnp.sum(final * wf)
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))(
            q, k, v, g_raw, beta, A_log, dt_bias)

    value, grads = value_and_grads_of(lambda q, k, v, g, beta, A_log, dt_bias: op(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, backend=backend, **extra))
    ref_value, ref_grads = value_and_grads_of(lambda q, k, v, g, beta, A_log, dt_bias: ref(
        q, k, v, _fla_gate(g, A_log, dt_bias, lower_bound), beta, initial_state=h0,
        output_final_state=True))
    assert_rel(value, ref_value, 1e-4, "loss")
    for name, a, b in zip(("dq", "dk", "dv", "dg_raw", "dbeta", "dA_log", "ddt_bias"),
                          grads, ref_grads):
        assert_rel(a, b, 1e-4, name)
