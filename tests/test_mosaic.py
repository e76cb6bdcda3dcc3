"""The Mosaic GPU kernels on a machine without a GPU: their numbers in Mosaic GPU's interpret
mode against their jnp references, and their lowering for CUDA (jax.export), which checks what
interpret mode does not (layouts, shared-memory transforms, wgmma operand shapes)."""
import chex
import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxcp.layout import ChunkLayout
from jaxcp.metrics import rel_error
from jaxcp.pallas.mosaic.common import state as mosaic_state
from jaxcp.terms import ChunkTerms
from jaxcp.xla import state as xla_state


def chunk_problem(NT=3, B=1, HV=2, C=64, K=128, V=128, dtype=jnp.bfloat16):
    """Terms of NT chunks with a sequence start at chunk 1 (from init[1]), the state entering
    chunk 0 from h0."""
    keys = jax.random.split(jax.random.key(0), 6)
    normal = lambda key, shape, s=1.0: jax.random.normal(key, shape) * s
    terms = ChunkTerms(w=normal(keys[0], (NT, B, HV, C, K), 0.1).astype(dtype),
                       u=normal(keys[1], (NT, B, HV, C, V)), qg=None,
                       kd=normal(keys[2], (NT, B, HV, C, K), 0.1).astype(dtype),
                       decay=jax.nn.sigmoid(normal(keys[3], (NT, B, HV, 1))), attn=None)
    starts = jnp.zeros((NT, B), bool).at[1].set(True)
    seq = jnp.cumsum(starts, axis=0).astype(jnp.int32)
    layout = ChunkLayout(chunk_seq=seq, chunk_starts=starts, chunk_ends=starts,
                         seq_last_chunk=None, seq_ends_here=None, token_start=None,
                         token_count=None)
    init = normal(keys[4], (2, HV, K, V))
    h0 = normal(keys[5], (B, HV, K, V))
    return terms, layout, init, h0


@pytest.mark.parametrize("with_init", [True, False])
def test_state_fwd_interpret_equals_its_reference(with_init):
    """The last state of the kernel equals its jnp reference (the recurrence with the same
    operand roundings) to float32 tolerance, and h and v_new (in the operand dtype) to one
    bf16 rounding step; all three are within the bf16 limit (relative error 1e-2) of
    ``xla.state.state_fwd`` in float32."""
    terms, layout, init, h0 = chunk_problem()
    init = init if with_init else None
    out = jax.jit(lambda t, l, i, h: mosaic_state.state_fwd(t, l, i, h, interpret=True))(
        terms, layout, init, h0)
    want = mosaic_state.state_fwd_reference(terms, layout, init, h0)
    chex.assert_shape(out, [x.shape for x in want])
    chex.assert_tree_all_finite(out)
    chex.assert_trees_all_equal_dtypes(out, want)
    one_step = 2.0 ** -8
    chex.assert_trees_all_close(out[:2], want[:2], rtol=one_step, atol=one_step)
    chex.assert_trees_all_close(out[2], want[2], rtol=1e-5, atol=1e-5)
    exact = xla_state.state_fwd(terms, layout, init, h0)
    assert all(rel_error(a, b) < 1e-2 for a, b in zip(out, exact))


@pytest.mark.parametrize("V, block_cols", [(128, 64), (64, 64), (256, 64)])
def test_state_fwd_lowers_for_cuda(V, block_cols):
    """The kernel lowers to a Mosaic GPU custom call for CUDA, from this CPU machine."""
    terms, layout, init, h0 = chunk_problem(V=V)
    blocks = mosaic_state.StateBlocks(block_cols=block_cols)
    fn = jax.jit(lambda t, l, i, h: mosaic_state.state_fwd(t, l, i, h, blocks=blocks))
    text = export.export(fn, platforms=["cuda"])(terms, layout, init, h0).mlir_module()
    assert "mosaic_gpu" in text


def test_state_fwd_refuses_what_it_does_not_take():
    terms, layout, init, h0 = chunk_problem()
    with pytest.raises(ValueError, match="scalar gate"):
        mosaic_state.state_fwd(terms._replace(decay=jnp.ones(terms.w.shape[:-2] + (128,))),
                               layout, init, h0)
    with pytest.raises(TypeError, match="bfloat16, float16"):
        mosaic_state.state_fwd(terms._replace(w=terms.w.astype(jnp.float32)), layout, init, h0)
    with pytest.raises(ValueError, match="h0 must be"):
        mosaic_state.state_fwd(terms, layout, init, h0[..., :64])
    with pytest.raises(ValueError, match="init must be"):
        mosaic_state.state_fwd(terms, layout, init[:, :1], h0)
    with pytest.raises(ValueError, match="K a multiple of 64"):
        short = chunk_problem(K=32)
        mosaic_state.state_fwd(*short)
    with pytest.raises(ValueError, match="block_cols 128 at C = 64, K = 128 needs"):
        mosaic_state.state_fwd(*chunk_problem(V=256),
                               blocks=mosaic_state.StateBlocks(block_cols=128))
    with pytest.raises(ValueError, match="block_cols 128 must divide V = 64"):
        mosaic_state.state_fwd(*chunk_problem(V=64),
                               blocks=mosaic_state.StateBlocks(block_cols=128))


def test_gpu_check_runs_in_interpret_mode(capsys):
    """``benchmarks.check.mosaic`` (the kernel's check and timing on a GPU) on GDN's own terms,
    interpreted: within its limits; a bad flag is one line and exit 2."""
    from benchmarks.check import mosaic as check
    assert check.main(["--NT", "2", "--H", "1", "--interpret"]) == 0
    assert "all within limits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        check.main(["--NT", "0"])
    assert stop.value.code == 2
    assert "--NT and --H must be positive" in capsys.readouterr().err

