"""Pallas (Triton-lowered) chunk state recurrences: the sequential part of the delta rule.

Twins of ``jaxcp.xla.state`` with the same signatures and layout: chunks on axis 0, then
batch B and value heads HV; w, kd [NT, B, HV, C, K], u [NT, B, HV, C, V], decay
[NT, B, HV, Kg]; layout fields [NT, B]; states [B, HV, K, V] float32. In addition,
with token_major, ``state_output``'s o, ``state_bwd``'s do and the bare q, k of row-factored
terms are token-major, [B, T, HV, ...], chunk c at the rows ``layout.token_start[c]`` on
(c C without a table; ``jaxcp.pallas.tokens``).

One program per (batch, value head, block of BV state columns) runs a fori_loop over the
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
The CP summary runs the forward twice: from zero with u (S_ext), and from the identity with
u = 0 (the transition M, K columns).

A sequence start resets the state, so what leaves the last chunk depends only on the chunks
from the last start on, and what enters chunk 0 (backward) only on the chunks before the
first start after it. The calls that return only that one state (``state_last``,
``cp_summary``, ``state_bwd(entry_only=True)``) loop over those chunks alone (``_span_loop``):
with packed sequences, a fraction of the device's chunks; M is zero, and not run, on a device
where any sequence starts.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxcp.layout import ChunkLayout
from jaxcp.pallas.tokens import ChunkRows, has_table, slab_spec
from jaxcp.vma import unify, vary_like
from jaxcp.xla.intra import ChunkTerms


def _block_cols(n: int, k: int) -> int:
    """State columns per program: 64, or 32 at K = 256 to stay inside shared memory."""
    return min(n, 32 if k >= 256 else 64)


def _params(interpret: bool, tile_bytes: int):
    """Up to three pipeline stages, as many as the per-chunk tiles fit in 192 KiB of shared
    memory (H100: 227 KiB per block, the rest for the products' operands)."""
    if interpret:
        return {"interpret": True}
    stages = max(1, min(3, (192 * 1024) // max(tile_bytes, 1)))
    return {"compiler_params": pltriton.CompilerParams(num_warps=4, num_stages=stages)}


def fp32_precision(interpret: bool):
    """How the kernels multiply fp32 operands that must stay fp32-accurate: 3xTF32 on tensor
    cores, ~1e-7 relative per product (IEEE fp32 products would be FMA loops on CUDA
    cores); IEEE fp32 in interpret mode (CPU)."""
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot(a, b, interpret: bool, split: bool = False):
    """a @ b with fp32 accumulation. fp32 x fp32 (the fp32 path) runs at ``fp32_precision``.
    An fp32 operand meeting a bf16 tile is rounded to bf16, or with split taken as two bf16
    parts x = hi + lo (two bf16 products, x kept to ~2^-16 relative; 3xTF32 would cost
    three TF32 products, each at half the bf16 rate)."""
    if a.dtype == b.dtype:
        precision = fp32_precision(interpret) if a.dtype == jnp.float32 else None
        return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
    if not split:
        return _bf16_dot(a, b)
    if a.dtype == jnp.float32:
        hi = a.astype(jnp.bfloat16)
        return _bf16_dot(hi, b) + _bf16_dot(a - hi.astype(jnp.float32), b)
    hi = b.astype(jnp.bfloat16)
    return _bf16_dot(a, hi) + _bf16_dot(a, b - hi.astype(jnp.float32))


def _bf16_dot(a, b):
    """a @ b of both operands rounded to bf16, fp32 accumulation."""
    return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)


def _tiles(dtype, *xs):
    """The per-chunk operands of the dots, in the dtype the dots run in."""
    return [x.astype(dtype) for x in xs]


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


def _span_loop(span_ref, nt: int, body, init):
    """fori_loop(first, nt, body, ...) from the span's first step of this batch row, or over
    all nt steps when span_ref is None. The loop starts from init when it runs every step,
    else from zero (its first chunk is then a reset, or M is zero)."""
    if span_ref is None:
        return lax.fori_loop(0, nt, body, init)
    first = span_ref[0]
    return lax.fori_loop(first, nt, body, jnp.where(first == 0, init, 0.0))


class _TokenRows(NamedTuple):
    """Where the chunks of the token slabs are: the layout's token_start, token_count refs
    [NT], or None (chunk i is the rows [i C, (i + 1) C))."""
    start_ref: object | None
    count_ref: object | None
    size: int

    def at(self, i) -> ChunkRows:
        if self.start_ref is None:
            return ChunkRows(i * self.size, None, self.size)
        return ChunkRows(self.start_ref[i], self.count_ref[i], self.size)

    def load(self, ref, i):
        """Chunk i of a token slab [T, d], zero past its tokens."""
        return self.at(i).load(ref)

    def store(self, ref, i, value):
        self.at(i).store(ref, value)


def _token_rows(it, token_major: bool, table: bool, C: int) -> _TokenRows | None:
    """The _TokenRows of a kernel (token_major), taking the table's refs from the iterator
    of its refs when the layout has one."""
    if not token_major:
        return None
    return _TokenRows(next(it), next(it), C) if table else _TokenRows(None, None, C)


def _chunk_of(ref, i, rows: _TokenRows | None):
    """Chunk i of a chunk-layout block [NT, C, d] (rows None) or of a token slab."""
    return ref[i] if rows is None else rows.load(ref, i)


def _decay(dec_ref, i, gdn: bool):
    """exp(G_C) of chunk i as a column to scale rows of the state: [1, 1] or [K, 1]."""
    if gdn:
        return dec_ref[i]
    return dec_ref[i, :][:, None]


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
    decay: pl.BlockSpec        # [NT] (GDN) or [NT, K]
    state: pl.BlockSpec        # [K, BV]
    seq_state: Callable        # n_seqs -> [N, K, BV] (initial states, final-state cotangents)
    span: pl.BlockSpec         # [1] of a [B] loop span


def _specs(NT: int, C: int, K: int, BV: int, gdn: bool, T: int | None) -> _Specs:
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
        decay=(pl.BlockSpec((NT, None, None), lambda b, h, j: (0, b, h)) if gdn else
               pl.BlockSpec((NT, None, None, K), lambda b, h, j: (0, b, h, 0))),
        state=pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j)),
        seq_state=lambda n: pl.BlockSpec((n, None, K, BV), lambda b, h, j: (0, h, 0, j)),
        span=pl.BlockSpec((1,), lambda b, h, j: (b,)),
    )


def _setup(terms: ChunkTerms, cols: int, token_major: bool = False):
    """Shapes, state-column block, gate kind, decay operand and BlockSpecs of one call over
    `cols` state columns (token_major: the bare q, k of the terms and o or do are
    [B, T, HV, ...])."""
    NT, B, HV, C, K = terms.w.shape
    BV = _block_cols(cols, K)
    gdn = terms.decay.shape[-1] == 1
    decay = terms.decay[..., 0] if gdn else terms.decay
    if token_major and terms.q_rows is None:
        raise ValueError("terms: token_major needs the row-factored terms of the Pallas intra "
                         "kernel (bare q, k token-major)")
    T = terms.qg.shape[1] if token_major else None
    return (NT, B, HV, C, K), BV, gdn, decay, _specs(NT, C, K, BV, gdn, T)


def _with_token_rows(sp: _Specs, in_specs: list, args: list, layout: ChunkLayout,
                     token_major: bool) -> bool:
    """Append the layout's token_start, token_count for ``_TokenRows`` (token_major, and the
    layout places chunks by table). Returns whether it did."""
    table = token_major and has_table(layout)
    if table:
        in_specs += [sp.per_chunk, sp.per_chunk]
        args += [layout.token_start, layout.token_count]
    return table


def _with_carry(sp: _Specs, in_specs: list, args: list, carry):
    """Append the carried state [B, HV, K, cols] and unify the vma types of all operands.
    Returns (in_specs, args, out) where out(*shape, dtype=float32) is the ShapeDtypeStruct
    of an output."""
    in_specs.append(sp.state)
    args.append(carry)
    args, mat = unify(args)
    return in_specs, args, lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(
        shape, dtype, manual_axis_type=mat)


def _per_seq_output(sp: _Specs, in_specs: list, args: list, n_seqs: int, cols: int,
                    out_index: int) -> dict:
    """Append a zeros [N, HV, K, cols] operand aliased to output `out_index`: the kernel
    stores the rows of the sequences it sees (``pl.when``) and the others stay zero.
    Returns the input_output_aliases."""
    in_specs.append(sp.seq_state(n_seqs))
    aliases = {len(args): out_index}
    HV, K = args[0].shape[2], args[0].shape[-1]
    args.append(vary_like(jnp.zeros((n_seqs, HV, K, cols), jnp.float32), args[0]))
    return aliases


def _fwd_kernel(*refs, nt, gdn, has_u, has_init, factored, store_h, with_output, with_finals,
                split_state, spanned, token_major, table, interpret):
    dot = partial(_dot, interpret=interpret, split=split_state)
    it = iter(refs)
    w_ref, kd_ref, dec_ref, starts_ref, seq_ref = (next(it) for _ in range(5))
    rows = _token_rows(it, token_major, table, w_ref.shape[1])
    qk_rows = rows if factored else None
    k_rows_ref = next(it) if factored else None
    u_ref = next(it) if has_u else None
    qg_ref, attn_ref, ends_ref = (next(it) for _ in range(3)) if with_output else (None,) * 3
    q_rows_ref = next(it) if factored and with_output else None
    init_ref = next(it) if has_init else None
    span_ref = next(it) if spanned else None
    h0_ref = next(it)
    if with_finals:
        next(it)                                           # zeros, aliased to finals_ref
    h_ref, vn_ref = (next(it), next(it)) if store_h else (None, None)
    o_ref = next(it) if with_output else None
    finals_ref = next(it) if with_finals else None
    last_ref = next(it)

    def body(i, state):
        if has_init:
            fresh = init_ref[seq_ref[i]]
        else:
            fresh = jnp.zeros_like(state)
        state = jnp.where(starts_ref[i] != 0, fresh, state)
        if store_h:
            h_ref[i] = state.astype(h_ref.dtype)
        w_s = dot(w_ref[i], state)
        v_new = u_ref[i] - w_s if has_u else -w_s
        if store_h:
            vn_ref[i] = v_new.astype(vn_ref.dtype)
        if with_output:
            o = (_scale_rows(dot(_chunk_of(qg_ref, i, qk_rows), state), q_rows_ref, i)
                 + dot(attn_ref[i], v_new))
            if rows is None:
                o_ref[i] = o.astype(o_ref.dtype)
            else:
                rows.store(o_ref, i, o)
        out = (_decay(dec_ref, i, gdn) * state
               + dot(_chunk_of(kd_ref, i, qk_rows).T, _scale_rows(v_new, k_rows_ref, i)))
        if with_finals:
            @pl.when(ends_ref[i] != 0)
            def _():
                finals_ref[seq_ref[i]] = out
        return out

    last_ref[...] = _span_loop(span_ref, nt, body, h0_ref[...].astype(jnp.float32))


def _run_forward(terms: ChunkTerms, layout: ChunkLayout, init, h0, *, u_cols: bool, store_h: bool,
                 interpret: bool, dot_dtype, with_output: bool = False, with_finals: bool = False,
                 token_major: bool = False, split_state: bool = False,
                 span: jax.Array | None = None):
    """The forward recurrence over state columns of width h0.shape[-1] (V with u, or K for
    the transition with u = 0); with_output adds o (token_major: [B, T, HV, V]),
    with_finals the final states; split_state: the state and v_new meet bf16 tiles as two
    bf16 parts each (``_dot``); span ([B], ``_span_loop``): loop over those chunks only (only
    the last state is then meaningful). Returns the outputs in the order (h, v_new), o,
    finals, last state."""
    cols = h0.shape[-1]
    (NT, B, HV, C, K), BV, gdn, decay, sp = _setup(terms, cols, token_major)
    has_init = init is not None
    factored = terms.k_rows is not None
    grid = (B, HV, cols // BV)
    in_specs = [sp.chunk_k, sp.token_k if factored else sp.chunk_k, sp.decay, sp.per_chunk,
                sp.per_chunk]
    args = [*_tiles(dot_dtype, terms.w, terms.kd), decay, layout.chunk_starts.astype(jnp.int32),
            layout.chunk_seq]
    table = _with_token_rows(sp, in_specs, args, layout, token_major)
    if factored:
        in_specs.append(sp.rows)
        args.append(terms.k_rows)
    if u_cols:
        in_specs.append(sp.chunk_v)
        args += _tiles(dot_dtype, terms.u)
    if with_output:
        in_specs += [sp.token_k if factored else sp.chunk_k, sp.chunk_cc, sp.per_chunk]
        args += [*_tiles(dot_dtype, terms.qg, terms.attn), layout.chunk_ends.astype(jnp.int32)]
        if factored:
            in_specs.append(sp.rows)
            args.append(terms.q_rows)
    if init is not None:
        in_specs.append(sp.seq_state(init.shape[0]))
        args.append(init)
    if span is not None:
        in_specs.append(sp.span)
        args.append(span)
    in_specs, args, struct = _with_carry(sp, in_specs, args, h0)
    n_seqs = layout.seq_ends_here.shape[0]
    aliases = {}
    if with_finals:
        aliases = _per_seq_output(sp, in_specs, args, n_seqs, cols,
                                  (2 if store_h else 0) + int(with_output))
    out_specs, out_shape = [], []
    if store_h:
        out_specs += [sp.chunk_state, sp.chunk_v]
        out_shape += [struct(NT, B, HV, K, cols, dtype=dot_dtype),
                      struct(NT, B, HV, C, cols, dtype=dot_dtype)]
    if with_output:
        out_specs.append(sp.token_v)
        o_shape = (B, terms.qg.shape[1], HV, cols) if token_major else (NT, B, HV, C, cols)
        out_shape.append(struct(*o_shape, dtype=terms.u.dtype))
    if with_finals:
        out_specs.append(sp.seq_state(n_seqs))
        out_shape.append(struct(n_seqs, HV, K, cols))
    out_specs.append(sp.state)
    out_shape.append(struct(B, HV, K, cols))
    kernel = partial(_fwd_kernel, nt=NT, gdn=gdn, has_u=u_cols, has_init=has_init,
                     factored=factored, store_h=store_h, with_output=with_output,
                     with_finals=with_finals, split_state=split_state,
                     spanned=span is not None, token_major=token_major, table=table,
                     interpret=interpret)
    tile_bytes = C * (2 * K + BV + (K + C if with_output else 0)) * jnp.dtype(dot_dtype).itemsize
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, input_output_aliases=aliases,
                          **_params(interpret, tile_bytes))(*args)


def state_output(terms, layout, init, h0, with_finals: bool, *, token_major=False,
                 interpret=False, dot_dtype=jnp.float32):
    """Twin of xla.output.state_output: the forward recurrence fused with the output
    o_c = qg_c S_c + attn_c v_new_c (nothing per chunk but o is written) and, with_finals,
    the state after each sequence's last chunk (zero for sequences that end elsewhere).
    Returns (o [NT, B, HV, C, V], or [B, T, HV, V] with token_major, in the dtype of u;
    finals [N, HV, K, V] or None)."""
    out = _run_forward(terms, layout, init, h0, u_cols=True, store_h=False, interpret=interpret,
                       dot_dtype=dot_dtype, with_output=True, with_finals=with_finals,
                       token_major=token_major)
    return out[0], (out[1] if with_finals else None)


def state_fwd(terms, layout, init, h0, *, token_major=False, interpret=False,
              dot_dtype=jnp.float32):
    """Twin of xla.state.state_fwd: (h [NT, B, HV, K, V], v_new [NT, B, HV, C, V], last);
    h and v_new in dot_dtype (they feed only the backward's products)."""
    return tuple(_run_forward(terms, layout, init, h0, u_cols=True, store_h=True,
                              interpret=interpret, dot_dtype=dot_dtype, token_major=token_major))


def _unless_unused(span: jax.Array, unused: jax.Array | None, nt: int) -> jax.Array:
    """The span, or none of the chunks (a zero result) where the caller never reads it."""
    return span if unused is None else jnp.where(unused, nt, span).astype(jnp.int32)


def state_last(terms, layout, init, h0, *, unused=None, token_major=False, interpret=False,
               dot_dtype=jnp.float32):
    """Twin of xla.state.state_last: the state after the last chunk (the chunks from the last
    sequence start on are run; none, and a zero state, where unused)."""
    span = _unless_unused(_span_after_last_start(layout), unused, terms.w.shape[0])
    return _run_forward(terms, layout, init, h0, u_cols=True, store_h=False,
                        interpret=interpret, dot_dtype=dot_dtype, token_major=token_major,
                        span=span)[0]


def cp_summary(terms, layout, init, *, unused=None, token_major=False, interpret=False,
               dot_dtype=jnp.float32):
    """Twin of xla.state.cp_summary: (S_ext [B, HV, K, V], M [B, HV, K, K]). M, which
    chains the states of all devices before, stays fp32-accurate: the bf16 tiles meet it
    (and v_new) as two bf16 parts (``_dot``), fp32 tiles at ``fp32_precision``. unused
    (bool scalar, the last device's summary): no chunk is run and both are zero."""
    NT, B, HV, _, K = terms.w.shape
    V = terms.u.shape[-1]
    ext = state_last(terms, layout, init, jnp.zeros((B, HV, K, V), jnp.float32),
                     unused=unused, token_major=token_major, interpret=interpret,
                     dot_dtype=dot_dtype)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, HV, K, K))
    m = _run_forward(terms, layout, None, eye, u_cols=False, store_h=False,
                     token_major=token_major, interpret=interpret, dot_dtype=dot_dtype,
                     split_state=True,
                     span=_unless_unused(_span_of_transition(layout), unused, NT))[0]
    return ext, m


def _bwd_kernel(*refs, nt, gdn, factored, has_final, entry_only, with_d_init, token_major,
                table, interpret):
    dot = partial(_dot, interpret=interpret)
    it = iter(refs)
    w_ref, kd_ref, qg_ref, attn_ref, dec_ref, do_ref, starts_ref, ends_ref, seq_ref = (
        next(it) for _ in range(9))
    rows = _token_rows(it, token_major, table, w_ref.shape[1])
    qk_rows = rows if factored else None
    q_rows_ref, k_rows_ref = (next(it), next(it)) if factored else (None, None)
    final_ref = next(it) if has_final else None
    span_ref = next(it) if entry_only else None
    dlast_ref = next(it)
    if with_d_init:
        next(it)                                           # zeros, aliased to d_init_ref
    if entry_only:
        entry_ref = next(it)
    else:
        x_ref, dvn_ref = next(it), next(it)
        d_init_ref = next(it) if with_d_init else None
        entry_ref = next(it)

    def body(step, carry):
        i = nt - 1 - step
        x = carry
        if has_final:
            x = x + jnp.where(ends_ref[i] != 0, final_ref[seq_ref[i]], 0.0)
        do = _chunk_of(do_ref, i, rows)
        dvn = (dot(attn_ref[i].T, do)
               + _scale_rows(dot(_chunk_of(kd_ref, i, qk_rows), x), k_rows_ref, i))
        dh = (_decay(dec_ref, i, gdn) * x
              + dot(_chunk_of(qg_ref, i, qk_rows).T, _scale_rows(do, q_rows_ref, i))
              - dot(w_ref[i].T, dvn))
        start = starts_ref[i] != 0
        if not entry_only:
            x_ref[i] = x.astype(x_ref.dtype)
            dvn_ref[i] = dvn.astype(dvn_ref.dtype)
            if with_d_init:
                @pl.when(start)
                def _():
                    d_init_ref[seq_ref[i]] = dh
        return jnp.where(start, 0.0, dh)

    entry_ref[...] = _span_loop(span_ref, nt, body, dlast_ref[...])


def state_bwd(terms: ChunkTerms, layout: ChunkLayout, do, d_final, d_last, *,
              with_d_init: bool = False, entry_only: bool = False, unused=None,
              token_major: bool = False, interpret: bool = False, dot_dtype=jnp.float32):
    """Twin of xla.state.state_bwd: (d_entry, d_init or None, X, dvn), or d_entry alone;
    X and dvn in dot_dtype (they feed only the input cotangents' products). do is in chunk
    layout or, with token_major, [B, T, HV, V]. unused (bool scalar, with entry_only: the
    first device's d_entry): no chunk is run and d_entry is zero."""
    V = do.shape[-1]
    (NT, B, HV, C, K), BV, gdn, decay, sp = _setup(terms, V, token_major)
    factored = terms.k_rows is not None
    has_final = d_final is not None
    with_d_init = with_d_init and not entry_only
    qk = sp.token_k if factored else sp.chunk_k
    in_specs = [sp.chunk_k, qk, qk, sp.chunk_cc, sp.decay, sp.token_v,
                sp.per_chunk, sp.per_chunk, sp.per_chunk]
    w, kd, qg, attn, do = _tiles(dot_dtype, terms.w, terms.kd, terms.qg, terms.attn, do)
    args = [w, kd, qg, attn, decay, do, layout.chunk_starts.astype(jnp.int32),
            layout.chunk_ends.astype(jnp.int32), layout.chunk_seq]
    table = _with_token_rows(sp, in_specs, args, layout, token_major)
    if factored:
        in_specs += [sp.rows, sp.rows]
        args += [terms.q_rows, terms.k_rows]
    if has_final:
        in_specs.append(sp.seq_state(d_final.shape[0]))
        args.append(d_final)
    if entry_only:
        in_specs.append(sp.span)
        args.append(_unless_unused(_span_before_first_start(layout), unused, NT))
    in_specs, args, struct = _with_carry(sp, in_specs, args, d_last)
    n_seqs = layout.seq_ends_here.shape[0]
    aliases = _per_seq_output(sp, in_specs, args, n_seqs, V, 2) if with_d_init else {}
    if entry_only:
        out_specs, out_shape = sp.state, struct(B, HV, K, V)
    else:
        out_specs = [sp.chunk_state, sp.chunk_v] + [sp.seq_state(n_seqs)] * with_d_init + [
            sp.state]
        out_shape = ([struct(NT, B, HV, K, V, dtype=dot_dtype),
                      struct(NT, B, HV, C, V, dtype=dot_dtype)]
                     + [struct(n_seqs, HV, K, V)] * with_d_init + [struct(B, HV, K, V)])
    kernel = partial(_bwd_kernel, nt=NT, gdn=gdn, factored=factored, has_final=has_final,
                     entry_only=entry_only, with_d_init=with_d_init,
                     token_major=token_major, table=table, interpret=interpret)
    tile_bytes = C * (3 * K + C + BV) * jnp.dtype(dot_dtype).itemsize
    out = pl.pallas_call(kernel, grid=(B, HV, V // BV), in_specs=in_specs, out_specs=out_specs,
                         out_shape=out_shape, input_output_aliases=aliases,
                         **_params(interpret, tile_bytes))(*args)
    if entry_only:
        return out
    x, dvn, *d_init, d_entry = out
    return d_entry, (d_init[0] if with_d_init else None), x, dvn
