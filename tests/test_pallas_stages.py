"""Each Pallas stage (interpret mode on the CPU) against its XLA twin."""
from dataclasses import replace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcp import xla
from jaxcp.gate import Gate, decay_from_raw
from jaxcp.l2norm import l2_normalize, normalized_copy
from jaxcp.layout import build_layout, from_chunks, num_chunks, to_chunks
from jaxcp.pallas.triton.common import l2norm as l2norm_kernels, state as pstate
from jaxcp.pallas.triton.common.launch import ChunkBlocks, RowBlocks, StateBlocks
from jaxcp.pallas.triton.common.products import Fp32Products, KernelPrecision, dots
from jaxcp.pallas.triton.gdn import grads as pgdn_grads, intra as pgdn_intra
from jaxcp.pallas.triton.kda import gate_cumsum, grads as pkda_grads, intra as pkda_intra
from jaxcp.stages import (StageOptions, _gdn_precision, _kda_precision, stages_for,
                          state_kernel_precision)
from helpers import assert_rel, make_inputs, rel_err

KINDS = ["gdn", "kda"]
GATES = {"gdn": Gate.SCALAR, "kda": Gate.CHANNEL}


def token_layout(T, C, cu=None, device=0, world=1):
    """The layout of a device's T tokens and the two conversions: tokens [B, T, HV, ...] ->
    chunk layout [NT, B, HV, C, ...] (padding zero) and back."""
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    B = 1
    layout, tmap = build_layout(B, T, C, cu, device * T, world * T)
    NT = num_chunks(T, C, None if cu is None else cu.shape[0] - 1)
    return layout, (lambda x: to_chunks(x, tmap, NT, C)), (lambda y: from_chunks(y, tmap, T))


def plain(terms, chunks):
    """Row-factored terms (bare q, k token-major) in the plain chunk-layout form."""
    return terms._replace(qg=chunks(terms.qg), kd=chunks(terms.kd)).tiles()


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
    terms = xla.intra_chunk(ch(q), ch(k) / 4, ch(v), ch(g), ch(beta), K ** -0.5,
                            gate=GATES[kind])
    return terms, layout, (h0 if with_init else None)


CU = [0, 1, 20, 37, 70]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_init", [True, False])
def test_state_fwd(kind, with_init):
    terms, layout, init = chunk_terms(kind, CU, 70, with_init=with_init)
    h0 = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 16, 32)), jnp.float32)
    want = xla.state_fwd(terms, layout, init, h0)
    got = pstate.state_fwd(terms, layout, init, h0, gate=GATES[kind], interpret=True)
    for name, a, b in zip(("h", "v_new", "last"), got, want):
        assert_rel(a, b, 1e-5, name)
    assert_rel(pstate.state_last(terms, layout, init, h0, gate=GATES[kind], interpret=True), want[2], 1e-5, "last")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_init, blocks", [(True, None), (False, None),
                                               (True, StateBlocks(block_cols=16))])
def test_state_output(kind, with_init, blocks):
    """The last device of two: sequence 0 ends on the device before, its final state is
    zero. blocks: the 32 state columns in two programs of 16."""
    terms, layout, init = chunk_terms(kind, [0, 50, 72, 90, 140], 70, with_init=with_init,
                                      device=1, world=2)
    h0 = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 16, 32)), jnp.float32)
    want = xla.state_output(terms, layout, init, h0, True)
    got = pstate.state_output(terms, layout, init, h0, True, gate=GATES[kind], interpret=True,
                              blocks=blocks)
    assert float(jnp.abs(want[1][0]).max()) == 0.0
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert pstate.state_output(terms, layout, init, h0, False, gate=GATES[kind],
                                interpret=True)[1] is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cu", [[0, 210], [0, 90, 100, 210]])
@pytest.mark.parametrize("one_launch", [True, False])
def test_cp_summary(kind, cu, one_launch):
    """The middle device of three. Inside one sequence: a non-zero transition M. With
    sequences starting at tokens 90 and 100 of this device's [70, 140): M is zero, and S_ext
    comes from the chunks after the last start alone (the kernels skip the others). S_ext
    and M in one launch or in two."""
    terms, layout, init = chunk_terms(kind, cu, 70, device=1, world=3, gate_scale=0.02)
    got = pstate.cp_summary(terms, layout, init, gate=GATES[kind], interpret=True,
                            one_launch=one_launch)
    want = xla.cp_summary(terms, layout, init)
    assert float(jnp.abs(got[0]).max()) > 0.01
    assert_rel(got[0], want[0], 1e-5, "S_ext")
    if len(cu) == 2:
        assert float(jnp.abs(got[1]).max()) > 0.01
        assert_rel(got[1], want[1], 1e-5, "M")
    else:
        assert float(jnp.abs(want[1]).max()) == 0.0
        assert float(jnp.abs(got[1]).max()) == 0.0


def test_cp_summary_one_launch_where_the_programs_fill_the_gpu_once():
    """S_ext and M share a launch where their programs fit the GPU once and the launch
    keeps both halves' products (float16 tiles: yes; fp32 tiles at single TF32, KDA's bf16
    inputs without unit keys: M needs 3xTF32, so no)."""
    fits = pstate._one_launch_fits
    bf16 = KernelPrecision(dot_dtype=jnp.bfloat16, tile_dtype=jnp.bfloat16)
    kda = KernelPrecision(tile_dtype=jnp.float16, products=Fp32Products.TF32)
    assert fits(bf16, 128) and fits(kda, 64) and fits(KernelPrecision(), 128)
    assert not fits(bf16, 256)
    assert not fits(KernelPrecision(products=Fp32Products.TF32), 64)


def test_split_per_program_is_the_unsplit_product_where_false():
    """``products.dot`` with a traced split (one launch, two kinds of programs): where false
    it is the unsplit product (the state rounded to bf16), where true the split one."""
    from jaxcp.pallas.triton.common.products import dot
    rng = np.random.default_rng(5)
    tile = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    for flag in (False, True):
        got = jax.jit(lambda s, f: dot(tile, s, interpret=True, split=f))(state, jnp.bool_(flag))
        np.testing.assert_array_equal(got, dot(tile, state, interpret=True, split=flag))
    assert float(jnp.abs(dot(tile, state, interpret=True, split=True)
                         - dot(tile, state, interpret=True)).max()) > 0


@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1.0, 1e6, 1e30])
def test_scaled_float16_products_keep_tf32_digits_at_every_magnitude(magnitude):
    """``scaled_float16_dot`` of a float16 tile and an fp32 operand, on either side: within
    TF32's rounding of the fp32 product at magnitudes from 1e-30 to 1e30 (float16 alone
    spans 6e-8 to 65504); zeros give zeros, a NaN a non-finite product."""
    from jaxcp.pallas.triton.common.products import scaled_float16_dot
    rng = np.random.default_rng(6)
    tile = jnp.asarray(rng.uniform(-1, 1, (64, 32)), jnp.float16)
    x = jnp.asarray(rng.standard_normal((32, 16)) * magnitude, jnp.float32)
    exact = lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST)
    for got, want in ((scaled_float16_dot(tile, x), exact(tile, x)),
                      (scaled_float16_dot(x.T, tile.T), exact(x.T, tile.T))):
        assert_rel(got, want, 2e-3, "scaled float16 product")
    zeros = jnp.zeros_like(x)
    chex.assert_trees_all_equal(scaled_float16_dot(tile, zeros), exact(tile, zeros))
    assert not bool(jnp.isfinite(scaled_float16_dot(tile, x.at[3, 4].set(jnp.nan))).any())


def test_scaled_float16_products_within_their_bound_where_columns_lie_far_apart():
    """A block whose columns lie 2^20 apart: the small columns keep only an absolute error
    under 2^-25 of the block's largest entry, each product entry within
    sum_k |t_k| (2^-12 |x_k| + 2^-25 max |x|) of float32 (``scaled_float16_dot``)."""
    from jaxcp.pallas.triton.common.products import scaled_float16_dot
    rng = np.random.default_rng(7)
    tile = jnp.asarray(rng.uniform(-1, 1, (64, 32)), jnp.float16)
    x = rng.standard_normal((32, 16)) * np.where(np.arange(16) < 8, 1.0, 2.0 ** -20)
    x = jnp.asarray(x, jnp.float32)
    t32 = np.abs(np.asarray(tile, np.float64))
    want = np.asarray(tile, np.float64) @ np.asarray(x, np.float64)
    bound = t32 @ (2.0 ** -12 * np.abs(np.asarray(x, np.float64))
                   + 2.0 ** -25 * float(jnp.abs(x).max()))
    err = np.abs(np.asarray(scaled_float16_dot(tile, x), np.float64) - want)
    assert float((err / bound).max()) <= 1.0
    assert float(err[:, 8:].max()) > 0      # the small columns do lose bits


def test_kda_state_kernels_take_scaled_float16_products_but_state_fwd():
    """KDA's bf16 stages with unit q, k (float16 tiles): scaled float16 products in every
    state kernel but state_fwd; none with float32 tiles or for GDN."""
    kernels = ("state_output", "state_fwd", "state_last", "cp_summary", "state_bwd")
    scaled = lambda p: [state_kernel_precision(name, p).scaled_float16 for name in kernels]
    opts = lambda gate, unit: StageOptions("pallas", gate, "bfloat16", chunk_size=64,
                                           unit_qk=unit)
    assert scaled(_kda_precision(opts(Gate.CHANNEL, True))) == [True, False, True, True, True]
    assert not any(scaled(_kda_precision(opts(Gate.CHANNEL, False))))
    assert not any(scaled(_gdn_precision(opts(Gate.SCALAR, True))))


def test_unused_summaries_are_zero():
    """A summary nobody reads (the last device's (S_ext, M), the first device's entry
    cotangent) is zero in both twins; the kernels run no chunk for it (the state kernels
    are the same code for both gates: GDN here)."""
    terms, layout, init = chunk_terms("gdn", [0, 210], 70, device=1, world=3, gate_scale=0.02)
    do = jnp.asarray(np.random.default_rng(4).standard_normal(terms.u.shape), jnp.float32)
    d_last = jnp.zeros((1, 2, 16, 32), jnp.float32)
    for flag in (jnp.bool_(True), jnp.bool_(False)):
        got = (*pstate.cp_summary(terms, layout, init, gate=Gate.SCALAR, unused=flag,
                                  interpret=True),
               pstate.state_bwd(terms, layout, do, None, d_last, gate=Gate.SCALAR,
                                entry_only=True, unused=flag, interpret=True))
        want = (*xla.cp_summary(terms, layout, init, unused=flag),
                xla.state_bwd(terms, layout, do, None, d_last, entry_only=True, unused=flag))
        for name, a, b in zip(("S_ext", "M", "d_entry"), got, want):
            if flag:
                assert float(jnp.abs(a).max()) == float(jnp.abs(b).max()) == 0.0, name
            else:
                assert float(jnp.abs(a).max()) > 0.01, name
                assert_rel(a, b, 1e-5, name)


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
    got = pstate.state_bwd(terms, layout, do, d_final, d_last, gate=GATES[kind],
                           with_d_init=True, entry_only=entry_only, interpret=True)
    if entry_only:
        want, got = (want,), (got,)
    else:
        assert pstate.state_bwd(terms, layout, do, d_final, d_last, gate=GATES[kind],
                                interpret=True)[1] is None
        assert (float(jnp.abs(got[1][0]).max()) == 0.0) == (device == 1)
    for name, a, b in zip(("d_entry", "d_init", "x", "dvn"), got, want):
        assert_rel(a, b, 1e-5, name)


def test_kda_state_kernels_read_float16_tiles():
    """With tile_dtype float16 the state kernels read w, kd, qg and attn in float16 and
    compute in float32: the XLA twin's numbers on the terms rounded to float16."""
    terms, layout, init = chunk_terms("kda", CU, 70)
    rounded = terms._replace(**{name: getattr(terms, name).astype(jnp.float16)
                                .astype(jnp.float32) for name in ("w", "kd", "qg", "attn")})
    rng = np.random.default_rng(4)
    h0 = jnp.asarray(rng.standard_normal((1, 2, 16, 32)), jnp.float32)
    do = jnp.asarray(rng.standard_normal(terms.u.shape), jnp.float32)
    kw = dict(gate=Gate.CHANNEL, interpret=True,
              precision=KernelPrecision(tile_dtype=jnp.float16))
    got = (pstate.state_output(terms, layout, init, h0, True, **kw)
           + pstate.state_fwd(terms, layout, init, h0, **kw)
           + pstate.state_bwd(terms, layout, do, None, h0, **kw))
    want = (xla.state_output(rounded, layout, init, h0, True)
            + xla.state_fwd(rounded, layout, init, h0)
            + xla.state_bwd(rounded, layout, do, None, h0))
    for name, a, b in zip(("o", "finals", "h", "v_new", "last", "d_entry", "d_init", "x",
                           "dvn"), got, want):
        if b is not None:
            assert a.dtype == jnp.float32, name
            assert_rel(a, b, 1e-5, name)


# token layouts of the kernels' tests: T a multiple of C; a last chunk of 6 tokens; packed
# sequences (chunks that start mid-chunk and end early, one of a single token)
LAYOUTS = {"even": (64, None), "ragged": (70, None), "packed": (70, [0, 1, 20, 37, 70])}


@pytest.mark.parametrize("C, layout_name, correlated", [
    (16, "ragged", False), (64, "ragged", False), (16, "packed", False), (64, "even", True)])
def test_intra_chunk_gdn(C, layout_name, correlated):
    """The kernel reads the token tensors in place; its terms equal the XLA twin's on the
    chunk layout. correlated: unit keys sharing a direction, weak decay, where the inverse's
    intermediate terms must stay bounded (a power series in A loses everything in fp32)."""
    T, cu = LAYOUTS[layout_name]
    q, k, v, g, beta, _ = make_inputs("gdn", 1, T, 2, 2, 32, 16, correlated_keys=correlated)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) if correlated else k / 6
    layout, chunks, _ = token_layout(T, C, cu)
    args = (q, k, v, g[..., None], beta)
    want = xla.intra_chunk(*map(chunks, args), 0.25, gate=Gate.SCALAR, with_inverse=True)
    got = pgdn_intra.intra_chunk(*args, 0.25, layout, C, with_inverse=True, interpret=True)
    assert pgdn_intra.intra_chunk(*args, 0.25, layout, C, interpret=True).inv is None
    assert float(jnp.abs(want.inv).max()) < 2.0
    assert_terms(plain(got, chunks), want, 1e-5)
    # the backward's terms: w, u and the k row factors again from what the forward kept
    kept = pgdn_intra.kept_for_w_u(got)
    assert kept.w is None and kept.u is None and kept.k_rows is None
    again = pgdn_intra.recompute_w_u(*args, layout, C, kept, interpret=True)
    assert_terms(plain(again, chunks), want, 1e-5)


def kda_chunks(C, K, V, gates, seed=0):
    """Chunk-layout KDA inputs (3 chunks of C, 2 heads); gates: "random" (log-sigmoid),
    "-30" (uniform in [-30, 0)), "-1e3" (a third of the gates -1e3, the rest -0.01) or
    "mixed" (sub-chunks of 16 rows alternately "random" and "-30")."""
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    shape = (3, 1, 2, C)
    g = {"random": lambda: jax.nn.log_sigmoid(r(*shape, K) + 2.0),
         "-30": lambda: -30.0 * jnp.asarray(rng.random(shape + (K,)), jnp.float32),
         "-1e3": lambda: jnp.where(jnp.asarray(rng.random(shape + (K,))) < 0.3, -1e3, -0.01),
         "mixed": lambda: jnp.where((jnp.arange(C) // 16 % 2 == 1)[:, None],
                                    -30.0 * jnp.asarray(rng.random(shape + (K,)), jnp.float32),
                                    jax.nn.log_sigmoid(r(*shape, K) + 2.0))}
    return r(*shape, K), r(*shape, K) / 4, r(*shape, V), g[gates](), jax.nn.sigmoid(r(*shape))


@pytest.mark.parametrize("C, K, layout_name", [(16, 16, "packed"), (64, 256, "even")])
def test_kda_gate_cumsum(C, K, layout_name):
    """The gate kernel reads g in place and writes G, the float64 cumsum over each chunk's
    rows (padding rows holding the chunk's last G); its backward's reverse cumsum sums only
    the rows at and after each row, so rows after 1e6-sized ones keep their own digits (a
    difference of prefix sums would leave 1e6 * 2^-24 there)."""
    T, cu = {"packed": LAYOUTS["packed"], "even": (3 * C, None)}[layout_name]
    layout, chunks, tokens = token_layout(T, C, cu)
    NT = layout.chunk_starts.shape[0]
    rng = np.random.default_rng(0)
    early = (jnp.arange(NT * C) % C < C // 2).reshape(NT, 1, 1, C, 1)
    big = lambda x: jnp.where(early, 1e6 * x, x)
    g = tokens(big(jnp.asarray(rng.standard_normal((NT, 1, 2, C, K)), jnp.float32)))
    dG = big(jnp.asarray(rng.standard_normal((NT, 1, 2, C, K)), jnp.float32))
    cfg = gate_cumsum.GateCumsum(C, NT, interpret=True)
    G, vjp = jax.vjp(lambda g: gate_cumsum.chunk_gate(cfg, g, None, None, layout), g)
    (dg,) = vjp(dG)
    assert G.dtype == dg.dtype == jnp.float32
    with jax.enable_x64():
        want_G = jnp.cumsum(chunks(g).astype(jnp.float64), axis=3)
        want_dg = tokens(jax.lax.cumsum(dG.astype(jnp.float64), axis=3, reverse=True))
        assert rel_err(G, want_G) < 1e-6
        late = tokens(~early & jnp.ones(dG.shape, bool))
        assert rel_err(jnp.where(late, dg, 0), jnp.where(late, want_dg, 0)) < 1e-6
        assert rel_err(dg, want_dg) < 1e-6


@pytest.mark.parametrize("lower_bound, with_a_log", [(None, True), (-5.0, True),
                                                     (-5.0, False)])
def test_kda_gate_activation_in_kernel(lower_bound, with_a_log):
    """The gate kernel with the activation inside (FLA's use_gate_in_kernel; the softplus
    form always has A_log): G and the cotangents of the raw g, A_log and dt_bias equal those
    of ``decay_from_raw`` by XLA, then the cumsum, on packed sequences."""
    T, cu = LAYOUTS["packed"]
    C, K, HV = 16, 32, 2
    layout, chunks, _ = token_layout(T, C, cu)
    NT = layout.chunk_starts.shape[0]
    rng = np.random.default_rng(3)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    g, A_log, dt_bias, dG = r(1, T, HV, K), r(HV) if with_a_log else None, r(HV * K), \
        r(NT, 1, HV, C, K)
    cfg = gate_cumsum.GateCumsum(C, NT, activate=True, lower_bound=lower_bound,
                                 interpret=True)
    fused = lambda g, a, b: gate_cumsum.chunk_gate(cfg, g, a, b, layout)
    unfused = lambda g, a, b: jnp.cumsum(chunks(decay_from_raw(Gate.CHANNEL, g, a, b,
                                                               lower_bound)), axis=3)
    got, got_vjp = jax.vjp(fused, g, A_log, dt_bias)
    want, want_vjp = jax.vjp(unfused, g, A_log, dt_bias)
    assert_rel(got, want, 1e-6, "G")
    for name, a, b in zip(("dg", "dA_log", "ddt_bias"), got_vjp(dG), want_vjp(dG)):
        if b is not None:
            assert_rel(a, b, 1e-5, name)


def kda_in_place(args):
    """The Pallas KDA stages' arguments from chunk-layout (q, k, v, g, beta) of whole chunks
    (B = 1): q, k, v, beta token-major, G from the gate kernel, the layout; and gate_grad,
    which takes the stages' dG to dg in the chunk layout (the gate kernel's backward)."""
    NT, B, HV, C = args[0].shape[:4]
    T = NT * C
    q, k, v, g, beta = (from_chunks(x, None, T) for x in args)
    layout, _ = build_layout(B, T, C, None, 0, T)
    cfg = gate_cumsum.GateCumsum(C, NT, interpret=True)
    G, vjp = jax.vjp(lambda g: gate_cumsum.chunk_gate(cfg, g, None, None, layout), g)
    gate_grad = lambda dG: to_chunks(vjp(dG)[0], None, NT, C)
    return (q, k, v, G, beta), layout, gate_grad


def kda_chunk_grads(args, terms, rest, **kw):
    """pkda_grads.chunk_grads on ``kda_in_place`` arguments of the chunk-layout args,
    the cotangents brought back to the chunk layout (dG through the gate kernel's
    backward to dg)."""
    (q, k, v, G, beta), layout, gate_grad = kda_in_place(args)
    *rest, do = rest
    NT, C = G.shape[0], G.shape[3]
    chunked = lambda x: to_chunks(x, None, NT, C)
    dq, dk, dv, dG, dbeta = pkda_grads.chunk_grads(
        q, k, v, G, beta, 0.3, layout, terms, *rest, from_chunks(do, None, NT * C),
        interpret=True, **kw)
    return chunked(dq), chunked(dk), chunked(dv), gate_grad(dG), chunked(dbeta)


def kda_intra(args, **kw):
    """pkda_intra.intra_chunk on ``kda_in_place`` arguments of the chunk-layout args."""
    pargs, layout, _ = kda_in_place(args)
    return pkda_intra.intra_chunk(*pargs, 0.3, layout, interpret=True, **kw)


@pytest.mark.parametrize("C, K, V", [(16, 16, 32), (64, 32, 16), (32, 128, 64)])
def test_intra_chunk_kda(C, K, V):
    """KDA's terms (sub-chunk products across sub-chunks, pair by pair within them; K in
    column blocks at K = 128) equal the XLA twin's; recomputed from the kept T and attn,
    they equal the forward's."""
    args = kda_chunks(C, K, V, "random")
    want = xla.intra_chunk(*args, 0.3, gate=Gate.CHANNEL, with_inverse=True)
    got = kda_intra(args, with_inverse=True)
    assert kda_intra(args).inv is None
    assert_terms(got, want, 1e-5)
    # the backward's terms from the kept T and attn are the forward's, bit for bit
    pargs, layout, _ = kda_in_place(args)
    again = pkda_intra.recompute_terms(*pargs, 0.3, layout,
                                       pkda_intra.kept_for_terms(got), interpret=True)
    for name in got._fields:
        if getattr(got, name) is not None:
            np.testing.assert_array_equal(getattr(again, name), getattr(got, name), name)


@pytest.mark.parametrize("gates", ["-30", "-1e3"])
def test_intra_chunk_kda_very_negative_gates(gates):
    """Gates of -30 and -1e3 per token: finite, and no further from the float64 terms than
    the XLA twin (the same chunk cumsum, whose differences lose digits at -1e3; the products
    across sub-chunks split each exponent at a reference row)."""
    args = kda_chunks(64, 16, 16, gates)
    got = kda_intra(args, with_inverse=True)
    want = xla.intra_chunk(*args, 0.3, gate=Gate.CHANNEL, with_inverse=True)
    with jax.enable_x64():
        exact = xla.intra_chunk(*(x.astype(jnp.float64) for x in args), 0.3, gate=Gate.CHANNEL,
                                with_inverse=True)
    for name in ("w", "u", "qg", "kd", "decay", "attn", "inv"):
        a, b, ref = getattr(got, name), getattr(want, name), getattr(exact, name)
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel_err(a, ref) <= max(1.01 * rel_err(b, ref), 1e-6), name


@pytest.mark.parametrize("gates", ["uniform", "at the bound"])
def test_kda_gate_bound(gates):
    """With every gate in [-5, 0) and gate_bound = -5 (the diagonal sub-chunk blocks as
    products through a shifted reference): the terms equal the XLA twin's, and the
    cotangents are no further from the float64 ones than the twin's, also with every gate
    at the bound (factors up to e^37.5). dg within 1.04x of the twin's: the twin sums each
    token's dg over the spans that hold it, the kernels sum per-row dG, which cancels
    (uniform gates: 3.9e-6 against the twin's 3.8e-6; docs/precision.md)."""
    args, terms, rest = kda_grads_inputs(64, 32, 16, "random")
    rng = np.random.default_rng(7)
    g = {"uniform": lambda: -5.0 * jnp.asarray(rng.random(args[3].shape), jnp.float32),
         "at the bound": lambda: jnp.full(args[3].shape, -5.0)}[gates]()
    args = args[:3] + (g,) + args[4:]
    want = xla.intra_chunk(*args, 0.3, gate=Gate.CHANNEL, with_inverse=True)
    got = kda_intra(args, with_inverse=True, gate_bound=-5.0)
    assert_terms(got, want, 1e-5)
    grads_want = xla.chunk_grads(*args, 0.3, None, *rest, gate=Gate.CHANNEL)
    grads_got = kda_chunk_grads(args, want, rest, gate_bound=-5.0)
    exact = float64_chunk_grads(args, rest)
    for name, a, b, ref in zip(("dq", "dk", "dv", "dg", "dbeta"), grads_got, grads_want,
                               exact):
        assert bool(jnp.all(jnp.isfinite(a))), name
        factor = 1.04 if name == "dg" else 1.01
        assert rel_err(a, ref) <= max(factor * rel_err(b, ref), 1e-6), name


@pytest.mark.parametrize("gate_bound", [-6.0, 0.0])
def test_kda_gate_bound_outside_its_range_is_refused(gate_bound):
    args = kda_chunks(16, 16, 16, "random")
    with pytest.raises(ValueError, match="gate_bound"):
        kda_intra(args, gate_bound=gate_bound)


def test_kda_launch_orders():
    """Under either order of each kernel's grid (a launch order: the sub-chunk first or
    last in the sub-chunk kernels, the heads or the chunks first in every kernel), the
    gated sums, the terms and the cotangents are the same numbers. Mixed gates, so that
    the diagonal kernels go pair by pair on some sub-chunks."""
    flipped = lambda blocks: replace(blocks, sub_chunks_first=not blocks.sub_chunks_first,
                                     heads_first=not blocks.heads_first)
    (q, k, v, G, beta), layout, _ = kda_in_place(kda_chunks(32, 32, 16, "mixed"))
    sums = lambda **kw: pkda_intra.gated_sums(q, k, G, beta, 0.3, layout, interpret=True,
                                                 **kw)
    a, attn = sums()
    chex.assert_trees_all_equal(
        sums(blocks=flipped(ChunkBlocks.across_sub_chunks()),
             diagonal_blocks=flipped(ChunkBlocks.sub_chunk())), (a, attn))
    wy = lambda **kw: pkda_intra.wy_terms(q, k, v, G, beta, 0.3, layout, a=a,
                                          with_inverse=True, interpret=True, **kw)
    chex.assert_trees_all_equal(wy(blocks=flipped(ChunkBlocks.wy_terms(32))), wy())
    args, terms, rest = kda_grads_inputs(32, 32, 16, "mixed")
    want = kda_chunk_grads(args, terms, rest)
    got = kda_chunk_grads(args, terms, rest, blocks=flipped(ChunkBlocks.kda_grads()),
                          across_blocks=flipped(ChunkBlocks.grads_across_sub_chunks()),
                          diagonal_blocks=flipped(ChunkBlocks.grads_sub_chunk(32)))
    chex.assert_trees_all_equal(got, want)


def kda_grads_inputs(C, K, V, gates):
    """Chunk-layout KDA inputs, their terms with the inverse, and random h, v_new, X, dvn,
    do (3 chunks, 2 heads)."""
    args = kda_chunks(C, K, V, gates)
    rng = np.random.default_rng(1)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    rest = (r(3, 1, 2, K, V), r(3, 1, 2, C, V), r(3, 1, 2, K, V), r(3, 1, 2, C, V),
            r(3, 1, 2, C, V))
    return args, xla.intra_chunk(*args, 0.3, gate=Gate.CHANNEL, with_inverse=True), rest


def float64_chunk_grads(args, rest):
    """xla.chunk_grads for the per-channel gate, in float64 throughout."""
    with jax.enable_x64():
        wide = [x.astype(jnp.float64) for x in (*args, *rest)]
        return xla.chunk_grads(*wide[:5], 0.3, None, *wide[5:], gate=Gate.CHANNEL)


@pytest.mark.parametrize("C, K, V", [(16, 16, 32), (64, 32, 16), (32, 128, 64)])
def test_chunk_grads_kda(C, K, V):
    """KDA's cotangent kernels (gated row and column sums across and within sub-chunks; K, V
    in column blocks at 128) equal the XLA twin's."""
    args, terms, rest = kda_grads_inputs(C, K, V, "random")
    want = xla.chunk_grads(*args, 0.3, None, *rest, gate=Gate.CHANNEL)
    got = kda_chunk_grads(args, terms, rest)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert_rel(a, b, 1e-5, name)


def test_chunk_grads_kda_cotangents_in_the_inputs_dtypes():
    """With q, k in float16 and v in bf16 (as the op hands them to the kernels for bf16
    inputs), dq, dk leave the kernels in float16 and dv in bf16, as new arrays rather than
    in place: each equals the float32 cotangents of the same values rounded once (to one
    unit in the last place: the two programs may contract sums differently)."""
    args, terms, rest = kda_grads_inputs(32, 32, 16, "random")
    q, k, v = args[0].astype(jnp.float16), args[1].astype(jnp.float16), \
        args[2].astype(jnp.bfloat16)
    narrow = (q, k, v, *args[3:])
    wide = tuple(x.astype(jnp.float32) for x in narrow)
    got = kda_chunk_grads(narrow, terms, rest)
    want = kda_chunk_grads(wide, terms, rest)
    want = (*(x.astype(d) for x, d in zip(want[:3], (jnp.float16, jnp.float16,
                                                      jnp.bfloat16))), *want[3:])
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_tree_all_finite(got)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        ulp = float(jnp.finfo(a.dtype).eps)
        chex.assert_trees_all_close(a.astype(jnp.float32), b.astype(jnp.float32), rtol=ulp,
                                    atol=ulp * float(jnp.max(jnp.abs(b))), custom_message=name)


def test_kda_diagonal_blocks_as_products_or_pair_by_pair():
    """A sub-chunk whose G falls by at most 75 on every channel takes its diagonal block as
    products, the others pair by pair (``gates.diagonal_fits``): with the sub-chunks
    alternating between gates near 0 and gates down to -30, the terms and the cotangents
    equal the XLA twin's, and neither path wrote the other's blocks."""
    args, _, rest = kda_grads_inputs(64, 32, 16, "mixed")
    want = xla.intra_chunk(*args, 0.3, gate=Gate.CHANNEL, with_inverse=True)
    got = kda_intra(args, with_inverse=True)
    assert_terms(got, want, 1e-5)
    grads_want = xla.chunk_grads(*args, 0.3, None, *rest, gate=Gate.CHANNEL)
    grads_got = kda_chunk_grads(args, want, rest)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads_got, grads_want):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert_rel(a, b, 1e-5, name)


@pytest.mark.parametrize("gates", ["-30", "-1e3"])
def test_chunk_grads_kda_very_negative_gates(gates):
    """Gates of -30 and -1e3 per token: the cotangents are finite and no further from the
    float64 ones than the XLA twin's."""
    args, terms, rest = kda_grads_inputs(64, 16, 16, gates)
    got = kda_chunk_grads(args, terms, rest)
    want = xla.chunk_grads(*args, 0.3, None, *rest, gate=Gate.CHANNEL)
    exact = float64_chunk_grads(args, rest)
    for name, a, b, ref in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, exact):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel_err(a, ref) <= max(1.01 * rel_err(b, ref), 1e-6), name


@pytest.mark.parametrize("shape, in_dtype, out_dtype", [
    ((1, 37, 3, 32), jnp.bfloat16, jnp.float16),    # 111 rows: a masked last block
    ((2, 16, 2, 128), jnp.float32, jnp.float32),
    ((1, 9, 1, 256), jnp.bfloat16, jnp.bfloat16),
])
def test_l2_normalized_copy(shape, in_dtype, out_dtype):
    """The unit-row copy as Pallas kernels (``common.l2norm``) equals XLA's
    (``l2norm.normalized_copy``): y in out_dtype, dx in x's dtype, both rounded once from
    float32 (so to a unit in their last place at most), on rows of different norms, a zero
    row among them."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape) * rng.uniform(0.1, 10.0, shape[:-1] + (1,))
    x[0, 0, 0] = 0.0
    x = jnp.asarray(x, in_dtype)
    dy = jnp.asarray(rng.standard_normal(shape), out_dtype)
    kernel = lambda x: l2norm_kernels.l2_normalized(x, out_dtype, interpret=True,
                                                    blocks=RowBlocks(block_rows=16))
    y, kernel_vjp = jax.vjp(kernel, x)
    want, xla_vjp = jax.vjp(lambda x: normalized_copy(x, out_dtype), x)
    (dx,), (want_dx,) = kernel_vjp(dy), xla_vjp(dy)
    chex.assert_trees_all_equal_dtypes((y, dx), (want, want_dx))
    chex.assert_trees_all_equal_shapes((y, dx), (want, x))
    chex.assert_tree_all_finite((y, dx))
    ulp = float(jnp.finfo(out_dtype).eps)
    chex.assert_trees_all_close(y.astype(jnp.float32), want.astype(jnp.float32), atol=ulp,
                                rtol=0)
    # dx has the scale of r dy; compare each row relative to its own size
    size = jnp.max(jnp.abs(want_dx.astype(jnp.float32)), axis=-1, keepdims=True) + 1e-30
    chex.assert_trees_all_close(dx.astype(jnp.float32) / size,
                                want_dx.astype(jnp.float32) / size,
                                atol=2 * float(jnp.finfo(in_dtype).eps), rtol=0)


def test_l2_normalized_copy_rejects_widths():
    with pytest.raises(ValueError, match="row width"):
        l2norm_kernels.l2_normalized(jnp.ones((4, 48)), jnp.float32, interpret=True)


def test_kda_normalize_qk_in_kernels():
    """KDA with normalize_qk: raw q, k in (bf16, as the op hands them over); the terms of
    their L2-normalised rows, and the cotangents of the raw q, k (the normalisation's vjp),
    equal to l2_normalize outside the XLA twins. K = 128: the row norms span two blocks of
    key columns."""
    args, _, rest = kda_grads_inputs(32, 128, 64, "random")
    raw = (3 * args[0]).astype(jnp.bfloat16), (args[1] / 2).astype(jnp.bfloat16)
    unit = lambda q, k: (l2_normalize(q), l2_normalize(k))
    normed = (*unit(*raw), *args[2:])
    want = xla.intra_chunk(*normed, 0.3, gate=Gate.CHANNEL, with_inverse=True)
    got = kda_intra((*raw, *args[2:]), with_inverse=True, normalize_qk=True)
    assert_terms(got, want, 1e-5)
    pargs, layout, _ = kda_in_place((*raw, *args[2:]))
    again = pkda_intra.recompute_terms(*pargs, 0.3, layout,
                                       pkda_intra.kept_for_terms(got),
                                       normalize_qk=True, interpret=True)
    assert_terms(again, want, 1e-5)

    (qn, kn), unit_vjp = jax.vjp(unit, *(x.astype(jnp.float32) for x in raw))
    dqn, dkn, *others = xla.chunk_grads(qn, kn, *args[2:], 0.3, None, *rest,
                                        gate=Gate.CHANNEL)
    want_grads = (*unit_vjp((dqn, dkn)), *others)
    got = kda_chunk_grads((*raw, *args[2:]), want, rest, normalize_qk=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want_grads):
        assert a.dtype == jnp.float32, name
        assert_rel(a, b, 1e-5, name)


def test_gdn_launch_orders():
    """GDN's per-chunk kernels give the same terms, the same recomputed w and u and the same
    cotangents with the chunk first or last in their grid (``ChunkBlocks.heads_first``),
    packed sequences included."""
    C, K, V = 16, 32, 16
    args, rest, do, layout, _, _ = grads_inputs(70, C, LAYOUTS["packed"][1], K, V, 2)
    args = (args[0], args[1] / 6) + args[2:]
    shipped = ChunkBlocks.gdn(K)
    flipped = replace(shipped, heads_first=not shipped.heads_first)

    def run(blocks):
        terms = pgdn_intra.intra_chunk(*args, 0.25, layout, C, with_inverse=True,
                                       interpret=True, blocks=blocks)
        again = pgdn_intra.recompute_w_u(*args, layout, C, pgdn_intra.kept_for_w_u(terms),
                                         interpret=True, blocks=blocks)
        grads = pgdn_grads.chunk_grads(*args, 0.25, layout, C, terms, *rest, do,
                                       interpret=True, blocks=blocks)
        return terms, again, grads

    chex.assert_trees_all_equal(run(flipped), run(None))


def grads_inputs(T, C, cu, K, V, seed):
    """Token tensors (q, k, v, g [..., 1], beta), random chunk-layout h, v_new, X, dvn and a
    token-major do, with the layout and its conversions."""
    q, k, v, g, beta, _ = make_inputs("gdn", 1, T, 2, 2, K, V)
    layout, chunks, tokens = token_layout(T, C, cu)
    NT = layout.chunk_starts.shape[0]
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    rest = (r(NT, 1, 2, K, V), r(NT, 1, 2, C, V), r(NT, 1, 2, K, V), r(NT, 1, 2, C, V))
    return (q, k, v, g[..., None], beta), rest, r(1, T, 2, V), layout, chunks, tokens


@pytest.mark.parametrize("C, K, V, layout_name", [(16, 32, 16, "ragged"),
                                                  (64, 128, 128, "ragged"),
                                                  (16, 32, 16, "packed")])
def test_chunk_grads_gdn(C, K, V, layout_name):
    """The cotangents, written in place into token-major tensors, equal the XLA twin's on
    the chunk layout at every real token. K, V = 128: the kernel's loops over blocks of 64
    key and value columns."""
    T, cu = LAYOUTS[layout_name]
    args, rest, do, layout, chunks, tokens = grads_inputs(T, C, cu, K, V, 5)
    args = (args[0], args[1] / 6) + args[2:]
    terms = xla.intra_chunk(*map(chunks, args), 0.25, gate=Gate.SCALAR, with_inverse=True)
    want = xla.chunk_grads(*map(chunks, args), 0.25, terms, *rest, chunks(do), gate=Gate.SCALAR)
    got = pgdn_grads.chunk_grads(*args, 0.25, layout, C, terms, *rest, do, interpret=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert_rel(a, tokens(b), 1e-5, name)


@pytest.mark.parametrize("layout_name", ["even", "packed"])
def test_normalize_qk_in_kernels(layout_name):
    """normalize_qk: raw q, k in; the terms of their L2-normalised rows, and the cotangents of
    the raw q, k (the normalisation's vjp), equal to l2_normalize outside the XLA twins.
    K = 128: the row norms span two blocks of key columns."""
    C, K, V = 64, 128, 64
    T = 128 if layout_name == "even" else 140
    cu = None if layout_name == "even" else [0, 50, 51, 140]
    args, rest, do, layout, chunks, tokens = grads_inputs(T, C, cu, K, V, 6)
    args = (3 * args[0], args[1] / 2) + args[2:]          # rows far from unit norm
    unit = lambda q, k: (l2_normalize(q), l2_normalize(k))
    chunked = tuple(map(chunks, args))
    want = xla.intra_chunk(*unit(*chunked[:2]), *chunked[2:], 0.25, gate=Gate.SCALAR,
                           with_inverse=True)
    got = pgdn_intra.intra_chunk(*args, 0.25, layout, C, with_inverse=True, interpret=True,
                             normalize_qk=True)
    assert_terms(plain(got, chunks), want, 1e-5)
    again = pgdn_intra.recompute_w_u(*args, layout, C, pgdn_intra.kept_for_w_u(got),
                                     interpret=True, normalize_qk=True)
    assert_terms(plain(again, chunks), want, 1e-5)

    (qn, kn), unit_vjp = jax.vjp(unit, *chunked[:2])
    dqn, dkn, *others = xla.chunk_grads(qn, kn, *chunked[2:], 0.25, want, *rest, chunks(do),
                                        gate=Gate.SCALAR)
    want_grads = (*unit_vjp((dqn, dkn)), *others)
    got = pgdn_grads.chunk_grads(*args, 0.25, layout, C, want, *rest, do, interpret=True,
                             normalize_qk=True)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want_grads):
        assert_rel(a, tokens(b), 1e-5, name)


@pytest.mark.parametrize("layout_name, device", [("even", 0), ("ragged", 0), ("packed", 0),
                                                 ("packed", 1)])
def test_state_kernels_read_tokens_in_place(layout_name, device):
    """The state kernels on the intra kernel's row-factored terms, with q, k, o and do
    token-major, equal them on the same terms as plain chunk-layout tiles: output, stored
    states, CP summary and the reverse recurrence. Device 1 of 2 with packed sequences: the
    first local chunk continues a sequence, and the CP summary skips the chunks before the
    last start."""
    C, K, V = 16, 32, 16
    T, cu = LAYOUTS[layout_name]
    cu = None if cu is None else [0, 1, 20, 37, 70, 90, 100, 140][: 5 + 3 * device]
    n_states = 1 if cu is None else len(cu) - 1
    q, k, v, g, beta, h0 = make_inputs("gdn", 1, T, 2, 2, K, V, n_states=n_states)
    layout, chunks, tokens = token_layout(T, C, cu, device, device + 1)
    factored = pgdn_intra.intra_chunk(q, k / 6, v, g[..., None], beta, 0.25, layout, C,
                                  interpret=True)
    tiles = plain(factored, chunks)
    do = jnp.asarray(np.random.default_rng(7).standard_normal(v.shape), jnp.float32)
    carry = h0[:1]
    kw = dict(gate=Gate.SCALAR, interpret=True)
    # (name, run(terms, token_major), converts the token-major outputs to chunk layout)
    runs = [
        ("state_output", lambda t, tm: pstate.state_output(t, layout, h0, carry, True,
                                                           token_major=tm, **kw),
         [chunks, None]),
        ("state_fwd", lambda t, tm: pstate.state_fwd(t, layout, h0, carry, token_major=tm, **kw),
         [None] * 3),
        ("cp_summary", lambda t, tm: pstate.cp_summary(t, layout, h0, token_major=tm, **kw),
         [None] * 2),
        ("state_bwd", lambda t, tm: pstate.state_bwd(t, layout, do if tm else chunks(do), h0,
                                                     carry, with_d_init=True, token_major=tm,
                                                     **kw), [None] * 4),
        ("state_bwd entry", lambda t, tm: (pstate.state_bwd(
            t, layout, do if tm else chunks(do), h0, carry, entry_only=True, token_major=tm,
            **kw),), [None]),
    ]
    for name, run, convert in runs:
        for i, (a, b, c) in enumerate(zip(run(factored, True), run(tiles, False), convert)):
            assert_rel(a if c is None else c(a), b, 1e-5, f"{name} output {i}")


def test_implementation_table():
    """The table says each implementation's policy: token-major tensors for the Pallas
    stages, G for the Pallas KDA stages, in-kernel normalisation only for the Pallas GDN
    stages; "interpret" runs the Pallas entries; a normalize_qk that an implementation
    cannot do, or an unknown backend, is refused; a token-major o from plain terms needs
    its length told."""
    from jaxcp.stages import StageOptions, implementation, stages_for
    assert implementation("interpret", Gate.SCALAR) is implementation("pallas", Gate.SCALAR)
    assert [implementation(b, gate).token_major for b in ("xla", "pallas")
            for gate in Gate] == [False, False, True, True]
    assert [implementation(b, gate).gate_cumsum for b in ("xla", "pallas")
            for gate in Gate] == [False, False, False, True]
    assert implementation("pallas", Gate.SCALAR).normalizes_qk(128)
    assert not implementation("pallas", Gate.SCALAR).normalizes_qk(256)
    assert [implementation("pallas", gate).qk_dtype(dtype, unit_rows)
            for gate in Gate for dtype in ("bfloat16", "float32")
            for unit_rows in (True, False)] == [
        jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32,
        jnp.float16, jnp.float32, jnp.float32, jnp.float32]
    assert [implementation(b, gate).v_dtype("bfloat16") for b in ("xla", "pallas")
            for gate in Gate] == [jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16]
    for backend, gate in (("xla", Gate.SCALAR), ("interpret", Gate.CHANNEL)):
        with pytest.raises(ValueError, match="normalize_qk"):
            stages_for(StageOptions(backend, gate, normalize_qk=True))
    with pytest.raises(ValueError, match="backend"):
        implementation("cuda", Gate.SCALAR)
    layout, chunks, _ = token_layout(64, 16)
    q, k, v, g, beta, _ = make_inputs("gdn", 1, 64, 1, 1, 16, 16)
    terms = xla.intra_chunk(*map(chunks, (q, k, v, g[..., None], beta)), 0.25, gate=Gate.SCALAR)
    with pytest.raises(ValueError, match="tokens"):
        pstate.state_output(terms, layout, None, jnp.zeros((1, 1, 16, 16)), False,
                            gate=Gate.SCALAR, token_major=True, interpret=True)
    with pytest.raises(ValueError, match="gate"):
        pstate.state_last(terms, layout, None, jnp.zeros((1, 1, 16, 16)), gate=Gate.CHANNEL,
                          interpret=True)


def test_cp_summary_keeps_the_transition_fp32_accurate_with_bf16_tiles():
    """bf16 tiles (bf16 inputs): the transition M still meets them as fp32 (two bf16 parts),
    within fp32 tolerance of the XLA twin on the same bf16 values."""
    terms, layout, init = chunk_terms("gdn", [0, 210], 70, device=1, world=3, gate_scale=0.02)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    rounded = terms._replace(w=bf16(terms.w), kd=bf16(terms.kd), u=bf16(terms.u))
    exact = rounded._replace(w=rounded.w.astype(jnp.float32), kd=rounded.kd.astype(jnp.float32),
                             u=rounded.u.astype(jnp.float32))
    m = pstate.cp_summary(rounded, layout, init, gate=Gate.SCALAR, interpret=True,
                         precision=KernelPrecision(dot_dtype=jnp.bfloat16,
                                                   tile_dtype=jnp.bfloat16))[1]
    want = xla.cp_summary(exact, layout, init)[1]
    assert float(jnp.abs(want - jnp.eye(16)).max()) > 0.01
    assert_rel(m, want, 1e-4, "M")


@pytest.mark.parametrize("dtype, products", [("bfloat16", Fp32Products.TF32),
                                             ("float32", Fp32Products.TF32X3)])
def test_kda_stages_pick_precise_products(dtype, products):
    """KDA's Pallas state recurrences take float32 terms at TF32 for bf16 inputs and 3xTF32
    for fp32 ones, each kernel at its launch configuration (``StateBlocks.kda``)."""
    st = stages_for(StageOptions("pallas", Gate.CHANNEL, dtype))
    for stage in (st.state_output, st.state_fwd, st.state_bwd, st.cp_summary):
        assert stage.keywords["precision"].products is products
        assert "blocks" not in stage.keywords
        assert stage.keywords["precision"].dot_dtype == jnp.float32
    assert Fp32Products.for_inputs(dtype) is products


def test_kda_backward_diagonal_kernel_blocks_by_key_width():
    """``kda_grads_diagonal_sums`` steps over 32 columns with one warp up to K = 128 and
    over 64 with four above; the sub-chunks come first in its grid at every K."""
    assert ChunkBlocks.grads_sub_chunk(128) == ChunkBlocks(32, 1, 2, sub_chunks_first=True)
    assert ChunkBlocks.grads_sub_chunk(256) == ChunkBlocks(64, 4, 2, sub_chunks_first=True)


def test_kda_state_blocks_keep_the_grid_full():
    """state_bwd takes 64 state columns (8 warps) only where that still launches FULL_GRID
    programs; state_fwd takes 16 at K = 256; the op's three recurrences take 16 where 32
    launch fewer than FULL_GRID programs (the CP kernels stay at 32); the others 32."""
    wide = StateBlocks(block_cols=64, num_warps=8)
    narrow = StateBlocks(block_cols=16)
    assert StateBlocks.kda("state_bwd", 128, 128, 64) == wide
    for kernel in ("state_output", "state_fwd", "state_bwd"):
        assert StateBlocks.kda(kernel, 128, 128, 16) == narrow
        assert StateBlocks.kda(kernel, 128, 128, 32) == StateBlocks(block_cols=32)
    assert StateBlocks.kda("state_last", 128, 128, 16) == StateBlocks(block_cols=32)
    assert StateBlocks.kda("state_bwd", 256, 256, 64) == StateBlocks(block_cols=32)
    assert StateBlocks.kda("state_fwd", 256, 256, 16) == StateBlocks(block_cols=16)
    assert StateBlocks.kda("state_fwd", 128, 128, 64) == StateBlocks(block_cols=32)
    assert StateBlocks.kda("state_output", 128, 128, 64) == StateBlocks(block_cols=32)


def test_gdn_state_blocks_keep_two_programs_per_sm_at_k256():
    """GDN's state_output takes 16 state columns at K = 256 where 32 would launch at most
    FULL_GRID programs; every other kernel and shape takes the default."""
    assert StateBlocks.gdn("state_output", 256, 256, 16) == StateBlocks(block_cols=16)
    assert StateBlocks.gdn("state_output", 256, 256, 64) == StateBlocks.default(256)
    assert StateBlocks.gdn("state_bwd", 256, 256, 16) == StateBlocks.default(256)
    assert StateBlocks.gdn("state_output", 128, 128, 16) == StateBlocks.default(128)


@pytest.mark.parametrize("count", [None, 5])
def test_chunk_rows_reversed(count):
    """A reversed view of a chunk's rows (``ChunkRows.reversed``) reads row C - 1 - i into
    tile row i, of a [T] slab and of a [T, n] slab's columns, zero past the chunk's count,
    and writes back the same way, leaving the rows past count and the other rows alone."""
    from jax.experimental import pallas as pl
    from jaxcp.pallas.triton.common.chunk_rows import ChunkRows

    T, C, start, n = 24, 8, 9, 4
    vec = jnp.arange(T, dtype=jnp.float32)
    tile = jnp.arange(T * 6, dtype=jnp.float32).reshape(T, 6)

    def kernel(vec_ref, tile_ref, vec_out, tile_out, vec_read, tile_read):
        rows = ChunkRows(jnp.int32(start), None if count is None else jnp.int32(count),
                         C).reversed()
        vec_read[...] = rows.load(vec_ref)
        tile_read[...] = rows.load(tile_ref, (1, n))
        vec_out[...] = vec_ref[...]
        tile_out[...] = tile_ref[...]
        rows.store(vec_out, -rows.load(vec_ref))
        rows.store(tile_out, -rows.load(tile_ref, (1, n)), (1, n))

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((T,), (T, 6), (C,), (C, n))]
    got = pl.pallas_call(kernel, out_shape=shapes, interpret=True)(vec, tile)
    real = C if count is None else count
    chunk = np.arange(start, start + C)[::-1]              # the chunk's rows, last first
    kept = (np.arange(C)[::-1] < real)[:, None]
    want_vec_read = np.where(kept[:, 0], np.asarray(vec)[chunk], 0.0)
    want_tile_read = np.where(kept, np.asarray(tile)[chunk, 1:1 + n], 0.0)
    want_vec, want_tile = np.asarray(vec).copy(), np.asarray(tile).copy()
    want_vec[start:start + real] *= -1
    want_tile[start:start + real, 1:1 + n] *= -1
    chex.assert_trees_all_equal(tuple(got), (want_vec, want_tile, want_vec_read, want_tile_read))


def test_bf16x3_products_keep_16_bits():
    """The GPU's precise products for bf16 inputs (not interpret mode): fp32 x fp32 and a
    bf16 tile against an fp32 one are within 2^-16 of float64, relative to the largest
    entry (bf16 rounding of an fp32 operand would be 2^-9)."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((32, 32)), jnp.float32) for _ in range(2))
    product = dots(KernelPrecision(products=Fp32Products.BF16X3), interpret=False).plain
    for x, y in ((a, b), (a.astype(jnp.bfloat16), b), (a, b.astype(jnp.bfloat16))):
        want = np.asarray(x, np.float64) @ np.asarray(y, np.float64)
        got = np.asarray(product(x, y))
        assert np.abs(got - want).max() <= 2.0 ** -16 * np.abs(want).max()


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_trace_inside_shard_map_on_replicated_inputs(kind):
    """Inside shard_map(check_vma=True) with inputs that vary over no axis (replicated over
    the mesh, as a layer's inputs over a tensor-parallel axis), every kernel's outputs get a
    manual axis type (``vma.unify``): the GPU stages (intra, state recurrence with the
    output) trace; without it pallas_call refuses. Traced only (eval_shape)."""
    from jax.sharding import Mesh, PartitionSpec as P
    T, H, D = 128, 2, 64
    q, k, v, g, beta, _ = make_inputs(kind, 1, T, H, H, D, D)
    layout, _, _ = token_layout(T, 64)
    opts = StageOptions("pallas", GATES[kind], gate_bound=None, tokens=T)
    st = stages_for(opts)

    def forward(q, k, v, g, beta):
        G = st.gate(g, layout)
        terms = st.intra(q, k, v, G, beta, D ** -0.5, layout)
        return st.state_output(terms, layout, None, jnp.zeros((1, H, D, D)), False)[0]

    mesh = Mesh(jax.devices()[:2], ("model",))
    o = jax.eval_shape(jax.shard_map(forward, mesh=mesh, in_specs=P(), out_specs=P()),
                       q, k, v, g, beta)
    chex.assert_shape(o, (1, T, H, D))
