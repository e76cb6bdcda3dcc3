"""Each Pallas stage (interpret mode on the CPU) against its XLA twin."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp import xla
from jaxcp.l2norm import l2_normalize
from jaxcp.layout import build_layout, num_chunks, to_chunks
from jaxcp.pallas import grads as pgrads
from jaxcp.pallas import intra as pintra
from jaxcp.pallas import state as pstate
from helpers import assert_rel, make_inputs

KINDS = ["gdn", "kda"]


def token_major(x):
    """[NT, B, HV, C, ...] <-> [B, NT, C, HV, ...] (the permutation is its own inverse)."""
    return jnp.moveaxis(x, (0, 1, 2, 3), (1, 0, 3, 2))


def plain(terms, tm):
    """Row-factored terms (bare q, k token-major when tm) in the plain chunk-layout form."""
    if tm:
        terms = terms._replace(qg=token_major(terms.qg), kd=token_major(terms.kd))
    return terms.tiles()


def assert_terms(got, want, tol):
    for name in want._fields:
        if getattr(want, name) is not None:
            assert_rel(getattr(got, name), getattr(want, name), tol, name)


def chunk_terms(kind, cu, T, HV=2, K=16, V=32, C=16, with_init=True, device=0, world=1,
                gate_scale=1.0):
    q, k, v, g, beta, h0 = make_inputs(kind, 1, T, HV, HV, K, V, n_states=len(cu) - 1)
    g = g * gate_scale
    if kind == "gdn":
        g = g[..., None]
    cu = jnp.asarray(cu, jnp.int32)
    layout, tmap = build_layout(1, T, C, cu, device * T, world * T)
    NT = num_chunks(T, C, cu.shape[0] - 1)
    ch = lambda x: to_chunks(x, tmap, NT, C)
    terms = xla.intra_chunk(ch(q), ch(k) / 4, ch(v), ch(g), ch(beta), K ** -0.5)
    return terms, layout, (h0 if with_init else None)


CU = [0, 1, 20, 37, 70]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_init", [True, False])
def test_state_fwd(kind, with_init):
    terms, layout, init = chunk_terms(kind, CU, 70, with_init=with_init)
    h0 = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 16, 32)), jnp.float32)
    want = xla.state_fwd(terms, layout, init, h0)
    got = pstate.state_fwd(terms, layout, init, h0, interpret=True)
    for name, a, b in zip(("h", "v_new", "last"), got, want):
        assert_rel(a, b, 1e-5, name)
    assert_rel(pstate.state_last(terms, layout, init, h0, interpret=True), want[2], 1e-5, "last")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_init", [True, False])
def test_state_output(kind, with_init):
    # the last device of two: sequence 0 ends on the device before, its final state is zero
    terms, layout, init = chunk_terms(kind, [0, 50, 72, 90, 140], 70, with_init=with_init,
                                      device=1, world=2)
    h0 = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 16, 32)), jnp.float32)
    want = xla.state_output(terms, layout, init, h0, True)
    got = pstate.state_output(terms, layout, init, h0, True, interpret=True)
    assert float(jnp.abs(want[1][0]).max()) == 0.0
    for name, a, b in zip(("o", "finals"), got, want):
        assert_rel(a, b, 1e-5, name)
    assert pstate.state_output(terms, layout, init, h0, False, interpret=True)[1] is None
    o_tm = pstate.state_output(terms, layout, init, h0, False, token_major=True, interpret=True)
    assert_rel(token_major(o_tm[0]), want[0], 1e-5, "o token-major")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cu", [[0, 210], [0, 90, 100, 210]])
def test_cp_summary(kind, cu):
    """The middle device of three. Inside one sequence: a non-zero transition M. With
    sequences starting at tokens 90 and 100 of this device's [70, 140): M is zero, and S_ext
    comes from the chunks after the last start alone (the kernels skip the others)."""
    terms, layout, init = chunk_terms(kind, cu, 70, device=1, world=3, gate_scale=0.02)
    got = pstate.cp_summary(terms, layout, init, interpret=True)
    want = xla.cp_summary(terms, layout, init)
    assert float(jnp.abs(got[0]).max()) > 0.01
    assert_rel(got[0], want[0], 1e-5, "S_ext")
    if len(cu) == 2:
        assert float(jnp.abs(got[1]).max()) > 0.01
        assert_rel(got[1], want[1], 1e-5, "M")
    else:
        assert float(jnp.abs(want[1]).max()) == 0.0
        assert float(jnp.abs(got[1]).max()) == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry_only, device", [(True, 0), (False, 0), (False, 1)])
def test_state_bwd(kind, entry_only, device):
    # device 1 of 2: sequence 0 started on the device before, its d_init row is zero here
    cu = CU if device == 0 else [0, 50, 72, 90, 140]
    terms, layout, init = chunk_terms(kind, cu, 70, device=device, world=device + 1)
    rng = np.random.default_rng(4)
    do = jnp.asarray(rng.standard_normal(terms.u.shape), jnp.float32)
    d_final = jnp.asarray(rng.standard_normal(init.shape), jnp.float32)
    d_last = jnp.asarray(rng.standard_normal((1, 2, 16, 32)), jnp.float32)
    want = xla.state_bwd(terms, layout, do, d_final, d_last, with_d_init=True,
                         entry_only=entry_only)
    got = pstate.state_bwd(terms, layout, do, d_final, d_last, with_d_init=True,
                           entry_only=entry_only, interpret=True)
    if entry_only:
        got_tm = pstate.state_bwd(terms, layout, token_major(do), d_final, d_last,
                                  entry_only=True, token_major=True, interpret=True)
        assert_rel(got_tm, want, 1e-5, "d_entry token-major")
        want, got = (want,), (got,)
    else:
        assert pstate.state_bwd(terms, layout, do, d_final, d_last, interpret=True)[1] is None
        got_tm = pstate.state_bwd(terms, layout, token_major(do), d_final, d_last,
                                  with_d_init=True, token_major=True, interpret=True)
        for name, a, b in zip(("d_entry", "d_init", "x", "dvn"), got_tm, want):
            assert_rel(a, b, 1e-5, name + " token-major")
        assert (float(jnp.abs(got[1][0]).max()) == 0.0) == (device == 1)
    for name, a, b in zip(("d_entry", "d_init", "x", "dvn"), got, want):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("C, tm, correlated", [(16, False, False), (64, False, False),
                                               (16, True, False), (64, False, True)])
def test_intra_chunk_gdn(C, tm, correlated):
    """correlated: unit keys sharing a direction, weak decay, where the inverse's intermediate
    terms must stay bounded (a power series in A loses everything in fp32 here)."""
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 70, 2, 2, 32, 16, correlated_keys=correlated)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) if correlated else k / 6
    layout, tmap = build_layout(1, 70, C, None, 0, 70)
    ch = lambda x: to_chunks(x, tmap, num_chunks(70, C, None), C)
    args = (ch(q), ch(k), ch(v), ch(g[..., None]), ch(beta))
    want = xla.intra_chunk(*args, 0.25, with_inverse=True)
    tm_args = tuple(map(token_major, args)) if tm else args
    got = pintra.intra_chunk(*tm_args, 0.25, with_inverse=True, token_major=tm, interpret=True)
    assert pintra.intra_chunk(*args, 0.25, interpret=True).inv is None
    assert float(jnp.abs(want.inv).max()) < 2.0
    assert_terms(plain(got, tm), want, 1e-5)


@pytest.mark.parametrize("C, K, V, tm", [(16, 32, 16, False), (64, 128, 128, False),
                                         (16, 32, 16, True)])
def test_chunk_grads_gdn(C, K, V, tm):
    """K, V = 128: the kernel's loops over blocks of 64 key and value columns."""
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 70, 2, 2, K, V)
    layout, tmap = build_layout(1, 70, C, None, 0, 70)
    NT = num_chunks(70, C, None)
    ch = lambda x: to_chunks(x, tmap, NT, C)
    args = (ch(q), ch(k) / 6, ch(v), ch(g[..., None]), ch(beta))
    rng = np.random.default_rng(5)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    # h, X [NT, B, HV, K, V]; v_new, dvn, do [NT, B, HV, C, V]
    rest = (r(NT, 1, 2, K, V), r(NT, 1, 2, C, V), r(NT, 1, 2, K, V), r(NT, 1, 2, C, V),
            r(NT, 1, 2, C, V))
    terms = xla.intra_chunk(*args, 0.25, with_inverse=True)
    want = xla.chunk_grads(*args, 0.25, terms, *rest)
    if tm:
        got = pgrads.chunk_grads(*map(token_major, args), 0.25, terms, *rest[:4],
                                 token_major(rest[4]), token_major=True, interpret=True)
        got = tuple(map(token_major, got))
    else:
        got = pgrads.chunk_grads(*args, 0.25, terms, *rest, interpret=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("tm", [False, True])
def test_normalize_qk_in_kernels(tm):
    """normalize_qk: raw q, k in; the terms of their L2-normalised rows, and the cotangents of
    the raw q, k (the normalisation's vjp), equal to l2_normalize outside the XLA twins.
    K = 128: the row norms span two blocks of key columns."""
    C, K, V = 64, 128, 64
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 128, 2, 2, K, V)
    q, k = 3 * q, k / 2          # rows far from unit norm
    layout, tmap = build_layout(1, 128, C, None, 0, 128)
    NT = num_chunks(128, C, None)
    ch = lambda x: to_chunks(x, tmap, NT, C)
    args = (ch(q), ch(k), ch(v), ch(g[..., None]), ch(beta))
    unit = lambda q, k: (l2_normalize(q), l2_normalize(k))
    want = xla.intra_chunk(*unit(*args[:2]), *args[2:], 0.25, with_inverse=True)
    run_args = tuple(map(token_major, args)) if tm else args
    got = pintra.intra_chunk(*run_args, 0.25, with_inverse=True, token_major=tm, interpret=True,
                             normalize_qk=True)
    assert_terms(plain(got, tm), want, 1e-5)

    rng = np.random.default_rng(6)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    rest = (r(NT, 1, 2, K, V), r(NT, 1, 2, C, V), r(NT, 1, 2, K, V), r(NT, 1, 2, C, V),
            r(NT, 1, 2, C, V))
    (qn, kn), unit_vjp = jax.vjp(unit, *args[:2])
    dqn, dkn, *others = xla.chunk_grads(qn, kn, *args[2:], 0.25, want, *rest)
    want_grads = (*unit_vjp((dqn, dkn)), *others)
    if tm:
        got = pgrads.chunk_grads(*run_args, 0.25, want, *rest[:4], token_major(rest[4]),
                                 token_major=True, interpret=True, normalize_qk=True)
        got = tuple(map(token_major, got))
    else:
        got = pgrads.chunk_grads(*args, 0.25, want, *rest, interpret=True, normalize_qk=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want_grads):
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("tm", [False, True])
def test_state_kernels_read_row_factored_terms(tm):
    """The state kernels on the intra kernel's row-factored terms (bare q, k, token-major
    when tm) equal them on the same terms as plain tiles: output, stored states, CP summary
    and the reverse recurrence."""
    C, K, V = 16, 32, 16
    q, k, v, g, beta, h0 = make_inputs("gdn", 1, 64, 2, 2, K, V, n_states=1)
    layout, tmap = build_layout(1, 64, C, None, 0, 64)
    ch = lambda x: to_chunks(x, tmap, num_chunks(64, C, None), C)
    args = (ch(q), ch(k) / 6, ch(v), ch(g[..., None]), ch(beta))
    factored = pintra.intra_chunk(*(map(token_major, args) if tm else args), 0.25,
                                  token_major=tm, interpret=True)
    tiles = plain(factored, tm)
    do = jnp.asarray(np.random.default_rng(7).standard_normal(tiles.u.shape), jnp.float32)
    kw = dict(interpret=True)
    runs = [
        ("state_output", lambda t, tm: pstate.state_output(t, layout, h0, h0, True,
                                                           token_major=tm, **kw)),
        ("state_fwd", lambda t, tm: pstate.state_fwd(t, layout, h0, h0, token_major=tm, **kw)),
        ("cp_summary", lambda t, tm: pstate.cp_summary(t, layout, h0, token_major=tm, **kw)),
        ("state_bwd", lambda t, tm: pstate.state_bwd(t, layout, token_major(do) if tm else do,
                                                     h0, h0, with_d_init=True, token_major=tm,
                                                     **kw)),
    ]
    for name, run in runs:
        for i, (a, b) in enumerate(zip(run(factored, tm), run(tiles, tm))):
            assert_rel(a, b, 1e-5, f"{name} output {i}")


def test_token_major_only_for_pallas_gdn():
    from jaxcp.stages import stages_for
    with pytest.raises(ValueError, match="token_major"):
        stages_for("xla", "float32", True)
    q, k, v, g, beta, _ = make_inputs("kda", 1, 64, 1, 1, 16, 16)
    tm = lambda x: x.reshape(1, 1, 64, *x.shape[2:])
    with pytest.raises(ValueError, match="token_major"):
        stages_for("interpret", "float32", True).intra(*map(tm, (q, k, v, g, beta)), 0.25)


def test_cp_summary_keeps_the_transition_fp32_accurate_with_bf16_tiles():
    """bf16 tiles (bf16 inputs): the transition M still meets them as fp32 (two bf16 parts),
    within fp32 tolerance of the XLA twin on the same bf16 values."""
    terms, layout, init = chunk_terms("gdn", [0, 210], 70, device=1, world=3, gate_scale=0.02)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    rounded = terms._replace(w=bf16(terms.w), kd=bf16(terms.kd), u=bf16(terms.u))
    exact = rounded._replace(w=rounded.w.astype(jnp.float32), kd=rounded.kd.astype(jnp.float32),
                             u=rounded.u.astype(jnp.float32))
    m = pstate.cp_summary(rounded, layout, init, interpret=True, dot_dtype=jnp.bfloat16)[1]
    want = xla.cp_summary(exact, layout, init)[1]
    assert float(jnp.abs(want - jnp.eye(16)).max()) > 0.01
    assert_rel(m, want, 1e-4, "M")
