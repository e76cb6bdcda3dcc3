"""Context parallelism on 2, 4 and 8 fake CPU devices == single device == token reference."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh

import jaxcp
from helpers import (OPS, assert_rel, assert_sequences_isolated, cotangents, cp_call, make_inputs,
                     value_and_grads)

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# W -> (T_local, cu_seqlens). T_local is never a multiple of 64. Each layout has a 1-token
# sequence, a boundary exactly on a device boundary, and sequences crossing 1, 2 and 3+ devices.
LAYOUTS = {
    2: (100, [0, 1, 100, 101, 150, 200]),
    4: (40, [0, 1, 40, 45, 150, 151, 160]),
    8: (40, [0, 1, 40, 45, 150, 151, 300, 320]),
}


def mesh_of(W):
    return Mesh(np.array(jax.devices()[:W]), ("seq",))


def compare(kind, W, strategy, args, cu, *, check_vma=True, tol=1e-4, backend=None,
            tol_single=None, single_device=True, cp_layout="contiguous", segments=None):
    """CP against the reference and (single_device) the single-device op, to tol_single
    (default tol); segments: the CP call's (``cp.segments``). With cu, a NaN in one packed
    sequence reaches no other, under CP and on one device (``assert_sequences_isolated``)."""
    tol_single = tol if tol_single is None else tol_single
    op, ref = OPS[kind]
    B, T, HV, V = args[2].shape
    wo, wf = cotangents((B, T, HV, V), (args[5].shape))
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    cp = cp_call(op, mesh_of(W), "seq", cp_strategy=strategy, check_vma=check_vma,
                 backend=backend, cp_layout=cp_layout, segments=segments, **kw)
    run_cp = jax.jit(lambda *a: value_and_grads(cp, a, wo, wf))
    (o_cp, f_cp), g_cp = clean_cp = run_cp(*args)
    (o_r, f_r), g_r = jax.jit(lambda *a: value_and_grads(ref, a, wo, wf, **kw))(*args)
    assert_rel(o_cp, o_r, tol, "o: CP vs reference")
    assert_rel(f_cp, f_r, tol, "final state: CP vs reference")
    for name, a, r in zip(GRAD_NAMES, g_cp, g_r):
        assert_rel(a, r, tol, f"{name}: CP vs reference")
    if cu is not None:
        assert_sequences_isolated(kind, run_cp, args, cu, clean_cp)
    if not single_device:
        return
    run_1 = jax.jit(lambda *a: value_and_grads(op, a, wo, wf, backend=backend, **kw))
    (o_1, f_1), g_1 = clean_1 = run_1(*args)
    if cu is not None:
        assert_sequences_isolated(kind, run_1, args, cu, clean_1)
    assert_rel(o_cp, o_1, tol_single, "o: CP vs single device")
    assert_rel(f_cp, f_1, tol_single, "final state: CP vs single device")
    for name, a, b in zip(GRAD_NAMES, g_cp, g_1):
        assert_rel(a, b, tol_single, f"{name}: CP vs single device")


@pytest.mark.parametrize("kind, W, strategy", [
    *((kind, 2, s) for kind in ("gdn", "kda") for s in ("allgather", "all_to_all", "relay")),
    ("gdn", 8, "allgather"), ("gdn", 8, "all_to_all")])
def test_cp_varlen(kind, W, strategy):
    """The strategies on the XLA stages with check_vma on; W = 8 through GDN (the merge of
    the maps and all_to_all's one head per device are the same for both gates); W = 4 runs every
    strategy through the Pallas kernels (test_cp_varlen_pallas_interpret), relay's
    hand-offs across a sequence of 3+ devices included."""
    T_local, cu = LAYOUTS[W]
    args = make_inputs(kind, 1, W * T_local, 8 if strategy == "all_to_all" else 2, 8, 16, 32,
                       n_states=len(cu) - 1, seed=W)
    compare(kind, W, strategy, args, jnp.asarray(cu, jnp.int32))


# zigzag: W -> (T_local, cu_seqlens) with pieces of T_local / 2 = 20 tokens: a 1-token
# sequence, starts on piece boundaries (20, 140) and inside pieces, sequences across
# several pieces (and so across devices in both directions)
ZIGZAG_LAYOUTS = {
    4: (40, [0, 1, 20, 45, 140, 141, 160]),
    8: (40, [0, 1, 40, 45, 150, 151, 300, 320]),
}


@pytest.mark.parametrize("kind, W, strategy", [
    *((kind, 4, s) for kind in ("gdn", "kda") for s in ("allgather", "all_to_all")),
    ("gdn", 8, "allgather")])
def test_cp_zigzag_varlen(kind, W, strategy):
    """The zigzag layout (device r holds pieces r and 2W - 1 - r) equals the reference and
    one device: o, final states and every gradient, initial states included (W = 8 through
    GDN, as above)."""
    T_local, cu = ZIGZAG_LAYOUTS[W]
    args = make_inputs(kind, 1, W * T_local, 8 if strategy == "all_to_all" else 2, 8, 16, 32,
                       n_states=len(cu) - 1, seed=W + 20)
    compare(kind, W, strategy, args, jnp.asarray(cu, jnp.int32), cp_layout="zigzag")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_cp_zigzag_pallas_interpret(kind):
    """Zigzag through the Pallas kernels in interpret mode: B = 2 rows without cu_seqlens,
    and pieces of whole chunks (the kernels read the rows in place)."""
    args = make_inputs(kind, 2, 2 * 128, 2, 2, 16, 16, n_states=2, seed=31)
    compare(kind, 2, "allgather", args, None, check_vma=False, backend="interpret",
            single_device=False, cp_layout="zigzag")


@pytest.mark.parametrize("strategy", ["allgather", "relay"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_cp_batched_without_varlen(kind, strategy):
    """B = 2 rows, each one sequence spanning all 4 devices; check_vma off."""
    args = make_inputs(kind, 2, 4 * 50, 2, 4, 32, 16, n_states=2)
    compare(kind, 4, strategy, args, None, check_vma=False)


def test_cp_bf16():
    T_local, cu = LAYOUTS[4]
    args = make_inputs("gdn", 1, 4 * T_local, 2, 2, 32, 32, dtype=jnp.bfloat16, n_states=len(cu) - 1)
    args = args[:5] + (args[5],)
    compare("gdn", 4, "allgather", tuple(x.astype(jnp.float32) if x.dtype == jnp.float32 else x
                                         for x in args), jnp.asarray(cu, jnp.int32), tol=1e-2)


def test_cp_bf16_pallas_interpret_is_the_single_device_computation():
    """bf16 through the Pallas kernels, the device boundary on a chunk boundary of the
    sequence crossing it: each device runs the very chunks of the single-device call, so CP
    equals it to rounding (the backward's w, u, recomputed from the kept inverse, are the
    forward's numbers)."""
    cu = jnp.asarray([0, 1, 64, 250, 256], jnp.int32)
    args = make_inputs("gdn", 1, 256, 2, 2, 32, 32, dtype=jnp.bfloat16, n_states=4)
    compare("gdn", 2, "allgather", args, cu, check_vma=False, backend="interpret", tol=1e-2,
            tol_single=1e-6)


def test_cp_without_initial_state_or_final_state():
    op, _ = OPS["gdn"]
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 4 * 40, 1, 1, 16, 16)
    cu = jnp.asarray(LAYOUTS[4][1], jnp.int32)
    seq = jax.sharding.PartitionSpec(None, "seq")

    def body(q, k, v, g, beta):
        return op(q, k, v, g, beta, cu_seqlens=cu, cp_axis="seq")[0]

    f = jax.shard_map(body, mesh=mesh_of(4), in_specs=(seq,) * 5, out_specs=seq)
    o_cp = jax.jit(f)(q, k, v, g, beta)
    o_1, final = op(q, k, v, g, beta, cu_seqlens=cu)
    assert final is None
    assert_rel(o_cp, o_1, 1e-4, "o")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_cp_pallas_gradients_trace_under_check_vma(kind, monkeypatch):
    """The Pallas ops (backend="pallas", traced, not run: interpret mode cannot run under
    check_vma) differentiate under shard_map(check_vma=True) with the gate computed in the
    op: every custom_vjp gives its cotangents the vma types of its inputs, the replicated
    A_log and dt_bias included. q, k are L2-normalised (KDA: by the unit-row kernels)."""
    monkeypatch.setattr(jaxcp.checks, "gpu_present", lambda: True)    # traced, not run
    op, _ = OPS[kind]
    K = 16
    q, k, v, g, beta, _ = make_inputs(kind, 1, 2 * 64, 2, 2, K, K)
    HV = v.shape[2]
    params = (jnp.zeros((HV,)), jnp.zeros((HV * (K if kind == "kda" else 1),)))
    seq, rep = jax.sharding.PartitionSpec(None, "seq"), jax.sharding.PartitionSpec()

    def loss(q, k, v, g, beta, A_log, dt_bias):
        o = op(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
               use_qk_l2norm_in_kernel=True, cp_axis="seq", backend="pallas")[0]
        return jax.lax.psum(jnp.sum(o * o), "seq")

    f = jax.shard_map(loss, mesh=mesh_of(2), in_specs=(seq,) * 5 + (rep, rep), out_specs=rep,
                      check_vma=True)
    jax.make_jaxpr(jax.grad(f, argnums=tuple(range(7))))(q, k, v, g, beta, *params)


@pytest.mark.parametrize("kind, W, strategy", [
    ("gdn", 4, "allgather"), ("kda", 4, "allgather"), ("gdn", 4, "all_to_all"),
    ("gdn", 4, "relay")])
def test_cp_varlen_pallas_interpret(kind, W, strategy):
    """The layout of 4 devices (first, middle and last devices; a start on a device
    boundary; a sequence across several devices: what each device's kernels see at W = 8
    too, which the XLA stages run) through the Pallas kernels in interpret mode (which
    needs shard_map's check_vma=False in JAX 0.11), against the reference (the
    single-device kernels meet it in test_chunk, and CP equals one device on the XLA
    stages here and to 1e-6 through the kernels in the bf16 test above). allgather meets
    both gates' kernels; all_to_all and relay, which run the same stages for either gate,
    meet GDN's."""
    T_local, cu = LAYOUTS[W]
    args = make_inputs(kind, 1, W * T_local, 8 if strategy == "all_to_all" else 2, 8, 16, 16,
                       n_states=len(cu) - 1, seed=W + 10)
    compare(kind, W, strategy, args, jnp.asarray(cu, jnp.int32), check_vma=False,
            backend="interpret", single_device=False)


@pytest.mark.parametrize("strategy", ["allgather", "all_to_all", "relay"])
def test_cp_token_major_pallas_interpret(strategy):
    """GDN without cu_seqlens and whole chunks per device: the Pallas kernels read q, k, v,
    g, beta and write o in place ([B, T, HV, D] reshaped), under CP; against the reference
    as above."""
    args = make_inputs("gdn", 2, 2 * 64, 2, 2, 16, 16, n_states=2)
    compare("gdn", 2, strategy, args, None, check_vma=False, backend="interpret",
            single_device=False)
