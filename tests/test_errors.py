"""Bad input raises ValueError / TypeError naming the argument."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxcp
from flax import nnx
from jaxcp.models import LM, CausalSelfAttention, GatedDeltaNet, KimiDeltaAttention, ShortConvolution
from helpers import make_inputs


@pytest.fixture
def gdn_args():
    return make_inputs("gdn", 1, 32, 2, 4, 16, 16)[:5]


def call(args, **kw):
    return jaxcp.chunk_gated_delta_rule(*args, **kw)


def replace(args, i, x):
    return args[:i] + (x,) + args[i + 1:]


@pytest.mark.parametrize("i,bad,exc,name", [
    (0, jnp.zeros((1, 32, 2)), ValueError, "q"),
    (1, jnp.zeros((1, 32, 2, 32)), ValueError, "k"),
    (2, jnp.zeros((1, 31, 4, 16)), ValueError, "v"),
    (2, jnp.zeros((1, 32, 3, 16)), ValueError, "HV"),
    (2, jnp.zeros((1, 32, 4, 24)), ValueError, "V"),
    (3, jnp.zeros((1, 32, 4, 16)), ValueError, "g"),
    (4, jnp.zeros((1, 32, 2)), ValueError, "beta"),
    (0, jnp.zeros((1, 32, 2, 16), jnp.int32), TypeError, "q"),
    (3, np.zeros((1, 32, 4), np.float64).tolist(), TypeError, "g"),
])
def test_bad_arrays(gdn_args, i, bad, exc, name):
    with pytest.raises(exc, match=name):
        call(replace(gdn_args, i, bad))


def test_kda_gate_must_be_per_channel():
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 32, 1, 1, 16, 16)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        jaxcp.chunk_kda(q, k, v, g, beta)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(A_log=jnp.zeros(1)), ValueError, "A_log is read only with use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log"),
    (dict(use_gate_in_kernel=True, A_log=jnp.zeros(2)), ValueError, "A_log must have shape"),
    (dict(use_gate_in_kernel=True, A_log=jnp.zeros(1), dt_bias=jnp.zeros(8)), ValueError,
     "dt_bias must have shape"),
    (dict(use_gate_in_kernel=True, A_log=jnp.zeros(1, jnp.int32)), TypeError, "A_log"),
    (dict(use_gate_in_kernel=True, safe_gate=True, A_log=jnp.zeros(1)), ValueError,
     "lower_bound"),
    (dict(use_gate_in_kernel=True, lower_bound=0.5), ValueError, "lower_bound"),
    (dict(use_gate_in_kernel=1, A_log=jnp.zeros(1)), TypeError, "use_gate_in_kernel"),
])
def test_kda_gate_arguments(kw, exc, match):
    q, k, v, g, beta, _ = make_inputs("kda", 1, 32, 1, 1, 16, 16)
    with pytest.raises(exc, match=match):
        jaxcp.chunk_kda(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(dt_bias=jnp.zeros(1)), ValueError, "dt_bias is read only with use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log"),
    (dict(use_gate_in_kernel=True, A_log=jnp.zeros(1), dt_bias=jnp.zeros(16)), ValueError,
     r"dt_bias must have shape \(1,\)"),
])
def test_gdn_gate_arguments(kw, exc, match):
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 32, 1, 1, 16, 16)
    with pytest.raises(exc, match=match):
        jaxcp.chunk_gated_delta_rule(q, k, v, g, beta, **kw)


def test_head_dim_not_supported():
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 8, 1, 1, 16, 16)
    q = k = jnp.zeros((1, 8, 1, 48))
    with pytest.raises(ValueError, match="K = 48"):
        call((q, k, v, g, beta))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(cu_seqlens=jnp.asarray([0, 10, 31], jnp.int32)), ValueError, "cu_seqlens .* end at"),
    (dict(cu_seqlens=jnp.asarray([0, 10, 10, 32], jnp.int32)), ValueError, "strictly increasing"),
    (dict(cu_seqlens=jnp.asarray([0.0, 32.0])), TypeError, "cu_seqlens"),
    (dict(cu_seqlens=jnp.asarray([[0, 32]], jnp.int32)), ValueError, "cu_seqlens"),
    (dict(initial_state=jnp.zeros((2, 4, 16, 16))), ValueError, "initial_state"),
    (dict(initial_state=jnp.zeros((1, 4, 16, 16), jnp.int32)), TypeError, "initial_state"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(chunk_size=48), ValueError, "chunk_size"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(cp_strategy="ring"), ValueError, "cp_strategy"),
    (dict(cp_axis="seq"), ValueError, "cp_axis='seq' is not a bound mesh axis"),
    (dict(cp_axis=3), TypeError, "cp_axis"),
])
def test_bad_options(gdn_args, kw, exc, match):
    with pytest.raises(exc, match=match):
        call(gdn_args, **kw)


def test_cu_seqlens_needs_batch_one():
    args = make_inputs("gdn", 2, 16, 1, 1, 16, 16)[:5]
    with pytest.raises(ValueError, match="B == 1"):
        call(args, cu_seqlens=jnp.asarray([0, 16], jnp.int32))


def _in_shard_map(args, W, **kw):
    mesh = Mesh(np.array(jax.devices()[:W]), ("seq",))
    seq = P(None, "seq")
    f = jax.shard_map(lambda *a: call(a, cp_axis="seq", **kw)[0], mesh=mesh,
                      in_specs=(seq,) * 5, out_specs=seq)
    return f(*args)


def test_all_to_all_needs_divisible_heads(gdn_args):
    with pytest.raises(ValueError, match="H = 2 must be divisible"):
        _in_shard_map(gdn_args, 4, cp_strategy="all_to_all")


def test_cp_cu_seqlens_end_is_global_length(gdn_args):
    with pytest.raises(ValueError, match="total length 32"):
        _in_shard_map(gdn_args, 2, cu_seqlens=jnp.asarray([0, 16], jnp.int32))



def test_cp_layout_errors():
    """An unknown layout, zigzag with an odd T per device, relay (contiguous only, one
    segment) and segments that do not divide a zigzag piece."""
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 4 * 6, 1, 1, 16, 16)
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))

    def run(T, **kw):
        body = lambda q, k, v, g, beta: jaxcp.chunk_gated_delta_rule(
            q, k, v, g, beta, cp_axis="seq", **kw)[0]
        cut = lambda x: x[:, :4 * T]
        return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "seq"),) * 5,
                             out_specs=P(None, "seq"))(*map(cut, (q, k, v, g, beta)))

    with pytest.raises(ValueError, match="cp_layout must be one of"):
        run(6, cp_layout="ring")
    with pytest.raises(ValueError, match="even number of tokens per device"):
        run(5, cp_layout="zigzag")
    with pytest.raises(ValueError, match="cp_strategy='relay'"):
        run(6, cp_layout="zigzag", cp_strategy="relay")
    with pytest.raises(ValueError, match="does not combine with 'relay'"):
        run(6, cp_strategy="relay", segments=2)
    with pytest.raises(ValueError, match=r"each zigzag piece \(T / 2\) = 3"):
        run(6, cp_layout="zigzag", segments=2)


@pytest.mark.parametrize("make", [
    lambda: GatedDeltaNet(32, 2, 16, rngs=nnx.Rngs(0)),
    lambda: KimiDeltaAttention(32, 2, 16, rngs=nnx.Rngs(0)),
    lambda: CausalSelfAttention(32, 2, rngs=nnx.Rngs(0)),
    lambda: ShortConvolution(32, rngs=nnx.Rngs(0)),
], ids=["gdn", "kda", "attn", "conv"])
@pytest.mark.parametrize("x,exc,match", [
    (jnp.zeros((1, 8, 24)), ValueError, "hidden_size = 32"),
    (jnp.zeros((8, 32)), ValueError, r"\[B, T, hidden_size"),
    (jnp.zeros((1, 8, 32), jnp.int32), TypeError, "float array"),
    ([[0.0] * 32], TypeError, "jax array"),
], ids=["hidden", "rank", "int", "list"])
def test_layers_check_x(make, x, exc, match):
    layer = make()
    with pytest.raises(exc, match=f"{type(layer).__name__}: x .*{match}"):
        layer(x)


def test_lm_checks_tokens():
    lm = LM(16, 32, "gdn", 2, 16, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="tokens must be an integer array"):
        lm(jnp.zeros((1, 8)))
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
        lm(jnp.zeros((8,), jnp.int32))


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_gpu_backends_need_a_gpu(gdn_args, backend):
    with pytest.raises(ValueError, match="backend='interpret'"):
        call(gdn_args, backend=backend)


def test_mosaic_backend_needs_hopper(gdn_args, monkeypatch):
    """On a GPU that is not a Hopper (compute capability 9.x) backend='mosaic' says to use
    'pallas' (a GPU of another kind stood in for by the device's attributes)."""
    import jaxcp.checks as checks
    from jaxcp import stages

    class Ampere:
        compute_capability = "8.0"
    monkeypatch.setattr(checks, "gpu_present", lambda: True)
    monkeypatch.setattr(stages, "gpu_present", lambda: True)
    monkeypatch.setattr(checks.jax, "devices", lambda *a: [Ampere()])
    with pytest.raises(ValueError, match="compute capability 9.x.*8.0: use backend='pallas'"):
        checks.check_backend("mosaic")
    checks.check_backend("pallas")


@pytest.mark.parametrize("capability, jax_version", [("9.0", "0.11.2"), ("9.0", "0.12.0"),
                                                     ("8.0", "0.11.2"), (None, "0.11.2")])
def test_default_backend_by_device_gate_and_dtype(monkeypatch, capability, jax_version):
    """backend=None: "mosaic" for GDN's bf16 inputs on a Hopper GPU under a jax release
    whose Mosaic kernels have run on GPUs, "pallas" for KDA, other dtypes, GPUs and jax
    releases, "xla" without a GPU (GPUs stood in for by the device's attributes); a backend
    given is kept."""
    from jaxcp import stages
    from jaxcp.gate import Gate

    class Device:
        compute_capability = capability
    if capability is not None:
        monkeypatch.setattr(stages, "gpu_present", lambda: True)
        monkeypatch.setattr(stages.jax, "devices", lambda *a: [Device()])
    monkeypatch.setattr(stages.jax, "__version__", jax_version)
    choose = lambda gate, dtype: stages.resolve_backend(None, gate, dtype)
    gpu = "pallas" if capability else "xla"
    mosaic = capability == "9.0" and jax_version.startswith(stages.MOSAIC_DEFAULT_JAX)
    assert choose(Gate.SCALAR, jnp.bfloat16) == ("mosaic" if mosaic else gpu)
    assert choose(Gate.SCALAR, jnp.float32) == gpu
    assert choose(Gate.CHANNEL, jnp.bfloat16) == gpu
    assert stages.resolve_backend(None) == gpu
    assert stages.resolve_backend("pallas", Gate.SCALAR, jnp.bfloat16) == "pallas"


def test_mosaic_backend_refuses_what_it_does_not_run():
    """backend='mosaic' runs GDN with bf16 inputs: KDA and float32 inputs are refused with
    the way on."""
    from jaxcp import stages
    from jaxcp.gate import Gate
    with pytest.raises(ValueError, match="'mosaic' has no stages for the channel gate"):
        stages.implementation("mosaic", Gate.CHANNEL)
    opts = stages.stage_options("mosaic", Gate.SCALAR, jnp.float32, 128, unit_qk=True)
    with pytest.raises(ValueError, match="backend='mosaic' takes bfloat16 inputs"):
        stages.stages_for(opts)


def test_traced_cu_seqlens_checked_on_request(gdn_args):
    """Traced offsets are not checked by default (no host round trip); inside
    check_traced_inputs, checkify reports decreasing offsets and a wrong total."""
    from jax.experimental import checkify
    args = make_inputs("gdn", 1, 32, 2, 4, 16, 16)[:5]
    f = lambda cu: call(args, cu_seqlens=cu)[0]
    good, decreasing, short = (jnp.asarray(c, jnp.int32) for c in
                               ([0, 5, 32], [0, 20, 5, 32], [0, 5, 30]))
    assert bool(jnp.isfinite(jax.jit(f)(decreasing)).all())      # unchecked: garbage
    with jaxcp.check_traced_inputs():
        checked = jax.jit(checkify.checkify(f))
        checked(good)[0].throw()
        with pytest.raises(Exception, match="strictly increasing"):
            checked(decreasing)[0].throw()
        with pytest.raises(Exception, match="end at the total length 32"):
            checked(short)[0].throw()
