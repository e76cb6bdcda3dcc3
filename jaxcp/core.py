"""The chunked delta rule as one custom_vjp, with the cross-device step inside it.

Inputs are in chunk layout (``layout.to_chunks``): q, k [NT, B, HV, C, K], v [NT, B, HV, C, V]
float32, g [NT, B, HV, C, Kg], beta [NT, B, HV, C] float32; or, for a token-major
implementation (``stages.Implementation``; the Pallas kernels), as the caller has them,
[B, T, HV, ...] (q, k, v bf16 for bf16 inputs), each chunk read in place at the rows the
layout gives it, and for the Pallas KDA stages g is G, the gate's chunk cumsum
[NT, B, HV, C, K] (``stages``, gate_cumsum); initial states [N, HV, K, V] float32 or None.

A device's tokens are one piece of the sequence, or two under the zigzag layout
(``cp.split``); every stage runs per piece, and the cross-device step composes the pieces'
maps in sequence order. A piece may run as S segments laid out as batch rows
(``cp.segments``): the tensors are then [B S, P / S, ...] and the merge composes every
segment's map, on one device too.

Forward:  intra-chunk terms -> entry state of each piece (CP, ``cp.exchange``: local summary
          (S_ext, M), all-gather, prefix merge; or the relay) -> state recurrence -> output,
          final states.
Backward: recompute the intra-chunk terms (Pallas GDN: only w and u, from the inverses
          the forward kept) and the chunk states from the saved entry states (no state per
          chunk is stored), get the cotangent of each piece's exit state (CP: local
          dS_ext, all-gather with M, suffix merge; or the relay), reverse state recurrence,
          then the cotangents of the chunk inputs (``chunk_grads``), one piece after
          the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
from jax import lax

from jaxcp.cp.exchange import Exchange, entry_states, exit_cotangents
from jaxcp.stages import StageOptions, Stages, stages_for
from jaxcp.vma import match_cotangent


@dataclass(frozen=True)
class CoreConfig:
    """Static settings of one call. options: how its stages are built (backend, gate,
    products, normalisation: ``stages.StageOptions``; whether q, k, v, g, beta and o are
    token-major [B, T, HV, ...] or in chunk layout is the backend's ``Implementation``'s).
    exchange: the cross-device step ("allgather" or "relay" over an axis in a layout,
    ``cp.exchange``); None without CP, and under all_to_all, which wraps the op without CP
    (``cp.strategies``). segments: each piece runs as this many segments, as batch rows
    ([B S, P / S, ...], ``cp.segments``) joined by the merge."""
    scale: float
    output_final_state: bool
    options: StageOptions
    exchange: Exchange | None = None
    segments: int = 1

    @property
    def stages(self) -> Stages:
        return stages_for(self.options)


def _forward(cfg, q, k, v, g, beta, init, layouts, for_backward=False):
    st = cfg.stages
    terms = [st.intra(*x, cfg.scale, lay, with_inverse=for_backward)
             for *x, lay in zip(q, k, v, g, beta, layouts)]
    s_in, ms = entry_states(cfg.exchange, st, terms, layouts, init, cfg.segments)
    outs = [st.state_output(t, lay, init, s, cfg.output_final_state)
            for t, lay, s in zip(terms, layouts, s_in)]
    o = tuple(o_p for o_p, _ in outs)
    finals = None if not cfg.output_final_state else sum(f for _, f in outs)
    kept = [st.keep(t) for t in terms] if for_backward else None
    return (o, finals), (q, k, v, g, beta, init, layouts, s_in, ms, kept)


def _forward_for_backward(cfg, *args):
    """The forward as the backward needs it: it keeps what ``Stages.keep`` says of its
    intra-chunk terms (Pallas GDN: the inverses, attn, q_rows), so that the backward
    recomputes only the rest."""
    return _forward(cfg, *args, for_backward=True)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_delta_rule(cfg: CoreConfig, q, k, v, g, beta, init, layouts):
    """q, k, v, g, beta, layouts: tuples with one entry per local piece of the sequence
    (``cp.split``; one without CP). Returns o, a tuple of [NT, B, HV, C, V] (token-major:
    [B, T_piece, HV, V]) per piece, and the final states [N, HV, K, V] of the sequences that
    end on this device, zero for the others (None unless cfg.output_final_state); under CP
    the caller sums them over the axis, outside this vjp, so that JAX transposes the sum for
    either setting of shard_map's check_vma."""
    return _forward(cfg, q, k, v, g, beta, init, layouts)[0]


def _backward(cfg, res, cts):
    q, k, v, g, beta, init, layouts, s_in, ms, kept = res
    do, d_final = cts
    st = cfg.stages
    terms = [st.intra_again(*x, cfg.scale, lay, kp)
             for *x, lay, kp in zip(q, k, v, g, beta, layouts, kept)]
    d_last = exit_cotangents(cfg.exchange, st, terms, layouts, do, d_final, ms,
                             cfg.segments)
    grads, d_init = [], None
    for i, lay in enumerate(layouts):
        # one piece at a time: its chunk states are recomputed only once the previous
        # piece's gradients exist, so that one piece's per-chunk tensors are alive at once
        t, d_o, d_l, s, _ = lax.optimization_barrier(
            (terms[i], do[i], d_last[i], s_in[i], grads[-1] if grads else ()))
        h, v_new, _ = st.state_fwd(t, lay, init, s)
        _, d_init_i, x, dvn = st.state_bwd(t, lay, d_o, d_final, d_l,
                                           with_d_init=init is not None)
        dx = st.chunk_grads(q[i], k[i], v[i], g[i], beta[i], cfg.scale, lay, t, h, v_new, x,
                            dvn, d_o)
        grads.append(tuple(d.astype(p.dtype) for d, p in zip(dx, (q[i], k[i], v[i], g[i],
                                                                  beta[i]))))
        if init is not None:
            d_init = d_init_i if d_init is None else d_init + d_init_i
    if init is not None:
        d_init = match_cotangent(d_init, init)
    return *(tuple(per_input) for per_input in zip(*grads)), d_init, None


chunk_delta_rule.defvjp(_forward_for_backward, _backward)
