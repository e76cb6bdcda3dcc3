"""A sequence run as segments on one device (``cp.segments``) == the unsplit op == the token
reference: o, final states and every gradient, both gates, packed sequences across segment
boundaries, with and without CP."""
import chex
import jax
import jax.numpy as jnp
import pytest

from helpers import (OPS, assert_rel, assert_sequences_isolated, cotangents, make_inputs,
                     value_and_grads)
from jaxcp.cp.segments import choose_segments
from jaxcp.gate import Gate
from test_cp import GRAD_NAMES, compare

# 96 tokens in 3 segments of 32 (2 chunks of 16): a 1-token sequence, a start exactly on a
# segment boundary (32), a sequence across the other boundary (64) between two neighbours
CU = [0, 1, 32, 40, 90, 96]


def _split_and_unsplit(kind, args, segments, backend, cu_seqlens=None):
    """(o, final state) and gradients of the op in `segments` and in one, and of the
    reference; chunks of 16 tokens. Packed: a NaN in one sequence reaches no other through
    the segments' merge (``assert_sequences_isolated``)."""
    op, ref = OPS[kind]
    B, T, HV, V = args[2].shape
    wo, wf = cotangents((B, T, HV, V), args[5].shape)
    kw = dict(cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    jitted = lambda f, **k: jax.jit(lambda *a: value_and_grads(f, a, wo, wf, **kw, **k))
    split = jitted(op, segments=segments, backend=backend, chunk_size=16)
    unsplit = jitted(op, segments=1, backend=backend, chunk_size=16)
    results = split(*args), unsplit(*args), jitted(ref)(*args)
    if cu_seqlens is not None:
        assert_sequences_isolated(kind, split, args, cu_seqlens, results[0])
    return results


def _check(split, unsplit, reference):
    (o, f), grads = split
    for name, a, r in zip(("o", "final state") + GRAD_NAMES, (o, f, *grads),
                          (*reference[0], *reference[1])):
        assert_rel(a, r, 1e-4, f"{name}: segments vs reference")
    chex.assert_trees_all_close(split, unsplit, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, backend", [("gdn", "interpret"), ("gdn", "xla"),
                                           ("kda", "xla")])
def test_segments_varlen(kind, backend):
    """Packed sequences in 3 segments, initial states (the Pallas kernels, which meet the
    segments as batch rows, through GDN's)."""
    args = make_inputs(kind, 1, 96, 1, 2, 16, 16, n_states=len(CU) - 1, seed=3)
    _check(*_split_and_unsplit(kind, args, 3, backend, jnp.asarray(CU, jnp.int32)))


@pytest.mark.parametrize("kind, backend", [("gdn", "interpret"), ("gdn", "xla"),
                                           ("kda", "xla")])
def test_segments_batch_rows(kind, backend):
    """B = 2 sequences in 3 segments of 50 tokens each: partial chunks in every row (the
    Pallas kernels, which both gates share for the rows, once)."""
    args = make_inputs(kind, 2, 150, 1, 2, 16, 16, n_states=2, seed=4)
    _check(*_split_and_unsplit(kind, args, 3, backend))


@pytest.mark.parametrize("kind, strategy, cp_layout, backend", [
    ("gdn", "allgather", "contiguous", None), ("kda", "allgather", "zigzag", None),
    ("gdn", "all_to_all", "contiguous", None), ("gdn", "allgather", "zigzag", "interpret")])
def test_segments_under_cp(kind, strategy, cp_layout, backend):
    """Each device's pieces in 2 segments, 4 devices: the merge composes the segments of
    every device in sequence order (``cp.exchange``); the gates share it."""
    cu = [0, 1, 20, 45, 140, 141, 160]
    args = make_inputs(kind, 1, 160, 4 if strategy == "all_to_all" else 2, 4, 16, 16,
                       n_states=len(cu) - 1, seed=5)
    compare(kind, 4, strategy, args, jnp.asarray(cu, jnp.int32), cp_layout=cp_layout,
            backend=backend, check_vma=backend is None, segments=2,
            single_device=backend is None)


@pytest.mark.parametrize("segments, match", [
    (0, "positive int"), (True, "positive int"), (2.0, "positive int"), (5, "must divide")])
def test_segments_bad_values(segments, match):
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 64, 1, 1, 16, 16)
    with pytest.raises(ValueError, match=match):
        OPS["gdn"][0](q, k, v, g, beta, segments=segments)


def test_segments_by_shape():
    """On the Pallas backend GDN splits where its state programs fill the GPU less than a
    quarter, KDA only across devices; other backends, head widths and short pieces stay
    whole."""
    pick = lambda **kw: choose_segments(None, **{
        **dict(backend="pallas", gate=Gate.SCALAR, across_devices=False, batch=1, heads=16,
               k_dim=128, v_dim=128, piece_len=131072), **kw})
    assert pick() == 4
    assert pick(heads=8) == 8
    assert pick(heads=32) == pick(heads=64) == pick(batch=4, piece_len=8192) == 1
    assert pick(k_dim=256, v_dim=256) == pick(k_dim=64, v_dim=64) == 1
    assert pick(piece_len=16384) == 1
    assert pick(gate=Gate.CHANNEL) == pick(backend="xla") == 1
    assert pick(gate=Gate.CHANNEL, across_devices=True) == pick(across_devices=True) == 4
    assert choose_segments(3, backend="xla", gate=Gate.CHANNEL, across_devices=False, batch=1,
                           heads=1, k_dim=16, v_dim=16, piece_len=48) == 3


@pytest.mark.parametrize("strategy, cp_layout, expected", [
    (None, None, dict(piece_len=64, heads=4, across_devices=False)),
    ("allgather", "contiguous", dict(piece_len=32, heads=4, across_devices=True)),
    ("allgather", "zigzag", dict(piece_len=16, heads=4, across_devices=True)),
    ("all_to_all", "contiguous", dict(piece_len=64, heads=2, across_devices=False))])
def test_segments_chosen_for_each_piece(strategy, cp_layout, expected, monkeypatch):
    """The op asks the rule about the piece it runs: its length, its value heads and whether
    an all-gather joins it to other devices' pieces."""
    import jaxcp.ops
    from test_cp import mesh_of
    asked = []
    monkeypatch.setattr(jaxcp.ops, "choose_segments",
                        lambda segments, **kw: asked.append(kw) or 1)
    q, k, v, g, beta, _ = make_inputs("kda", 1, 64, 2, 4, 16, 32)
    op = OPS["kda"][0]
    if strategy is None:
        op(q, k, v, g, beta, backend="xla")
    else:
        seq = jax.sharding.PartitionSpec(None, "seq")
        body = lambda *xs: op(*xs, backend="xla", cp_axis="seq", cp_strategy=strategy,
                              cp_layout=cp_layout)[0]
        jax.jit(jax.shard_map(body, mesh=mesh_of(2), in_specs=(seq,) * 5,
                              out_specs=seq))(q, k, v, g, beta)
    assert asked == [dict(backend="xla", gate=Gate.CHANNEL, batch=1, k_dim=16, v_dim=32,
                          **expected)]
