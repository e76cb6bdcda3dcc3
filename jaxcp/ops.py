"""Public ops: chunked Gated DeltaNet and Kimi Delta Attention, with context parallelism."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.checks import check_gate_activation, check_inputs
from jaxcp.core import CoreConfig, chunk_delta_rule
from jaxcp.cp.exchange import Exchange
from jaxcp.cp.segments import (choose_segments, from_rows, rows_from_chunks, rows_to_chunks,
                                segment_layouts, to_rows)
from jaxcp.cp.split import axis_pieces
from jaxcp.cp.strategies import ContextParallel, run_sharded
from jaxcp.gate import Gate, decay_from_raw
from jaxcp.layout import num_chunks
from jaxcp.stages import implementation, resolve_backend, stage_options


def _chunk_op(gate: Gate, q, k, v, g, beta, *, scale, initial_state, output_final_state,
              cu_seqlens, use_qk_l2norm_in_kernel, cp_axis, cp_strategy, cp_layout, chunk_size,
              backend, segments, gate_bound=None, activation=None):
    """activation: None (g is the decay), or (A_log, dt_bias, lower_bound) of the gate
    activation that turns the raw g into the decay (``gate.decay_from_raw``), applied by
    the gate stage (``stages.Stages.gate``)."""
    check_inputs(gate, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, cp_axis=cp_axis, cp_strategy=cp_strategy,
                 chunk_size=chunk_size, backend=backend, cp_layout=cp_layout, segments=segments)
    if cu_seqlens is not None and cu_seqlens.shape[0] == 2:
        cu_seqlens = None        # one sequence, [0, T): the same as B = 1 without cu_seqlens
    cp = None if cp_axis is None else ContextParallel(cp_axis, cp_strategy, cp_layout)
    if cp is not None and cp.splits_heads and activation is not None:
        # A_log and dt_bias are per head: the decay is split with the heads
        g, activation = decay_from_raw(gate, g, *activation), None
    local_op = partial(_local_op, gate, scale=scale, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       chunk_size=chunk_size, backend=backend, segments=segments,
                       gate_bound=gate_bound, activation=activation)
    return run_sharded(cp, local_op, q, k, v, g, beta, initial_state)


def _local_op(gate: Gate, q, k, v, g, beta, initial_state, exchange: Exchange | None, *,
              scale, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size,
              backend, segments, gate_bound, activation):
    """The op on the tokens given (this device's pieces of the sequence with exchange, else
    the whole sequence): inputs cast and laid out for the stages, then the core."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else float(scale)
    f32 = lambda x: x.astype(jnp.float32)
    if exchange is None:
        local, world = axis_pieces("contiguous", None, T), 1
    else:
        local = axis_pieces(exchange.layout, exchange.axis, T)
        world = lax.axis_size(exchange.axis)
    n_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    piece_len = local[0].length
    backend = resolve_backend(backend, gate, v.dtype)
    S = choose_segments(segments, backend=backend, gate=gate, batch=B, heads=HV, k_dim=K,
                        v_dim=v.shape[3], piece_len=piece_len,
                        across_devices=exchange is not None and exchange.strategy == "allgather")
    segment_len = piece_len // S
    NT = num_chunks(segment_len, chunk_size, n_seqs)
    impl = implementation(backend, gate)
    opts = stage_options(backend, gate, v.dtype, K, unit_qk=use_qk_l2norm_in_kernel,
                         chunk_size=chunk_size, gate_bound=gate_bound, tokens=segment_len)
    cfg = CoreConfig(scale, output_final_state, opts, exchange, S)

    normalised_here = use_qk_l2norm_in_kernel and not opts.normalize_qk
    qk_dtype = impl.qk_dtype(opts.dot_dtype, unit_rows=normalised_here)
    if normalised_here:
        q, k = (cfg.stages.unit_rows(x, qk_dtype) for x in (q, k))
    q, k = (jnp.repeat(x.astype(qk_dtype), HV // H, axis=2) for x in (q, k))
    pieces_in, layouts, unchunks = [], [], []
    for p in local:
        cut = (lambda x: x) if len(local) == 1 else (lambda x: x[:, p.offset:p.offset + p.length])
        rows = lambda x: to_rows(cut(x), S)    # the piece's segments as rows [B S, P / S, ...]
        layout, token_maps = segment_layouts(B, piece_len, S, chunk_size, cu_seqlens, p.start,
                                             T * world)
        if impl.token_major:
            chunk = unchunk = lambda x: x
        else:
            chunk = lambda x, tm=token_maps: rows_to_chunks(x, tm, NT, chunk_size)
            unchunk = lambda y, tm=token_maps: rows_from_chunks(y, tm, segment_len)
        g_p = cfg.stages.gate(rows(g), layout, activation)
        if not impl.gate_cumsum:
            g_p = chunk(g_p)
        v_p = rows(v).astype(impl.v_dtype(opts.dot_dtype))
        pieces_in.append((chunk(rows(q)), chunk(rows(k)), chunk(v_p), g_p, chunk(f32(rows(beta)))))
        layouts.append(layout)
        unchunks.append(unchunk)
    init = None if initial_state is None else f32(initial_state)
    o_pieces, final = chunk_delta_rule(cfg, *(tuple(x) for x in zip(*pieces_in)), init,
                                       tuple(layouts))
    o = jnp.concatenate([from_rows(unchunk(o_p), S) for unchunk, o_p in zip(unchunks, o_pieces)],
                        axis=1)
    return o.astype(v.dtype), final


_DOC = """{title}

    o, final_state = {name}(q, k, v, g, beta, *, scale=None, initial_state=None,
        output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
        cp_axis=None, cp_strategy="allgather", cp_layout="contiguous", chunk_size=64,
        backend=None, segments=None)

    Per value head and token t (the state S is [K, V], float32):
        {decay}
        v' = (v_t - S^T k_t) * beta_t;  S <- S + k_t v'^T;  o_t = S^T (scale * q_t)

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0 (value head hv reads q/k head
        hv // (HV // H)); g: {g_shape} natural-log decay (<= 0); beta: [B, T, HV].
        float32, bfloat16 or float16; K, V in (16, 32, 64, 128, 256).
      scale: multiplies q; defaults to K ** -0.5.
      initial_state: [N, HV, K, V], one state per sequence (N = B, or the number of
        sequences in cu_seqlens); cast to float32.
      output_final_state: also return the state after each sequence's last token.
      cu_seqlens: int [N + 1] global offsets of packed sequences (B must be 1), strictly
        increasing from 0 to the total length. Traced values are fine: changing them
        does not re-trace.
      use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
      cp_axis: name of a manual mesh axis of an enclosing jax.shard_map. q, k, v, g, beta
        are then this device's tokens of the sequence, laid out by cp_layout; cu_seqlens,
        initial_state and final_state are global (sequence positions) and replicated.
        Results equal those of the single-device call.
      cp_strategy: "allgather" (each device summarises its shard as an affine state map,
        one all-gather, a prefix merge), "all_to_all" (heads split over the axis; H must
        divide by its size) or "relay" (sequential hand-off of the state, a baseline;
        contiguous layout only).
      cp_layout: "contiguous" (device r holds tokens [r T, (r + 1) T)) or "zigzag" (the
        sequence cut into 2W pieces of T / 2, device r holds pieces r and 2W - 1 - r, in
        that order: balanced causal attention in a hybrid; T even). ``jaxcp.to_layout``
        permutes a batch into it (``jaxcp.cp.split``).
      chunk_size: tokens per chunk, one of (16, 32, 64, 128).
      backend: "xla", "pallas" (GPU kernels), "interpret" (the kernels in interpret mode),
        "mosaic" (GDN, bf16 inputs: the "pallas" kernels with the forward's intra-chunk
        terms on Mosaic GPU, and its state recurrences where the chunks are whole;
        ``jaxcp.stages``) or None: "mosaic" for GDN's bf16 inputs on a Hopper GPU under jax
        0.11, else "pallas" on a GPU, "xla" elsewhere (``jaxcp.stages.resolve_backend``).
      segments: run each sequence (under CP, each of the device's pieces) as this many
        segments in parallel on the device, joined by the same merge as CP's devices: more
        programs for the state recurrences when B x HV cannot fill the GPU. The length
        (per piece) must divide by it. None: chosen by shape on the GPU backends
        (``jaxcp.cp.segments.choose_segments``), 1 elsewhere; 1: never split.

    Returns:
      o [B, T, HV, V] in v's dtype, and final_state [N, HV, K, V] float32 or None.
    """


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                           beta: jax.Array, *, scale: float | None = None,
                           initial_state: jax.Array | None = None,
                           output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
                           use_qk_l2norm_in_kernel: bool = False,
                           use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
                           dt_bias: jax.Array | None = None, cp_axis: str | None = None,
                           cp_strategy: str = "allgather", cp_layout: str = "contiguous",
                           chunk_size: int = 64, backend: str | None = None,
                           segments: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    check_gate_activation(Gate.SCALAR, q, v, g, use_gate_in_kernel=use_gate_in_kernel,
                          A_log=A_log, dt_bias=dt_bias)
    return _chunk_op(Gate.SCALAR, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cp_axis=cp_axis,
                     cp_strategy=cp_strategy, cp_layout=cp_layout, chunk_size=chunk_size,
                     backend=backend, segments=segments,
                     activation=(A_log, dt_bias, None) if use_gate_in_kernel else None)


def chunk_kda(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
              scale: float | None = None, initial_state: jax.Array | None = None,
              output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              A_log: jax.Array | None = None, dt_bias: jax.Array | None = None,
              safe_gate: bool = False, lower_bound: float | None = None,
              cp_axis: str | None = None, cp_strategy: str = "allgather",
              cp_layout: str = "contiguous", chunk_size: int = 64,
              backend: str | None = None,
              segments: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    check_gate_activation(Gate.CHANNEL, q, v, g, use_gate_in_kernel=use_gate_in_kernel,
                          A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate,
                          lower_bound=lower_bound)
    gate_bound = activation = None
    if use_gate_in_kernel:
        activation = (A_log, dt_bias, None if lower_bound is None else float(lower_bound))
        # the decay lies in (lower_bound, 0): with safe_gate the kernels may rely on it
        gate_bound = float(lower_bound) if safe_gate else None
    return _chunk_op(Gate.CHANNEL, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cp_axis=cp_axis,
                     cp_strategy=cp_strategy, cp_layout=cp_layout, chunk_size=chunk_size,
                     backend=backend, segments=segments,
                     gate_bound=gate_bound, activation=activation)


_GDN_GATE_DOC = """
    The gate, as FLA's ``chunk_gated_delta_rule`` takes it:
      use_gate_in_kernel: g is the raw gate input, and the op computes the decay
        -exp(A_log) * softplus(g + dt_bias) (``jaxcp.gate.decay_from_raw``), differentiating
        A_log and dt_bias too; A_log, dt_bias: [HV] (dt_bias may be None).
"""

_KDA_GATE_DOC = """
    KDA's gate, as FLA's ``chunk_kda`` takes it:
      use_gate_in_kernel: g is the raw gate input, and the op computes the decay
        -exp(A_log) * softplus(g + dt_bias), or with lower_bound
        lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (``jaxcp.gate.decay_from_raw``),
        differentiating A_log and dt_bias too. It is elementwise and applied inside the op,
        just before the tokens are laid out in chunks (a pass the op makes anyway), so the
        caller holds no float32 decay tensor of its own.
      A_log: [HV] (optional with lower_bound); dt_bias: [HV * K] or None.
      lower_bound: a negative float; the decay then lies in (lower_bound, 0).
      safe_gate: FLA's flag for its bounded-gate fast path; checked as FLA checks it
        (lower_bound in [-5, 0) with use_gate_in_kernel). With use_gate_in_kernel the decay
        then lies in (lower_bound, 0), and the Pallas kernels take each diagonal block of
        16 x 16 tokens as one tensor-core product through a shifted reference instead of
        pair by pair (same results to rounding). Without use_gate_in_kernel, g is the
        caller's and no bound is assumed: safe_gate changes nothing.
"""


chunk_gated_delta_rule.__doc__ = _DOC.format(
    title="Chunked Gated DeltaNet (scalar gate per head and token).",
    name="chunk_gated_delta_rule", decay="S <- S * exp(g_t)",
    g_shape=Gate.SCALAR.dims()) + _GDN_GATE_DOC
chunk_kda.__doc__ = _DOC.format(
    title="Chunked Kimi Delta Attention (per-channel gate).", name="chunk_kda",
    decay="S <- Diag(exp(g_t)) S   (row d of S scaled by exp(g_t[d]))",
    g_shape=Gate.CHANNEL.dims()) + _KDA_GATE_DOC
