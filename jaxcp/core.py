"""The chunked delta rule as one custom_vjp, with the cross-device step inside it.

Inputs are in chunk layout (``layout.to_chunks``): q, k [NT, B, HV, C, K], v [NT, B, HV, C, V]
float32, g [NT, B, HV, C, Kg], beta [NT, B, HV, C] float32; or, for a token-major
implementation (``stages.Implementation``; the Pallas kernels), as the caller has them,
[B, T, HV, ...] (q, k, v bf16 for bf16 inputs), each chunk read in place at the rows the
layout gives it, and for the Pallas KDA stages g is G, the gate's chunk cumsum
[NT, B, HV, C, K] (``stages``, gate_cumsum); initial states [N, HV, K, V] float32 or None.

Forward:  intra-chunk terms -> entry state of this device (CP: local summary (S_ext, M),
          all-gather, prefix merge; or the relay) -> state recurrence -> output, final states.
Backward: recompute the intra-chunk terms (Pallas GDN: only w and u, from the inverses
          the forward kept) and the chunk states from the saved entry state (no state per
          chunk is stored), get the cotangent of this device's exit state (CP: local
          dS_ext, all-gather with M, suffix merge; or the relay), reverse state recurrence,
          then the cotangents of the chunk inputs (``chunk_grads``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.cp.merge import merge_prefix, merge_suffix
from jaxcp.gate import Gate
from jaxcp.layout import ChunkLayout
from jaxcp.vma import match_cotangent, vary_like
from jaxcp.stages import Stages, stages_for
from jaxcp.xla import ChunkTerms


@dataclass(frozen=True)
class CoreConfig:
    """Static settings of one call. gate: the decay gate's kind. cp_strategy: "allgather" or
    "relay" (all_to_all wraps the op without CP, see ``cp.all_to_all``). backend: "xla",
    "pallas" or "interpret"; whether q, k, v, g, beta (and o) are token-major
    [B, T, HV, ...] or in chunk layout is its ``Implementation``'s (``stages``).
    normalize_qk: q, k are raw and the stages L2-normalise them. chunk_size: C.
    gate_bound: a bound every decay respects, or None; unit_qk: the rows of q, k have unit
    L2 norm; tokens: T of the token tensors where the stages need it told
    (``stages.StageOptions``)."""
    scale: float
    output_final_state: bool
    gate: Gate
    cp_axis: str | None = None
    cp_strategy: str = "allgather"
    backend: str = "xla"
    dot_dtype: str = "float32"
    normalize_qk: bool = False
    chunk_size: int = 64
    gate_bound: float | None = None
    unit_qk: bool = False
    tokens: int | None = None

    @property
    def stages(self) -> Stages:
        return stages_for(self.backend, self.gate, self.dot_dtype, self.normalize_qk,
                          self.chunk_size, self.gate_bound, self.unit_qk, self.tokens)


def _zero_state(terms: ChunkTerms) -> jax.Array:
    B, HV, _, K = terms.w.shape[1:]
    return vary_like(jnp.zeros((B, HV, K, terms.u.shape[-1]), jnp.float32), terms.w)


def _shift(axis: str, x: jax.Array, step: int) -> jax.Array:
    """Send x from device r to device r + step (devices with no sender get zeros)."""
    W = lax.axis_size(axis)
    perm = [(i, i + step) for i in range(W) if 0 <= i + step < W]
    return lax.ppermute(x, axis, perm)


def _entry_state(cfg: CoreConfig, terms: ChunkTerms, layout: ChunkLayout, init):
    """State entering this device's first chunk, and the device's transition M (allgather)."""
    st = cfg.stages
    zero = _zero_state(terms)
    if cfg.cp_axis is None:
        return zero, None
    axis = cfg.cp_axis
    if cfg.cp_strategy == "allgather":
        # no device after the last one reads its summary
        last = lax.axis_index(axis) == lax.axis_size(axis) - 1
        ext, m = st.cp_summary(terms, layout, init, unused=last)
        ext_all, m_all = lax.all_gather((ext, m), axis)
        return merge_prefix(ext_all, m_all, lax.axis_index(axis)), m
    relay = lambda _, s_in: _shift(axis, st.state_last(terms, layout, init, s_in), +1)
    return lax.fori_loop(0, lax.axis_size(axis) - 1, relay, zero), None


def _exit_cotangent(cfg: CoreConfig, terms: ChunkTerms, layout: ChunkLayout, do, d_final, m):
    """Cotangent of the state leaving this device's last chunk, from the devices after it."""
    zero = _zero_state(terms)
    if cfg.cp_axis is None:
        return zero
    axis = cfg.cp_axis
    entry_grad = lambda d_last, unused=None: cfg.stages.state_bwd(
        terms, layout, do, d_final, d_last, entry_only=True, unused=unused)
    if cfg.cp_strategy == "allgather":
        # no device before the first one reads its entry cotangent
        first = lax.axis_index(axis) == 0
        d_ext_all, m_all = lax.all_gather((entry_grad(zero, first), m), axis)
        return merge_suffix(d_ext_all, m_all, lax.axis_index(axis))
    relay = lambda _, d_last: _shift(axis, entry_grad(d_last), -1)
    return lax.fori_loop(0, lax.axis_size(axis) - 1, relay, zero)


def _forward(cfg, q, k, v, g, beta, init, layout, for_backward=False):
    st = cfg.stages
    terms = st.intra(q, k, v, g, beta, cfg.scale, layout, with_inverse=for_backward)
    s_in, m = _entry_state(cfg, terms, layout, init)
    o, finals = st.state_output(terms, layout, init, s_in, cfg.output_final_state)
    kept = st.keep(terms) if for_backward else None
    return (o, finals), (q, k, v, g, beta, init, layout, s_in, m, kept)


def _forward_for_backward(cfg, *args):
    """The forward as the backward needs it: it keeps what ``Stages.keep`` says of its
    intra-chunk terms (Pallas GDN: the inverses, attn, q_rows), so that the backward
    recomputes only the rest."""
    return _forward(cfg, *args, for_backward=True)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_delta_rule(cfg: CoreConfig, q, k, v, g, beta, init, layout: ChunkLayout):
    """o [NT, B, HV, C, V] (token-major: [B, T, HV, V]) and the final states [N, HV, K, V]
    of the sequences that end on this device, zero for the others (None unless
    cfg.output_final_state); under CP the caller sums them over the axis, outside this vjp,
    so that JAX transposes the sum for either setting of shard_map's check_vma."""
    return _forward(cfg, q, k, v, g, beta, init, layout)[0]


def _backward(cfg, res, cts):
    q, k, v, g, beta, init, layout, s_in, m, kept = res
    do, d_final = cts
    st = cfg.stages
    terms = st.intra_again(q, k, v, g, beta, cfg.scale, layout, kept)
    h, v_new, _ = st.state_fwd(terms, layout, init, s_in)
    d_last = _exit_cotangent(cfg, terms, layout, do, d_final, m)
    _, d_init, x, dvn = st.state_bwd(terms, layout, do, d_final, d_last,
                                     with_d_init=init is not None)
    dq, dk, dv, dg, dbeta = st.chunk_grads(q, k, v, g, beta, cfg.scale, layout, terms, h,
                                           v_new, x, dvn, do)
    if init is not None:
        d_init = match_cotangent(d_init, init)
    grads = tuple(d.astype(x.dtype) for d, x in zip((dq, dk, dv, dg, dbeta), (q, k, v, g, beta)))
    return *grads, d_init, None


chunk_delta_rule.defvjp(_forward_for_backward, _backward)
