"""The Mosaic GPU kernels on a machine without a GPU: their numbers in Mosaic GPU's interpret
mode against their jnp references, and their lowering for CUDA (jax.export), which checks what
interpret mode does not (layouts, shared-memory transforms, wgmma operand shapes)."""
from functools import partial

import chex
import jax
import jax.numpy as jnp
import pytest
from jax import export

from benchmarks.check.mosaic import LIMIT_REFERENCE
from jaxcp.layout import ChunkLayout, from_chunks, to_chunks
from jaxcp.metrics import rel_error
from jaxcp.pallas.mosaic.common import state as mosaic_state
from jaxcp.terms import ChunkTerms
from jaxcp.xla import output as xla_output, state as xla_state


def chunk_problem(NT=3, HV=2, C=64, K=128, V=128, dtype=jnp.bfloat16):
    """Terms of NT chunks in one batch row: sequence 0 enters chunk 0 from h0 and ends there,
    sequence 1 starts at chunk 1 (from init[1]) and ends at the last chunk, and a third
    sequence ends on no chunk here (its final state stays zero)."""
    B = 1
    keys = jax.random.split(jax.random.key(0), 6)
    more_keys = jax.random.split(jax.random.key(1), 3)
    normal = lambda key, shape, s=1.0: jax.random.normal(key, shape) * s
    terms = ChunkTerms(w=normal(keys[0], (NT, B, HV, C, K), 0.1).astype(dtype),
                       u=normal(keys[1], (NT, B, HV, C, V)),
                       qg=normal(more_keys[0], (NT, B, HV, C, K), 0.1).astype(dtype),
                       kd=normal(keys[2], (NT, B, HV, C, K), 0.1).astype(dtype),
                       decay=jax.nn.sigmoid(normal(keys[3], (NT, B, HV, 1))),
                       attn=jnp.tril(normal(more_keys[1], (NT, B, HV, C, C), 0.1)).astype(dtype))
    starts = jnp.zeros((NT, B), bool).at[1].set(True)
    ends = jnp.zeros((NT, B), bool).at[0].set(True).at[NT - 1].set(True)
    seq = jnp.cumsum(starts, axis=0).astype(jnp.int32)
    layout = ChunkLayout(chunk_seq=seq, chunk_starts=starts, chunk_ends=ends,
                         seq_last_chunk=jnp.array([0, NT - 1, 0]),
                         seq_ends_here=jnp.array([True, True, False]),
                         token_start=None, token_count=None)
    init = jnp.concatenate([normal(keys[4], (2, HV, K, V)),
                            normal(more_keys[2], (1, HV, K, V))])
    h0 = normal(keys[5], (B, HV, K, V))
    return terms, layout, init, h0


@pytest.mark.parametrize("with_init, blocks", [(True, None), (False, None), (True, (32, 1))])
def test_state_fwd_interpret_equals_its_reference(with_init, blocks):
    """h and v_new (in the operand dtype) equal the kernel's jnp reference (the recurrence
    with the same operand roundings) to one bf16 rounding step, and the last state is within
    ``LIMIT_REFERENCE`` of it (a vn element that the two float32 accumulation orders round
    to bf16 apart moves a column of it by about 2^-8 of that term); all three are within the
    bf16 limit (relative error 1e-2) of ``xla.state.state_fwd`` in float32. Also with one
    ring slot and 32 state columns per program (what K = 256 takes)."""
    terms, layout, init, h0 = chunk_problem()
    init = init if with_init else None
    blocks = blocks and mosaic_state.StateBlocks(*blocks)
    out = jax.jit(lambda t, l, i, h: mosaic_state.state_fwd(t, l, i, h, blocks=blocks,
                                                            interpret=True))(
        terms, layout, init, h0)
    want = mosaic_state.state_fwd_reference(terms, layout, init, h0)
    chex.assert_shape(out, [x.shape for x in want])
    chex.assert_tree_all_finite(out)
    chex.assert_trees_all_equal_dtypes(out, want)
    one_step = 2.0 ** -8
    chex.assert_trees_all_close(out[:2], want[:2], rtol=one_step, atol=one_step)
    assert rel_error(out[2], want[2]) < LIMIT_REFERENCE["last"]
    exact = xla_state.state_fwd(terms, layout, init, h0)
    assert all(rel_error(a, b) < 1e-2 for a, b in zip(out, exact))


@pytest.mark.parametrize("with_init, with_finals, blocks",
                         [(True, True, None), (False, False, None), (True, True, (32, 1))])
def test_state_output_interpret_equals_its_reference(with_init, with_finals, blocks):
    """o (in the operand dtype) equals the reference's to one bf16 rounding step and the
    finals are within ``LIMIT_REFERENCE`` of it, zero for the sequence that ends elsewhere;
    both within the bf16 limit of ``xla.output.state_output`` in float32. Also with one ring
    slot and 32 state columns per program."""
    terms, layout, init, h0 = chunk_problem()
    init = init if with_init else None
    run = lambda f: jax.jit(lambda t, l, i, h: f(t, l, i, h, with_finals))(
        terms, layout, init, h0)
    blocks = blocks and mosaic_state.StateBlocks(*blocks)
    out = run(partial(mosaic_state.state_output, blocks=blocks, interpret=True))
    want = run(mosaic_state.state_output_reference)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, want)
    chex.assert_tree_all_finite(out)
    one_step = 2.0 ** -8
    chex.assert_trees_all_close(out[0], want[0], rtol=one_step, atol=one_step)
    exact = run(xla_output.state_output)
    assert rel_error(out[0], exact[0]) < 1e-2
    if with_finals:
        assert rel_error(out[1], want[1]) < LIMIT_REFERENCE["last"]
        assert not jnp.any(out[1][2])
        assert rel_error(out[1], exact[1]) < 1e-2
    else:
        assert out[1] is None


def row_factored(terms: ChunkTerms) -> tuple[ChunkTerms, ChunkTerms]:
    """The terms in the row-factored form of the Pallas GDN intra kernel (q, k as token
    tensors [B, T, HV, K] of whole chunks, row factors [NT, B, HV, C]), and the plain
    float32 terms they stand for."""
    NT, B, HV, C, K = terms.w.shape
    keys = jax.random.split(jax.random.key(2), 4)
    token = lambda key: (0.1 * jax.random.normal(key, (B, NT * C, HV, K))).astype(terms.w.dtype)
    rows = lambda key: jax.random.uniform(key, (NT, B, HV, C), minval=0.5, maxval=1.5)
    factored = terms._replace(qg=token(keys[0]), kd=token(keys[1]), q_rows=rows(keys[2]),
                              k_rows=rows(keys[3]))
    chunks = lambda x: to_chunks(x, None, NT, C).astype(jnp.float32)
    plain = terms._replace(qg=factored.q_rows[..., None] * chunks(factored.qg),
                           kd=factored.k_rows[..., None] * chunks(factored.kd),
                           w=terms.w.astype(jnp.float32), attn=terms.attn.astype(jnp.float32))
    return factored, plain


def test_row_factored_terms_interpret_equal_their_reference():
    """Row-factored terms, as the Pallas GDN stages hand them over: both forms equal their
    references (o token-major, in the operand dtype, to one bf16 step; the float32 states
    within ``LIMIT_REFERENCE``), and are within the bf16 limit of ``jaxcp.xla`` on the
    plain float32 terms."""
    terms, layout, init, h0 = chunk_problem()
    factored, plain = row_factored(terms)
    NT, B, HV, C, _ = terms.w.shape
    run = lambda f, t: jax.jit(f)(t, layout, init, h0)
    h, vn, last = run(partial(mosaic_state.state_fwd, interpret=True), factored)
    want = run(mosaic_state.state_fwd_reference, factored)
    one_step = 2.0 ** -8
    chex.assert_trees_all_close((h, vn), want[:2], rtol=one_step, atol=one_step)
    assert rel_error(last, want[2]) < LIMIT_REFERENCE["last"]
    exact = run(xla_state.state_fwd, plain)
    assert all(rel_error(a, b) < 1e-2 for a, b in zip((h, vn, last), exact))

    with_finals = lambda f: lambda *a: f(*a, True)
    o, finals = run(with_finals(partial(mosaic_state.state_output, interpret=True)), factored)
    want = run(with_finals(mosaic_state.state_output_reference), factored)
    chex.assert_shape(o, (B, NT * C, HV, terms.u.shape[-1]))
    chex.assert_trees_all_equal_shapes_and_dtypes((o, finals), want)
    chex.assert_tree_all_finite((o, finals))
    chex.assert_trees_all_close(o, want[0], rtol=one_step, atol=one_step)
    assert rel_error(finals, want[1]) < LIMIT_REFERENCE["finals"]
    o_exact, finals_exact = run(with_finals(xla_output.state_output), plain)
    o_exact = from_chunks(o_exact, None, NT * C)
    assert rel_error(o, o_exact) < 1e-2 and rel_error(finals, finals_exact) < 1e-2


@pytest.mark.parametrize("K, V, blocks, form, factored", [
    (128, 128, (64, 2), "state_fwd", False), (128, 64, (64, 2), "state_fwd", False),
    (128, 256, (64, 2), "state_fwd", False), (128, 128, (64, 2), "state_output", False),
    (128, 128, (64, 2), "state_fwd", True), (128, 128, (64, 2), "state_output", True),
    (256, 256, None, "state_fwd", True), (256, 256, None, "state_output", True)])
def test_state_kernels_lower_for_cuda(K, V, blocks, form, factored):
    """Both forms of the kernel, on plain and on row-factored terms with bf16 u, lower to a
    Mosaic GPU custom call for CUDA, from this CPU machine; at K = 256 with the blocks that
    fit (one ring slot, 32 state columns)."""
    terms, layout, init, h0 = chunk_problem(K=K, V=V)
    if factored:
        terms = row_factored(terms)[0]._replace(u=terms.u.astype(jnp.bfloat16))
    blocks = blocks and mosaic_state.StateBlocks(*blocks)
    assert mosaic_state.takes(terms, layout, init, h0, with_output=form == "state_output",
                              blocks=blocks)
    run = (partial(mosaic_state.state_fwd, blocks=blocks) if form == "state_fwd" else
           lambda *a, **kw: mosaic_state.state_output(*a, True, blocks=blocks, **kw))
    fn = jax.jit(lambda t, l, i, h: run(t, l, i, h))
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
    with pytest.raises(ValueError, match="chunks of 64 .*C = 128"):
        mosaic_state.state_fwd(*chunk_problem(C=128))
    with pytest.raises(ValueError, match="block_cols 128 with 2 slots at C = 64, K = 128 needs"):
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



def test_mosaic_stages_agree_with_the_triton_ones_on_gdn_terms():
    """The kernels the "mosaic" backend runs, on the terms of the Pallas GDN intra kernel
    (bf16 inputs, q and k normalised in it: row-factored, token-major), interpreted: o and
    the finals (state_output), h, v_new and the last state (state_fwd) agree with the Triton
    stages' within the bf16 limits of ``benchmarks.check.kernels``; a layout with a token
    table is left to the Triton kernels (``takes``)."""
    from helpers import make_inputs
    from jaxcp.gate import Gate
    from jaxcp.layout import build_layout
    from jaxcp.stages import stage_options, stages_for
    B, T, HV, D = 1, 128, 2, 128
    q, k, v, g, beta, init = make_inputs("gdn", B, T, HV, HV, D, D, n_states=B)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    opts = stage_options("interpret", Gate.SCALAR, jnp.bfloat16, D, unit_qk=True, tokens=T)
    triton = stages_for(opts)
    layout, _ = build_layout(B, T, 64, None, 0, T)
    decay = triton.gate(g, layout)
    terms = jax.jit(lambda *a: triton.intra(*a, D ** -0.5, layout))(
        bf16(q), bf16(k), bf16(v), decay, beta)
    h0 = jnp.zeros((B, HV, D, D))
    assert mosaic_state.takes(terms, layout, init, h0, with_output=True)

    got = mosaic_state.state_output(terms, layout, init, h0, True, interpret=True)
    want = triton.state_output(terms, layout, init, h0, True)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_tree_all_finite(got)
    assert rel_error(got[0], want[0]) < 5e-3 and rel_error(got[1], want[1]) < 1e-2
    got = mosaic_state.state_fwd(terms, layout, init, h0, interpret=True)
    want = triton.state_fwd(terms, layout, init, h0)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    assert all(rel_error(a, b) < 1e-2 for a, b in zip(got, want))
    from jaxcp.pallas.mosaic.common import state_bwd as mosaic_bwd
    do = bf16(jax.random.normal(jax.random.key(4), v.shape))
    d_final = jax.random.normal(jax.random.key(5), init.shape)
    assert mosaic_bwd.takes(terms, layout, do, h0)
    got = mosaic_bwd.state_bwd(terms, layout, do, d_final, h0, with_d_init=True,
                               interpret=True)
    want = triton.state_bwd(terms, layout, do, d_final, h0, with_d_init=True)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_tree_all_finite(got)
    assert all(rel_error(a, b) < 1e-2 for a, b in zip(got, want))

    packed, _ = build_layout(B, T, 64, jnp.array([0, 50, T], jnp.int32), 0, T)
    assert not mosaic_state.takes(terms, packed, init, h0, with_output=True)
    assert not mosaic_bwd.takes(terms, packed, do, h0)


def test_mosaic_stages_run_the_mosaic_kernels_inside_shard_map_too(monkeypatch):
    """The "mosaic" backend runs the Mosaic kernels inside shard_map (CP) as outside it
    (``stages._mosaic_gdn_stages``); traced only (eval_shape), on the CPU."""
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxcp.gate import Gate
    from jaxcp.layout import build_layout
    from jaxcp.stages import stage_options, stages_for
    terms, _, init, h0 = chunk_problem()
    terms, _ = row_factored(terms)
    terms = terms._replace(u=terms.u.astype(jnp.bfloat16))
    layout, _ = build_layout(1, terms.kd.shape[1], 64, None, 0, terms.kd.shape[1])
    from jaxcp.pallas.mosaic.common import state_bwd as mosaic_bwd
    ran = []
    real = mosaic_state.state_output
    monkeypatch.setattr(mosaic_state, "state_output",
                        lambda *a, **kw: ran.append("mosaic") or real(*a, **kw))
    real_bwd = mosaic_bwd.state_bwd
    monkeypatch.setattr(mosaic_bwd, "state_bwd",
                        lambda *a, **kw: ran.append("mosaic bwd") or real_bwd(*a, **kw))
    T = terms.kd.shape[1]
    stages = stages_for(stage_options("mosaic", Gate.SCALAR, jnp.bfloat16, 128, unit_qk=True,
                                      tokens=T))
    run = lambda h: stages.state_output(terms, layout, init, h, True)[0]
    jax.eval_shape(run, h0)
    assert ran == ["mosaic"]
    mesh = Mesh(jax.devices()[:2], ("seq",))
    jax.eval_shape(jax.shard_map(lambda h: run(h[0])[None], mesh=mesh, in_specs=P("seq"),
                                 out_specs=P("seq")), jnp.stack([h0, h0]))
    assert ran == ["mosaic", "mosaic"]
    do = jnp.zeros((1, T, terms.w.shape[2], terms.u.shape[-1]), jnp.bfloat16)
    jax.eval_shape(lambda h: stages.state_bwd(terms, layout, do, None, h), h0)
    assert ran[-1] == "mosaic bwd"


@pytest.mark.parametrize("K", [128, 256])
def test_mosaic_stages_choose_the_state_kernels_by_width(monkeypatch, K):
    """The "mosaic" backend runs the forward's state_output on Mosaic GPU at every width,
    and the backward's state passes (state_fwd, state_bwd) up to
    ``MOSAIC_BACKWARD_STATE_MAX_K`` only, the Triton kernels above it; traced only."""
    from jaxcp.gate import Gate
    from jaxcp.layout import build_layout
    from jaxcp.pallas.mosaic.common import state_bwd as mosaic_bwd
    from jaxcp.stages import MOSAIC_BACKWARD_STATE_MAX_K, stage_options, stages_for
    terms, _, init, h0 = chunk_problem(K=K, V=K)
    terms, _ = row_factored(terms)
    terms = terms._replace(u=terms.u.astype(jnp.bfloat16))
    T = terms.kd.shape[1]
    layout, _ = build_layout(1, T, 64, None, 0, T)
    ran = []
    for module, name in ((mosaic_state, "state_output"), (mosaic_state, "state_fwd"),
                         (mosaic_bwd, "state_bwd")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw:
                            ran.append(_name) or _real(*a, **kw))
    stages = stages_for(stage_options("mosaic", Gate.SCALAR, jnp.bfloat16, K, unit_qk=True,
                                      tokens=T))
    do = jnp.zeros((1, T, terms.w.shape[2], K), jnp.bfloat16)
    jax.eval_shape(lambda h: stages.state_output(terms, layout, init, h, True), h0)
    jax.eval_shape(lambda h: stages.state_fwd(terms, layout, init, h), h0)
    jax.eval_shape(lambda h: stages.state_bwd(terms, layout, do, None, h), h0)
    backward = ["state_fwd", "state_bwd"] if K <= MOSAIC_BACKWARD_STATE_MAX_K else []
    assert ran == ["state_output"] + backward


def intra_inputs(NT=2, HV=2, K=128, V=128, correlated=False, gates=None, T=None,
                 cu_seqlens=None):
    """bf16 token tensors of NT whole chunks of 64 (one batch row), or of T tokens, packed
    sequences at cu_seqlens, and their layout; the keys shared by a head plus 10 % noise
    with 10x weaker decays (correlated), or every log-decay at `gates`."""
    from helpers import make_inputs
    from jaxcp.layout import build_layout
    T = T or NT * 64
    q, k, v, g, beta, _ = make_inputs("gdn", 1, T, HV, HV, K, V, correlated_keys=correlated)
    if gates is not None:
        g = jnp.full_like(g, gates)
    cu = None if cu_seqlens is None else jnp.array(cu_seqlens, jnp.int32)
    layout, _ = build_layout(1, T, 64, cu, 0, T)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    return (bf16(q), bf16(k), bf16(v), g, beta), layout


def triton_intra(args, layout, scale, normalize_qk=True):
    """The Triton kernel's terms with the inverse, interpreted, at the "pallas" backend's
    bf16 precision."""
    from jaxcp.pallas.triton.common.products import KernelPrecision
    from jaxcp.pallas.triton.gdn import intra as triton_gdn
    precision = KernelPrecision(dot_dtype=jnp.bfloat16, tile_dtype=jnp.bfloat16, precise=False)
    return triton_gdn.intra_chunk(*args, scale, layout, 64, with_inverse=True, interpret=True,
                                  precision=precision, normalize_qk=normalize_qk)


def assert_intra_terms_close(got: ChunkTerms, want: ChunkTerms, rows_want=None):
    """The bf16 tiles within two bf16 rounding steps of each other (the inverse's float16
    products against the Triton kernel's float32 ones in interpret mode), the float32 row
    factors and decays (q_rows, k_rows, decay) to float32 rounding of want's, or of
    rows_want; q and k are the token tensors as given."""
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_tree_all_finite(got)
    bf16_steps = 2.0 ** -7
    tiles = lambda t: (t.w, t.u, t.attn, t.inv)
    chex.assert_trees_all_close(tiles(got), tiles(want), rtol=bf16_steps, atol=bf16_steps)
    rows = lambda t: (t.q_rows, t.k_rows, t.decay)
    chex.assert_trees_all_close(rows(got), rows_want or rows(want), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal((got.qg, got.kd), (want.qg, want.kd))


@pytest.mark.parametrize("correlated", [False, True])
def test_intra_interpret_equals_the_triton_kernel(correlated):
    """GDN's Mosaic intra kernel (q, k normalised inside it) gives the Triton kernel's terms,
    its inverse included, on random and on correlated keys (where A is far from small);
    w and u within the bf16 limit of the float32 jnp stage."""
    from jaxcp import xla
    from jaxcp.gate import Gate
    from jaxcp.l2norm import l2_normalize
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    args, layout = intra_inputs(correlated=correlated)
    scale = 128 ** -0.5
    got = jax.jit(lambda *a: mosaic_intra.intra_chunk(
        *a, scale, layout, 64, normalize_qk=True, with_inverse=True, interpret=True))(*args)
    assert_intra_terms_close(got, jax.jit(lambda *a: triton_intra(a, layout, scale))(*args))
    q, k, v, g, beta = args
    chunks = lambda x: to_chunks(x.astype(jnp.float32), None, layout.chunk_starts.shape[0], 64)
    exact = xla.intra_chunk(chunks(l2_normalize(q)), chunks(l2_normalize(k)), chunks(v),
                            chunks(g[..., None]), chunks(beta), scale, gate=Gate.SCALAR)
    assert rel_error(got.w, exact.w) < 1e-2 and rel_error(got.u, exact.u) < 1e-2


@pytest.mark.parametrize("T, cu_seqlens, K, V", [(128, (0, 1, 70, 128), 128, 128),
                                                 (96, None, 128, 128),
                                                 (128, (0, 1, 70, 128), 256, 256),
                                                 (128, (0, 1, 70, 128), 64, 256)])
def test_intra_interpret_reads_chunks_by_the_token_table(T, cu_seqlens, K, V):
    """Packed sequences (a 1-token one among them) and T not a multiple of 64: the kernel
    reads each chunk from its first token through the staging tiles (rows of 256 in two
    pieces) and gives the Triton kernel's terms, zero past each chunk's tokens."""
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    args, layout = intra_inputs(T=T, cu_seqlens=cu_seqlens, K=K, V=V)
    assert layout.token_start is not None
    got = jax.jit(lambda *a: mosaic_intra.intra_chunk(
        *a, 0.1, layout, 64, normalize_qk=True, with_inverse=True, interpret=True))(*args)
    assert_intra_terms_close(got, jax.jit(lambda *a: triton_intra(a, layout, 0.1))(*args))
    past_tokens = jnp.arange(64)[:, None] >= layout.token_count[:, :, None, None, None]
    past = lambda x: jnp.where(past_tokens, x, jnp.zeros((), x.dtype))
    chex.assert_trees_all_equal((past(got.w), past(got.u)),
                                (jnp.zeros_like(got.w), jnp.zeros_like(got.u)))


def test_a_nan_in_one_packed_sequence_reaches_no_other_intra_chunk():
    """A NaN in q, k and v of one token of the last of three packed sequences: the intra
    kernel (interpreted) gives the other sequences' chunks exactly the terms it gives
    without it, though the 64 rows it reads for the second sequence's last chunk take in
    the NaN's token (``tiles.unstage`` zeroes them)."""
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    (q, k, v, g, beta), layout = intra_inputs(T=128, cu_seqlens=(0, 1, 70, 128))
    assert layout.token_start[2, 0] == 65 and layout.token_count[2, 0] == 5
    run = jax.jit(lambda q, k, v: mosaic_intra.intra_chunk(
        q, k, v, g, beta, 0.1, layout, 64, normalize_qk=True, with_inverse=True,
        interpret=True))
    poison = lambda x: x.at[:, 100].set(jnp.nan)
    clean, poisoned = run(q, k, v), run(poison(q), poison(k), poison(v))
    others = lambda t: (t.w[:3], t.u[:3], t.attn[:3], t.inv[:3], t.q_rows[:3], t.k_rows[:3])
    chex.assert_tree_all_finite(others(poisoned))
    chex.assert_trees_all_equal(others(poisoned), others(clean))


def test_intra_interpret_stays_finite_for_very_negative_gates():
    """Log-decays of -1e3 (every E_ij, j < i, underflows to zero; exp(G) of q's rows too):
    the tiles are finite and equal the Triton kernel's, the row factors the float64 ones
    (the last row's k factor exp(G_C - G_C) = 1 exactly, which the Triton kernel's
    exp(sum(g) - cumsum(g)) misses by the rounding of G at -6.4e4); q and k of unit rows
    (unit_qk)."""
    import numpy as np
    from jaxcp.l2norm import l2_normalize
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    (q, k, v, g, beta), layout = intra_inputs(NT=1, gates=-1e3)
    unit = lambda x: l2_normalize(x).astype(jnp.bfloat16)
    args = (unit(q), unit(k), v, g, beta)
    got = mosaic_intra.intra_chunk(*args, 0.1, layout, 64, normalize_qk=False, unit_qk=True,
                                   with_inverse=True, interpret=True)
    G = np.cumsum(np.asarray(g, np.float64), axis=1)                 # [1, 64, HV]
    rows = lambda x: jnp.asarray(np.moveaxis(x, 1, -1)[None], jnp.float32)   # [1, 1, HV, 64]
    rows_want = (rows(0.1 * np.exp(G)), rows(np.exp(G[:, -1:] - G)),
                 jnp.asarray(np.exp(G[:, -1])[None, :, :, None], jnp.float32))
    assert_intra_terms_close(got, triton_intra(args, layout, 0.1, normalize_qk=False),
                             rows_want)


@pytest.mark.parametrize("K, V, with_inverse, normalize_qk, packed", [
    (128, 128, True, True, False), (128, 128, False, False, False),
    (64, 128, False, True, False), (256, 256, True, False, False),
    (128, 128, False, True, True), (64, 128, True, True, True), (256, 256, True, True, True)])
def test_intra_lowers_for_cuda(K, V, with_inverse, normalize_qk, packed):
    """The kernel, its left operands from registers, lowers to a Mosaic GPU custom call for
    CUDA from this CPU machine, at K = 64 to 256, with and without the kept inverse, the
    in-kernel norm and a token table (packed sequences)."""
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    args, layout = intra_inputs(K=K, V=V, cu_seqlens=(0, 1, 70, 128) if packed else None)
    assert mosaic_intra.takes(*args[:3], layout, 64, normalize_qk=normalize_qk, unit_qk=True)
    fn = jax.jit(lambda *a: mosaic_intra.intra_chunk(
        *a, 0.1, layout, 64, normalize_qk=normalize_qk, unit_qk=True,
        with_inverse=with_inverse))
    assert "mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()


def test_intra_refuses_what_it_does_not_take():
    from jaxcp.layout import build_layout
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    (q, k, v, g, beta), layout = intra_inputs()
    run = lambda *a, layout=layout, chunk_size=64, normalize_qk=True: mosaic_intra.intra_chunk(
        *a, 0.1, layout, chunk_size, normalize_qk=normalize_qk)
    with pytest.raises(ValueError, match="chunk_size 64"):
        run(q, k, v, g, beta, chunk_size=32)
    short, _ = build_layout(1, 32, 64, None, 0, 32)
    with pytest.raises(ValueError, match="T must be at least 64"):
        run(q[:, :32], k[:, :32], v[:, :32], g[:, :32], beta[:, :32], layout=short)
    with pytest.raises(ValueError, match="unit q, k rows"):
        run(q, k, v, g, beta, normalize_qk=False)
    with pytest.raises(ValueError, match="K a multiple of 64"):
        run(q[..., :32], k[..., :32], v, g, beta)
    with pytest.raises(TypeError, match="bfloat16 q, k, v"):
        run(q.astype(jnp.float32), k, v, g, beta)
    with pytest.raises(ValueError, match="v must be"):
        run(q, k, v[:, :64], g, beta)


@pytest.mark.parametrize("cu_seqlens, kernel", [
    (None, "mosaic_gdn_intra_chunk"), ((0, 1, 70, 128), "mosaic_gdn_intra_chunk_table")])
def test_mosaic_stages_run_the_intra_kernel(cu_seqlens, kernel):
    """The "mosaic" backend's intra stage is the Mosaic kernel where it takes the inputs
    (q, k normalised in it; whole chunks or packed sequences): the stage lowers for CUDA to
    that kernel."""
    from jaxcp.gate import Gate
    from jaxcp.stages import StageOptions, stages_for
    stages = stages_for(StageOptions("mosaic", Gate.SCALAR, "bfloat16", normalize_qk=True,
                                     chunk_size=64))
    (q, k, v, g, beta), layout = intra_inputs(cu_seqlens=cu_seqlens)
    fn = jax.jit(lambda *a: stages.intra(*a, 0.1, layout, with_inverse=True))
    text = export.export(fn, platforms=["cuda"])(q, k, v, g, beta).mlir_module()
    assert kernel in text


def bwd_problem(with_final: bool, C: int = 64):
    """Row-factored terms of ``chunk_problem`` (chunks of C), a bf16 token-major do, d_final
    (or None) and d_last, and the plain float32 terms and chunk-layout do they stand for."""
    terms, layout, init, _ = chunk_problem(C=C)
    factored, plain = row_factored(terms)
    NT, B, HV, C, _ = terms.w.shape
    V = terms.u.shape[-1]
    keys = jax.random.split(jax.random.key(3), 3)
    do = (0.1 * jax.random.normal(keys[0], (B, NT * C, HV, V))).astype(jnp.bfloat16)
    d_final = jax.random.normal(keys[1], init.shape) if with_final else None
    d_last = jax.random.normal(keys[2], (B, HV, init.shape[2], V))
    return factored, plain, layout, do, d_final, d_last


@pytest.mark.parametrize("with_final, with_d_init, blocks",
                         [(True, True, None), (False, False, None), (True, True, (32, 1))])
def test_state_bwd_interpret_equals_the_triton_kernel(with_final, with_d_init, blocks):
    """The Mosaic reverse state kernel gives the Triton kernel's X and dvn (bf16) to one bf16
    rounding step and its d_entry and d_init within ``LIMIT_REFERENCE`` (float32
    accumulation orders), and all four are within the bf16 limit of ``xla.state.state_bwd``
    on the plain float32 terms. Also with one ring slot of 32 columns."""
    from jaxcp.gate import Gate
    from jaxcp.pallas.mosaic.common import state_bwd as mosaic_bwd
    from jaxcp.pallas.triton.common import state as triton_state
    from jaxcp.pallas.triton.common.products import KernelPrecision
    factored, plain, layout, do, d_final, d_last = bwd_problem(with_final)
    blocks = blocks and mosaic_state.StateBlocks(*blocks)
    got = jax.jit(lambda t, do, f, d: mosaic_bwd.state_bwd(
        t, layout, do, f, d, with_d_init=with_d_init, blocks=blocks, interpret=True))(
        factored, do, d_final, d_last)
    bf16 = jnp.dtype(jnp.bfloat16)
    want = jax.jit(lambda t, do, f, d: triton_state.state_bwd(
        t, layout, do, f, d, gate=Gate.SCALAR, with_d_init=with_d_init, token_major=True,
        interpret=True, precision=KernelPrecision(dot_dtype=bf16, tile_dtype=bf16)))(
        factored, do, d_final, d_last)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_tree_all_finite(got)
    one_step = 2.0 ** -8
    chex.assert_trees_all_close(got[2:], want[2:], rtol=one_step, atol=one_step)
    assert rel_error(got[0], want[0]) < LIMIT_REFERENCE["last"]
    if with_d_init:
        assert rel_error(got[1], want[1]) < LIMIT_REFERENCE["last"]
    NT, C = plain.w.shape[0], plain.w.shape[-2]
    exact = xla_state.state_bwd(plain, layout, to_chunks(do.astype(jnp.float32), None, NT, C),
                                d_final, d_last, with_d_init=with_d_init)
    pairs = [(got[0], exact[0]), (got[2], exact[2]), (got[3], exact[3])]
    pairs += [(got[1], exact[1])] if with_d_init else []
    assert all(rel_error(a, b) < 1e-2 for a, b in pairs)


def test_state_bwd_refuses_what_it_does_not_take():
    from jaxcp.pallas.mosaic.common import state_bwd as mosaic_bwd
    factored, _, layout, do, d_final, d_last = bwd_problem(True)
    run = lambda t=factored, do=do, d_last=d_last, layout=layout: mosaic_bwd.state_bwd(
        t, layout, do, d_final, d_last)
    with pytest.raises(ValueError, match="scalar gate"):
        run(t=factored._replace(decay=jnp.ones(factored.w.shape[:-2] + (128,))))
    with pytest.raises(ValueError, match="do must be"):
        run(do=do[:, :-1])
    with pytest.raises(ValueError, match="d_last must be"):
        run(d_last=d_last[..., :64])
    with pytest.raises(TypeError, match="bfloat16"):
        run(do=do.astype(jnp.float32))
    wide, _, wide_layout, wide_do, _, wide_last = bwd_problem(False, C=128)
    with pytest.raises(ValueError, match="chunks of 64 .*C = 128"):
        run(t=wide, do=wide_do, d_last=wide_last, layout=wide_layout)
    assert not mosaic_bwd.takes(wide, wide_layout, wide_do, wide_last)


@pytest.mark.parametrize("blocks", [(64, 2), (32, 1)])
def test_state_bwd_lowers_for_cuda(blocks):
    from jaxcp.pallas.mosaic.common import state_bwd as mosaic_bwd
    factored, _, layout, do, d_final, d_last = bwd_problem(True)
    fn = jax.jit(lambda t, do, f, d: mosaic_bwd.state_bwd(
        t, layout, do, f, d, with_d_init=True, blocks=mosaic_state.StateBlocks(*blocks)))
    text = export.export(fn, platforms=["cuda"])(factored, do, d_final, d_last).mlir_module()
    assert "mosaic_gdn_state_bwd" in text
