"""The recurrent (decoding) ops: stepping through a sequence a few tokens per call equals the
chunk op over the whole of it (outputs and final state, both gates, grouped value heads,
initial states); a state table read and written through state_indices; argument errors."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcp

B, T, H, HV, K, V = 2, 12, 2, 4, 16, 32
OPS = {"gdn": (jaxcp.chunk_gated_delta_rule, jaxcp.recurrent_gated_delta_rule),
       "kda": (jaxcp.chunk_kda, jaxcp.recurrent_kda)}


def _inputs(kind, batch=B, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    g_shape = (batch, T, HV) if kind == "gdn" else (batch, T, HV, K)
    return (r(batch, T, H, K), r(batch, T, H, K), r(batch, T, HV, V),
            jax.nn.log_sigmoid(r(*g_shape)), jax.nn.sigmoid(r(batch, T, HV)),
            0.1 * r(batch, HV, K, V))


def _steps(recurrent, args, h0, tokens_per_call, **kw):
    """Run the sequence through `recurrent` tokens_per_call tokens at a time."""
    outs, state = [], h0
    for t in range(0, T, tokens_per_call):
        piece = [x[:, t:t + tokens_per_call] for x in args]
        o, state = recurrent(*piece, initial_state=state, use_qk_l2norm_in_kernel=True, **kw)
        outs.append(o)
    return jnp.concatenate(outs, axis=1), state


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("tokens_per_call", [1, 4])
def test_stepping_equals_the_chunk_op(kind, tokens_per_call):
    chunk, recurrent = OPS[kind]
    *args, h0 = _inputs(kind)
    want = chunk(*args, initial_state=h0, output_final_state=True,
                 use_qk_l2norm_in_kernel=True, chunk_size=16, backend="xla")
    got = jax.jit(lambda *a: _steps(recurrent, a[:-1], a[-1], tokens_per_call))(*args, h0)
    chex.assert_shape(got[0], (B, T, HV, V))
    chex.assert_shape(got[1], (B, HV, K, V))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_state_table_rows_by_index(kind):
    """Rows read by index are replaced by their new states; -1 starts from zero and writes
    nothing; other rows are untouched."""
    _, recurrent = OPS[kind]
    *args, _ = _inputs(kind, batch=3, seed=1)
    table = jnp.asarray(np.random.default_rng(2).standard_normal((5, HV, K, V)), jnp.float32)
    idx = jnp.asarray([4, -1, 1], jnp.int32)
    o, new_table = recurrent(*args, initial_state=table, state_indices=idx)
    per_row = [recurrent(*(x[b:b + 1] for x in args), initial_state=h)
               for b, h in enumerate([table[4:5], jnp.zeros((1, HV, K, V)), table[1:2]])]
    chex.assert_trees_all_close(o, jnp.concatenate([o_b for o_b, _ in per_row]), rtol=1e-6,
                                atol=1e-6)
    want_table = table.at[4].set(per_row[0][1][0]).at[1].set(per_row[2][1][0])
    chex.assert_trees_all_close(new_table, want_table, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gate_in_kernel_is_the_decay_from_raw(kind):
    _, recurrent = OPS[kind]
    q, k, v, g_raw, beta, h0 = _inputs(kind, seed=3)
    rng = np.random.default_rng(4)
    A_log = jnp.asarray(rng.uniform(0, 1, HV), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(HV if kind == "gdn" else HV * K), jnp.float32)
    gate = jaxcp.gate.Gate.SCALAR if kind == "gdn" else jaxcp.gate.Gate.CHANNEL
    decay = jaxcp.gate.decay_from_raw(gate, g_raw, A_log, dt_bias)
    got = recurrent(q, k, v, g_raw, beta, initial_state=h0, use_gate_in_kernel=True,
                    A_log=A_log, dt_bias=dt_bias)
    want = recurrent(q, k, v, decay, beta, initial_state=h0)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change,error,match", [
    (dict(state_indices=jnp.zeros((B,), jnp.int32)), ValueError, "pass the table"),
    (dict(initial_state=jnp.zeros((B, HV, K, K))), ValueError, "initial_state must be"),
    (dict(initial_state=jnp.zeros((B + 1, HV, K, V))), ValueError, "one state per batch row"),
    (dict(initial_state=jnp.zeros((4, HV, K, V)), state_indices=jnp.zeros((B,))), TypeError,
     "state_indices must be an int array"),
])
def test_recurrent_argument_errors(change, error, match):
    q, k, v, g, beta, _ = _inputs("gdn")
    with pytest.raises(error, match=match):
        jaxcp.recurrent_gated_delta_rule(q, k, v, g, beta, **change)


def test_recurrent_checks_shapes():
    q, k, v, g, beta, _ = _inputs("kda")
    with pytest.raises(ValueError, match="g must have shape"):
        jaxcp.recurrent_kda(q, k, v, g[..., :1], beta)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("normalize_qk", [True, False])
def test_fused_kernel_equals_the_recurrence(kind, normalize_qk):
    """The Pallas kernel (interpreted) gives the token recurrence's outputs and table, rows
    by index (-1 included) and without a table, q and k L2-normalised in the kernel or
    not."""
    _, recurrent = OPS[kind]
    q, k, v, g, beta, _ = _inputs(kind, batch=3, seed=5)
    args = [x[:, :3] for x in (q, k, v, g, beta)]
    table = jnp.asarray(np.random.default_rng(6).standard_normal((5, HV, K, V)), jnp.float32)
    idx = jnp.asarray([4, -1, 1], jnp.int32)
    for kw in (dict(initial_state=table, state_indices=idx), dict()):
        want = recurrent(*args, use_qk_l2norm_in_kernel=normalize_qk, **kw)
        got = recurrent(*args, use_qk_l2norm_in_kernel=normalize_qk, backend="interpret", **kw)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_recurrent_pallas_needs_a_gpu():
    q, k, v, g, beta, _ = _inputs("gdn")
    with pytest.raises(ValueError, match="interpret"):
        jaxcp.recurrent_gated_delta_rule(q, k, v, g, beta, backend="pallas")


def test_recurrent_fused_kernel_takes_power_of_two_head_dims():
    """backend="xla" takes any head dims; the fused kernel names what it takes."""
    q, k, v, g, beta, _ = _inputs("gdn")
    v = jnp.concatenate([v, v[..., :8]], axis=-1)
    o, state = jaxcp.recurrent_gated_delta_rule(q, k, v, g, beta, backend="xla")
    chex.assert_shape((o, state), (v.shape, (q.shape[0], HV, K, V + 8)))
    with pytest.raises(ValueError, match="powers of two"):
        jaxcp.recurrent_gated_delta_rule(q, k, v, g, beta, backend="interpret")
