"""Pallas (Triton-lowered) chunk state recurrences of both gates (the ``gate`` argument:
GDN's scalar decay or KDA's per-channel one): the sequential part of the delta rule.

Twins of ``jaxcp.xla.state`` with the same signatures and layout: chunks on axis 0, then
batch B and value heads HV; w, kd [NT, B, HV, C, K], u [NT, B, HV, C, V], decay
[NT, B, HV, Kg] with Kg = ``gate.width(K)``; layout fields [NT, B]; states [B, HV, K, V] float32. In addition,
with token_major, ``state_output``'s o, ``state_bwd``'s do and the bare q, k of row-factored
terms (GDN's; KDA's terms are plain) are token-major, [B, T, HV, ...], chunk c at the rows
``layout.token_start[c]`` on (c C without a table; ``chunk_rows``).

One program per (batch, value head, block of BV state columns, ``StateBlocks``) runs a fori_loop over the
chunks with its [K, BV] slice of the state in fp32 registers:

    forward   S_c = init[seq_c] if starts_c else S;  v_new = u_c - w_c S_c
              S   = decay_c * S_c + kd_c^T v_new
    backward  X   = carry + [ends_c] dF[seq_c];  dvn = attn_c^T do_c + kd_c X
              dh  = decay_c * X + qg_c^T do_c - w_c^T dvn;  carry = 0 if starts_c else dh
              d_init[seq_c] = dh if starts_c

Row-factored terms (``ChunkTerms``: qg = diag(q_rows) q, kd = diag(k_rows) k) are used as
kd^T v_new = k^T (diag(k_rows) v_new), qg S = diag(q_rows) (q S), kd X = diag(k_rows) (k X)
and qg^T do = q^T (diag(q_rows) do): the row factors scale [C, BV] tiles.

Columns of the state are independent in both directions, so the BV blocks never talk.
The CP summary runs the forward twice, in one launch (columns [S_ext | M]) or two: from zero
with u (S_ext), and from the identity with u = 0 (the transition M, K columns).

A sequence start resets the state, so what leaves the last chunk depends only on the chunks
from the last start on, and what enters chunk 0 (backward) only on the chunks before the
first start after it. The calls that return only that one state (``state_last``,
``cp_summary``, ``state_bwd(entry_only=True)``) loop over those chunks alone (``_span_loop``):
with packed sequences, a fraction of the device's chunks; M is zero, and not run, on a device
where any sequence starts.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.gate import Gate
from jaxcp.layout import ChunkLayout
from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import ChunkRows, has_table, loop_rows, slab_spec
from jaxcp.pallas.triton.common.launch import FULL_GRID, StateBlocks
from jaxcp.pallas.triton.common.products import Fp32Products, KernelPrecision, dot
from jaxcp.terms import ChunkTerms
from jaxcp.vma import vary_like


def _scale_rows(x, rows_ref, i):
    """diag(rows_c) x for chunk i, or x when the terms are not row-factored (rows_ref None)."""
    return x if rows_ref is None else rows_ref[i][:, None] * x


# Loop spans: per batch row [B] int32, the first loop step (forward: chunk; backward:
# nt - 1 - chunk) whose chunk reaches the one state a call returns (``_span_loop``).

def _span_after_last_start(layout: ChunkLayout) -> jax.Array:
    """The state after the last chunk: chunks from the last sequence start (0 if none)."""
    starts = layout.chunk_starts != 0
    chunk = lax.broadcasted_iota(jnp.int32, starts.shape, 0)
    return jnp.max(jnp.where(starts, chunk, 0), axis=0)


def _span_of_transition(layout: ChunkLayout) -> jax.Array:
    """The transition M: every chunk if no sequence starts on the device, else none (M = 0:
    a start drops the state that entered)."""
    NT = layout.chunk_starts.shape[0]
    return jnp.where(jnp.any(layout.chunk_starts != 0, axis=0), NT, 0).astype(jnp.int32)


def _span_before_first_start(layout: ChunkLayout) -> jax.Array:
    """The cotangent entering chunk 0 (reverse loop): chunks before the first start after
    chunk 0 (all if none)."""
    NT = layout.chunk_starts.shape[0]
    starts = layout.chunk_starts[1:] != 0
    chunk = lax.broadcasted_iota(jnp.int32, starts.shape, 0) + 1
    return NT - jnp.min(jnp.where(starts, chunk, NT), axis=0, initial=NT)


def _span_loop(span_ref, nt: int, body, init, chunk_values, ahead: bool):
    """fori_loop(first, nt, ...) of body(step, carry, values) from the span's first step of
    this batch row, or over all nt steps when span_ref is None. The loop starts from init
    when it runs every step, else from zero (its first chunk is then a reset, or M is zero).
    values = chunk_values(step), the step's per-chunk scalars and decay. With ahead they are
    loaded during the step before and carried, so that the state's chain never waits for
    their loads (GDN; KDA's carried [K] decay made its kernels slower on an H200), else at
    the top of the step. Returns the last carry."""
    if span_ref is None:
        first, start = 0, init
    else:
        first = span_ref[0]
        start = jnp.where(first == 0, init, 0.0)
    if not ahead:
        return lax.fori_loop(first, nt, lambda step, carry: body(step, carry,
                                                                 chunk_values(step)), start)

    values_of = lambda step: chunk_values(jnp.minimum(step, nt - 1))

    def step_with_values(step, carry_values):
        carry, values = carry_values
        following = values_of(step + 1)
        return body(step, carry, values), following

    return lax.fori_loop(first, nt, step_with_values, (start, values_of(first)))[0]


def _token_rows(r, token_major: bool, C: int) -> Callable[..., ChunkRows] | None:
    """Chunk i -> its rows in the token slabs (``chunk_rows.loop_rows`` of the refs r), or
    None where the kernel reads the chunk layout (not token_major)."""
    return partial(loop_rows, r, C) if token_major else None


def _chunk_of(ref, i, rows: Callable[..., ChunkRows] | None):
    """Chunk i of a chunk-layout block [NT, C, d] (rows None) or of a token slab."""
    return ref[i] if rows is None else rows(i).load(ref)


def _decay(dec_ref, i, gate: Gate):
    """exp(G_C) of chunk i as a column to scale rows of the state: [1, 1] or [K, 1]."""
    if gate is Gate.SCALAR:
        return dec_ref[i]
    return dec_ref[i, :][:, None]


def _scalar_decay(dec_ref, i, gate: Gate):
    """GDN's chunk decay, for loading a chunk ahead; None for KDA, whose [K] decay is read
    where the state is decayed."""
    return _decay(dec_ref, i, gate) if gate is Gate.SCALAR else None


class _Specs(NamedTuple):
    """BlockSpecs of the grid (batch, value head, block of BV state columns)."""
    chunk_k: pl.BlockSpec      # [NT, C, K] tiles of one head
    token_k: pl.BlockSpec      # bare q, k: chunk_k, or the [T, K] slab of [B, T, HV, K]
    rows: pl.BlockSpec         # [NT, C] row factors
    chunk_v: pl.BlockSpec      # [NT, C, BV]
    token_v: pl.BlockSpec      # o or do: chunk_v, or the [T, BV] slab of [B, T, HV, V]
    chunk_cc: pl.BlockSpec     # [NT, C, C]
    chunk_state: pl.BlockSpec  # [NT, K, BV]
    per_chunk: pl.BlockSpec    # [NT] layout fields of one batch row
    decay: pl.BlockSpec        # [NT] (scalar gate) or [NT, K]
    state: pl.BlockSpec        # [K, BV]
    seq_state: Callable        # n_seqs -> [N, K, BV] (initial states, final-state cotangents)
    span: pl.BlockSpec         # [1] of a [B] loop span


def _specs(NT: int, C: int, K: int, BV: int, gate: Gate, T: int | None) -> _Specs:
    """T: the token slabs' length (token-major), or None (chunk layout)."""
    chunk_v = pl.BlockSpec((NT, None, None, C, BV), lambda b, h, j: (0, b, h, 0, j))
    chunk_k = pl.BlockSpec((NT, None, None, C, K), lambda b, h, j: (0, b, h, 0, 0))
    return _Specs(
        chunk_k=chunk_k,
        token_k=chunk_k if T is None else slab_spec(T, K, lambda b, h, j: (b, h, 0)),
        rows=pl.BlockSpec((NT, None, None, C), lambda b, h, j: (0, b, h, 0)),
        chunk_v=chunk_v,
        token_v=chunk_v if T is None else slab_spec(T, BV, lambda b, h, j: (b, h, j)),
        chunk_cc=pl.BlockSpec((NT, None, None, C, C), lambda b, h, j: (0, b, h, 0, 0)),
        chunk_state=pl.BlockSpec((NT, None, None, K, BV), lambda b, h, j: (0, b, h, 0, j)),
        per_chunk=pl.BlockSpec((NT, None), lambda b, h, j: (0, b)),
        decay=(pl.BlockSpec((NT, None, None), lambda b, h, j: (0, b, h))
               if gate is Gate.SCALAR else
               pl.BlockSpec((NT, None, None, K), lambda b, h, j: (0, b, h, 0))),
        state=pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j)),
        seq_state=lambda n: pl.BlockSpec((n, None, K, BV), lambda b, h, j: (0, h, 0, j)),
        span=pl.BlockSpec((1,), lambda b, h, j: (b,)),
    )


class _Call(NamedTuple):
    """What every state kernel call starts from: shapes, the state-column block, the decay
    operand, the BlockSpecs and the inputs every kernel reads (w, kd, decay, the layout's
    chunk_starts and chunk_seq, its token table when token-major and it has one, k_rows
    when row-factored)."""
    NT: int
    B: int
    HV: int
    C: int
    K: int
    BV: int
    T: int | None
    blocks: StateBlocks
    sp: _Specs
    ins: Operands


def _start(terms: ChunkTerms, layout: ChunkLayout, cols: int, gate: Gate, token_major: bool,
           precision: KernelPrecision, blocks: StateBlocks | None, kernel: str,
           tokens: int | None = None) -> _Call:
    """The _Call of kernel `kernel` over `cols` state columns (token_major: o or do, and
    the bare q, k of row-factored terms, are [B, T, HV, ...]; T is the bare q's length, or
    tokens for plain terms). blocks None: ``StateBlocks.kda`` or ``StateBlocks.gdn`` of
    the kernel."""
    NT, B, HV, C, K = terms.w.shape
    if terms.decay.shape[-1] != gate.width(K):
        raise ValueError(f"terms: decay [..., {terms.decay.shape[-1]}] does not match the "
                         f"{gate.value} gate (width {gate.width(K)})")
    factored = terms.k_rows is not None
    if blocks is None:
        choose = StateBlocks.kda if gate is Gate.CHANNEL else StateBlocks.gdn
        blocks = choose(kernel, K, cols, B * HV)
    BV = blocks.cols(cols)
    T = None
    if token_major:
        T = terms.qg.shape[1] if factored else tokens
    sp = _specs(NT, C, K, BV, gate, T)
    ins = Operands()
    ins.add("w", sp.chunk_k, terms.w.astype(precision.tile_dtype))
    ins.add("kd", sp.token_k if factored else sp.chunk_k,
            terms.kd.astype(precision.tile_dtype))
    ins.add("decay", sp.decay, terms.decay[..., 0] if gate is Gate.SCALAR else terms.decay)
    ins.add("starts", sp.per_chunk, layout.chunk_starts.astype(jnp.int32))
    ins.add("seq", sp.per_chunk, layout.chunk_seq)
    if token_major and has_table(layout):
        ins.add("token_start", sp.per_chunk, layout.token_start)
        ins.add("token_count", sp.per_chunk, layout.token_count)
    if factored:
        ins.add("k_rows", sp.rows, terms.k_rows)
    return _Call(NT, B, HV, C, K, BV, T, blocks, sp, ins)


def _per_seq_output(c: _Call, name: str, n_seqs: int, cols: int, like) -> None:
    """A zeros [N, HV, K, cols] input, aliased to the output of the same role: the kernel
    stores the rows of the sequences it sees (``pl.when``) and the others stay zero."""
    c.ins.add(name, c.sp.seq_state(n_seqs),
              vary_like(jnp.zeros((n_seqs, c.HV, c.K, cols), jnp.float32), like))


_FwdRefs = refs_type("_FwdRefs", "w kd decay starts seq carry last",
                      "token_start token_count k_rows u qg attn ends q_rows init span finals_zeros h v_new o finals")


def _fwd_kernel(*refs, names, nt, gate, split_state, token_major, interpret, products,
                scaled_float16, transition_from=None):
    """transition_from: the programs from this column block on run the transition M (u = 0,
    no initial states: their columns of carry are the identity's), and only they take
    split_state."""
    r = named(_FwdRefs, names, refs)
    transition = (False if transition_from is None
                  else pl.program_id(2) >= transition_from)
    if transition_from is not None and split_state:
        split_state = transition          # the transition's programs only
    mul = lambda a, b: dot(a, b, interpret=interpret, split=split_state, products=products,
                           scaled_float16=scaled_float16)
    rows = _token_rows(r, token_major, r.w.shape[1])
    qk_rows = rows if r.k_rows is not None else None

    def chunk_values(i):
        """Chunk i's (starts, seq, ends, decay); seq and ends where the kernel reads them."""
        reads_seq = r.init is not None or r.finals is not None
        return (r.starts[i], r.seq[i] if reads_seq else None,
                r.ends[i] if r.finals is not None else None, _scalar_decay(r.decay, i, gate))

    def body(i, state, values):
        starts, seq, ends, decay = values
        if r.init is not None:
            fresh = jnp.where(transition, 0.0, r.init[seq])
        else:
            fresh = jnp.zeros_like(state)
        state = jnp.where(starts != 0, fresh, state)
        if r.h is not None:
            r.h[i] = state.astype(r.h.dtype)
        w_s = mul(r.w[i], state)
        v_new = -w_s if r.u is None else jnp.where(transition, -w_s, r.u[i] - w_s)
        if r.v_new is not None:
            r.v_new[i] = v_new.astype(r.v_new.dtype)
        if r.o is not None:
            o = (_scale_rows(mul(_chunk_of(r.qg, i, qk_rows), state), r.q_rows, i)
                 + mul(r.attn[i], v_new))
            if rows is None:
                r.o[i] = o.astype(r.o.dtype)
            else:
                rows(i).store(r.o, o)
        if decay is None:
            decay = _decay(r.decay, i, gate)
        out = (decay * state
               + mul(_chunk_of(r.kd, i, qk_rows).T, _scale_rows(v_new, r.k_rows, i)))
        if r.finals is not None:
            @pl.when(ends != 0)
            def _():
                r.finals[seq] = out
        return out

    r.last[...] = _span_loop(r.span, nt, body, r.carry[...].astype(jnp.float32),
                             chunk_values, ahead=gate is Gate.SCALAR)


def _run_forward(terms: ChunkTerms, layout: ChunkLayout, init, h0, *, gate: Gate,
                 u_cols: bool, store_h: bool, interpret: bool, precision: KernelPrecision,
                 with_output: bool = False, with_finals: bool = False,
                 token_major: bool = False, split_state: bool = False,
                 span: jax.Array | None = None, blocks: StateBlocks | None = None,
                 tokens: int | None = None, out_dtype=None, name: str):
    """The forward recurrence over state columns of width h0.shape[-1] (V with u, or K for
    the transition with u = 0); with_output adds o (token_major: [B, T, HV, V]),
    with_finals the final states; split_state: the state and v_new meet bf16 tiles as two
    bf16 parts each (``products.dot``); span ([B], ``_span_loop``): loop over those chunks
    only (only the last state is then meaningful); precision, tokens, out_dtype: as in
    ``state_output``. Returns the outputs by name: h, v_new (store_h), o, finals, last."""
    cols = h0.shape[-1]
    dot_dtype, tile_dtype = precision.dot_dtype, precision.tile_dtype
    c = _start(terms, layout, cols, gate, token_major, precision, blocks, name, tokens)
    NT, B, HV, C, K, sp, ins = c.NT, c.B, c.HV, c.C, c.K, c.sp, c.ins
    factored = terms.k_rows is not None
    if with_output and token_major and c.T is None:
        raise ValueError("tokens: a token-major o from plain terms needs T, the length of "
                         "the token tensors")
    if u_cols:
        ins.add("u", sp.chunk_v, terms.u.astype(dot_dtype))
    if with_output:
        ins.add("qg", sp.token_k if factored else sp.chunk_k, terms.qg.astype(tile_dtype))
        ins.add("attn", sp.chunk_cc, terms.attn.astype(tile_dtype))
        ins.add("ends", sp.per_chunk, layout.chunk_ends.astype(jnp.int32))
        if factored:
            ins.add("q_rows", sp.rows, terms.q_rows)
    if init is not None:
        ins.add("init", sp.seq_state(init.shape[0]), init)
    if span is not None:
        ins.add("span", sp.span, span)
    ins.add("carry", sp.state, h0)
    n_seqs = layout.seq_ends_here.shape[0]
    if with_finals:
        _per_seq_output(c, "finals_zeros", n_seqs, cols, terms.w)

    def outs(out, struct):
        if store_h:
            out.add("h", sp.chunk_state, struct((NT, B, HV, K, cols), dot_dtype))
            out.add("v_new", sp.chunk_v, struct((NT, B, HV, C, cols), dot_dtype))
        if with_output:
            o_shape = (B, c.T, HV, cols) if token_major else (NT, B, HV, C, cols)
            out.add("o", sp.token_v, struct(o_shape, out_dtype or terms.u.dtype))
        if with_finals:
            out.add("finals", sp.seq_state(n_seqs), struct((n_seqs, HV, K, cols), jnp.float32))
        out.add("last", sp.state, struct((B, HV, K, cols), jnp.float32))

    tile_bytes = C * ((2 * K + (K + C if with_output else 0)) * jnp.dtype(tile_dtype).itemsize
                      + c.BV * jnp.dtype(dot_dtype).itemsize)
    return call(_fwd_kernel, (B, HV, cols // c.BV), ins, outs, name=name,
                params=c.blocks.params(interpret, tile_bytes),
                aliases={"finals_zeros": "finals"} if with_finals else None, nt=NT,
                gate=gate, split_state=split_state, token_major=token_major,
                interpret=interpret, products=precision.products,
                scaled_float16=precision.scaled_float16)[0]


def state_output(terms, layout, init, h0, with_finals: bool, *, gate: Gate, token_major=False,
                 interpret=False, precision: KernelPrecision = KernelPrecision(),
                 blocks: StateBlocks | None = None, tokens: int | None = None,
                 out_dtype=None):
    """Twin of xla.output.state_output: the forward recurrence fused with the output
    o_c = qg_c S_c + attn_c v_new_c (nothing per chunk but o is written) and, with_finals,
    the state after each sequence's last chunk (zero for sequences that end elsewhere).
    Returns (o [NT, B, HV, C, V], or [B, T, HV, V] with token_major, in out_dtype (the
    dtype of u if None); finals [N, HV, K, V] or None). precision: the kernel reads w, kd,
    qg and attn in its tile_dtype, u in its dot_dtype, and fp32 tiles meet the fp32 state
    at its products (``products.dot``). A float16 tile_dtype with float32 dot_dtype and
    TF32 products: the 10-bit mantissa a TF32 product keeps of them anyway, at half the
    bytes, for terms whose magnitudes fit float16 (with precision.scaled_float16, the
    products are ``products.scaled_float16_dot``). tokens: T,
    the length of a token-major o from plain terms (KDA's; row-factored terms carry it)."""
    out = _run_forward(terms, layout, init, h0, gate=gate, u_cols=True, store_h=False,
                       interpret=interpret, precision=precision, with_output=True,
                       with_finals=with_finals, token_major=token_major, blocks=blocks,
                       tokens=tokens, out_dtype=out_dtype, name="state_output")
    return out["o"], out.get("finals")


def state_fwd(terms, layout, init, h0, *, gate: Gate, token_major=False, interpret=False,
              precision: KernelPrecision = KernelPrecision(),
              blocks: StateBlocks | None = None):
    """Twin of xla.state.state_fwd: (h [NT, B, HV, K, V], v_new [NT, B, HV, C, V], last);
    h and v_new in precision.dot_dtype (they feed only the backward's products). precision
    as in ``state_output``."""
    out = _run_forward(terms, layout, init, h0, gate=gate, u_cols=True, store_h=True,
                       interpret=interpret, precision=precision, token_major=token_major,
                       blocks=blocks, name="state_fwd")
    return out["h"], out["v_new"], out["last"]


def _unless_unused(span: jax.Array, unused: jax.Array | None, nt: int) -> jax.Array:
    """The span, or none of the chunks (a zero result) where the caller never reads it."""
    return span if unused is None else jnp.where(unused, nt, span).astype(jnp.int32)


def state_last(terms, layout, init, h0, *, gate: Gate, unused=None, token_major=False,
               interpret=False, precision: KernelPrecision = KernelPrecision(),
               blocks: StateBlocks | None = None):
    """Twin of xla.state.state_last: the state after the last chunk (the chunks from the last
    sequence start on are run; none, and a zero state, where unused). precision as in
    ``state_output``."""
    span = _unless_unused(_span_after_last_start(layout), unused, terms.w.shape[0])
    return _run_forward(terms, layout, init, h0, gate=gate, u_cols=True, store_h=False,
                        interpret=interpret, precision=precision, token_major=token_major,
                        span=span, blocks=blocks, name="state_last")["last"]


def _one_launch_fits(precision: KernelPrecision, programs: int) -> bool:
    """Whether ``cp_summary`` runs S_ext and M in one launch: where their programs together
    fill the GPU at most once (more would queue behind each other, measured slower:
    docs/benchmarks/cp_w4.md), and both halves keep their products in it: bf16 or float16
    tiles (M's two parts, S_ext's one), or fp32 ones at 3xTF32 for both."""
    same_products = (precision.tile_dtype != jnp.float32
                     or precision.products is Fp32Products.TF32X3)
    return same_products and programs <= FULL_GRID


def cp_summary(terms, layout, init, *, gate: Gate, unused=None, token_major=False,
               interpret=False, precision: KernelPrecision = KernelPrecision(),
               blocks: StateBlocks | None = None, one_launch: bool | None = None):
    """Twin of xla.state.cp_summary: (S_ext [B, HV, K, V], M [B, HV, K, K]). S_ext takes
    precision (``state_output``); M, which chains the states of all devices before, stays
    fp32-accurate: bf16 tiles meet it (and v_new) as two bf16 parts (``products.dot``),
    float16 ones as two TF32 products, fp32 ones at 3xTF32.
    one_launch: the state [S_ext | M], K x (V + K), runs from [0 | I] in one launch, its
    first V columns with u and the initial states, the last K with u = 0, so that the
    programs of both run side by side; else two launches, S_ext's and M's (M's tiles in
    precision.dot_dtype). None: one launch where ``_one_launch_fits``.
    unused (bool scalar, the last device's summary): no chunk is run and both are zero."""
    NT, B, HV, C, K = terms.w.shape
    V = terms.u.shape[-1]
    c = _start(terms, layout, math.gcd(V, K), gate, token_major, precision, blocks,
               "cp_summary")
    if one_launch is None:
        one_launch = _one_launch_fits(precision, B * HV * (V + K) // c.BV)
    m_span = _unless_unused(_span_of_transition(layout), unused, NT)
    zeros = jnp.zeros((B, HV, K, V), jnp.float32)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, HV, K, K))
    if not one_launch:
        ext = state_last(terms, layout, init, zeros, gate=gate, unused=unused,
                         token_major=token_major, interpret=interpret, precision=precision,
                         blocks=blocks)
        m = _run_forward(terms, layout, None, eye, gate=gate, u_cols=False, store_h=False,
                         token_major=token_major, interpret=interpret,
                         precision=KernelPrecision(dot_dtype=precision.dot_dtype,
                                                   tile_dtype=precision.dot_dtype),
                         split_state=True, span=m_span, blocks=blocks,
                         name="cp_transition")["last"]
        return ext, m
    BV, ins = c.BV, c.ins              # a block of columns lies in S_ext or in M
    n_ext = V // BV
    ext_block = lambda j: jnp.minimum(j, n_ext - 1)
    ins.add("u", pl.BlockSpec((NT, None, None, C, BV),
                              lambda b, h, j: (0, b, h, 0, ext_block(j))),
            terms.u.astype(precision.dot_dtype))
    if init is not None:
        ins.add("init", pl.BlockSpec((init.shape[0], None, K, BV),
                                     lambda b, h, j: (0, h, 0, ext_block(j))), init)
    ins.add("span", pl.BlockSpec((1,), lambda b, h, j: (2 * b + (j >= n_ext).astype(jnp.int32),)),
            jnp.stack([_unless_unused(_span_after_last_start(layout), unused, NT), m_span],
                      axis=1).reshape(2 * B))
    ins.add("carry", c.sp.state, jnp.concatenate([zeros, eye], axis=-1))

    def outs(out, struct):
        out.add("last", c.sp.state, struct((B, HV, K, V + K), jnp.float32))

    tile_bytes = C * (2 * K * jnp.dtype(precision.tile_dtype).itemsize
                      + BV * jnp.dtype(precision.dot_dtype).itemsize)
    last = call(_fwd_kernel, (B, HV, (V + K) // BV), ins, outs, name="cp_summary",
                params=c.blocks.params(interpret, tile_bytes), nt=NT, gate=gate,
                split_state=True, token_major=token_major, interpret=interpret,
                products=precision.products, scaled_float16=precision.scaled_float16,
                transition_from=n_ext)[0]["last"]
    return last[..., :V], last[..., V:]


_BwdRefs = refs_type("_BwdRefs", "w kd decay starts seq qg attn do ends carry d_entry",
                      "token_start token_count k_rows q_rows d_final span d_init_zeros x dvn d_init")


def _bwd_kernel(*refs, names, nt, gate, token_major, interpret, products, scaled_float16,
                dot_dtype):
    r = named(_BwdRefs, names, refs)
    mul = lambda a, b: dot(a, b, interpret=interpret, products=products,
                           scaled_float16=scaled_float16)
    rows = _token_rows(r, token_major, r.w.shape[1])
    qk_rows = rows if r.k_rows is not None else None

    def chunk_values(step):
        """Step's chunk's (starts, seq, ends, decay); seq and ends where the kernel reads
        them."""
        i = nt - 1 - step
        reads_seq = r.d_final is not None or r.d_init is not None
        return (r.starts[i], r.seq[i] if reads_seq else None,
                r.ends[i] if r.d_final is not None else None, _scalar_decay(r.decay, i, gate))

    def body(step, carry, values):
        starts, seq, ends, decay = values
        i = nt - 1 - step
        x = carry
        if r.d_final is not None:
            x = x + jnp.where(ends != 0, r.d_final[seq], 0.0)
        do = _chunk_of(r.do, i, rows).astype(dot_dtype)
        dvn = (mul(r.attn[i].T, do)
               + _scale_rows(mul(_chunk_of(r.kd, i, qk_rows), x), r.k_rows, i))
        if decay is None:
            decay = _decay(r.decay, i, gate)
        dh = (decay * x
              + mul(_chunk_of(r.qg, i, qk_rows).T, _scale_rows(do, r.q_rows, i))
              - mul(r.w[i].T, dvn))
        start = starts != 0
        if r.x is not None:
            r.x[i] = x.astype(r.x.dtype)
            r.dvn[i] = dvn.astype(r.dvn.dtype)
        if r.d_init is not None:
            @pl.when(start)
            def _():
                r.d_init[seq] = dh
        return jnp.where(start, 0.0, dh)

    r.d_entry[...] = _span_loop(r.span, nt, body, r.carry[...], chunk_values,
                                ahead=gate is Gate.SCALAR)


def state_bwd(terms: ChunkTerms, layout: ChunkLayout, do, d_final, d_last, *, gate: Gate,
              with_d_init: bool = False, entry_only: bool = False, unused=None,
              token_major: bool = False, interpret: bool = False,
              precision: KernelPrecision = KernelPrecision(),
              blocks: StateBlocks | None = None):
    """Twin of xla.state.state_bwd: (d_entry, d_init or None, X, dvn), or d_entry alone;
    X and dvn in precision.dot_dtype (they feed only the input cotangents' products). do is
    in chunk layout or, with token_major, [B, T, HV, V], in any float dtype (the kernel
    reads it in dot_dtype: a bf16 do for float32 products is read as is, and widened in
    registers). unused (bool scalar, with entry_only: the first device's d_entry): no chunk
    is run and d_entry is zero. precision as in ``state_output``."""
    V = do.shape[-1]
    dot_dtype, tile_dtype = precision.dot_dtype, precision.tile_dtype
    name = "state_entry_cotangent" if entry_only else "state_bwd"
    c = _start(terms, layout, V, gate, token_major, precision, blocks, name,
               tokens=do.shape[1] if token_major else None)
    NT, B, HV, C, K, sp, ins = c.NT, c.B, c.HV, c.C, c.K, c.sp, c.ins
    factored = terms.k_rows is not None
    with_d_init = with_d_init and not entry_only
    ins.add("qg", sp.token_k if factored else sp.chunk_k, terms.qg.astype(tile_dtype))
    ins.add("attn", sp.chunk_cc, terms.attn.astype(tile_dtype))
    ins.add("do", sp.token_v, do)
    ins.add("ends", sp.per_chunk, layout.chunk_ends.astype(jnp.int32))
    if factored:
        ins.add("q_rows", sp.rows, terms.q_rows)
    if d_final is not None:
        ins.add("d_final", sp.seq_state(d_final.shape[0]), d_final)
    if entry_only:
        ins.add("span", sp.span, _unless_unused(_span_before_first_start(layout), unused, NT))
    ins.add("carry", sp.state, d_last)
    n_seqs = layout.seq_ends_here.shape[0]
    if with_d_init:
        _per_seq_output(c, "d_init_zeros", n_seqs, V, terms.w)

    def outs(out, struct):
        if not entry_only:
            out.add("x", sp.chunk_state, struct((NT, B, HV, K, V), dot_dtype))
            out.add("dvn", sp.chunk_v, struct((NT, B, HV, C, V), dot_dtype))
        if with_d_init:
            out.add("d_init", sp.seq_state(n_seqs), struct((n_seqs, HV, K, V), jnp.float32))
        out.add("d_entry", sp.state, struct((B, HV, K, V), jnp.float32))

    tile_bytes = C * ((3 * K + C) * jnp.dtype(tile_dtype).itemsize
                      + c.BV * jnp.dtype(dot_dtype).itemsize)
    out = call(_bwd_kernel, (B, HV, V // c.BV), ins, outs,
               name=name,
               params=c.blocks.params(interpret, tile_bytes),
               aliases={"d_init_zeros": "d_init"} if with_d_init else None, nt=NT, gate=gate,
               token_major=token_major, interpret=interpret, products=precision.products,
               scaled_float16=precision.scaled_float16,
               dot_dtype=jnp.dtype(dot_dtype))[0]
    if entry_only:
        return out["d_entry"]
    return out["d_entry"], out.get("d_init"), out["x"], out["dvn"]
