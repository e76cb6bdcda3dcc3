"""The recurrent (decoding) step as one Pallas kernel, both gates: a few tokens per call from a
table of states, each state read once and written back in place.

Per batch row b, value head hv and token t, with S the [K, V] float32 state of table row
idx = state_indices[b] (zero where idx = -1):

    S <- S * exp(g_t)            (scalar gate: g [B, T, HV]; per channel: g [B, T, HV, K],
                                  row d of S times exp(g_t[d]))
    v' = (v_t - S^T k_t) beta_t;   S <- S + k_t v'^T;   o_t = S^T (scale q_t)

q, k [B, T, H, K] (value head hv reads q/k head hv // (HV / H); with normalize_qk each
token's q and k are L2-normalised here, as ``l2norm.l2_normalize``); v [B, T, HV, V]; beta
[B, T, HV]; o [B, T, HV, V] in v's dtype. One program per (block of BV state columns, b, hv)
holds its [K, BV] slice of S in registers over the T tokens, then writes it to row
idx of the table, which the output aliases (rows no program writes keep their values;
nothing is written for idx = -1). The refs are whole arrays,
indexed with the program's b, hv, token and idx (``recurrent_kernel``). The column block is
the grid's first (fastest) axis, so the programs that share a state's rows run side by side.
The states are streamed once (loaded and stored with evict_first, as are v and o); q, k and
g, which the column blocks of a head share, are kept in the L2 cache (evict_last).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxcp.l2norm import l2_row_scales
from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.launch import StateBlocks

_Refs = refs_type("_Refs", "q k v g beta idx table_in o table")


def recurrent_kernel(*refs, names, scale: float, group: int, per_channel: bool, T: int,
                     block_cols: int, normalize_qk: bool):
    r = named(_Refs, names, refs)
    j, row = pl.program_id(0), pl.program_id(1)
    HV = r.v.shape[2]
    b, hv = row // HV, row % HV
    h = hv // group
    cols = pl.ds(j * block_cols, block_cols)
    idx = r.idx[b]
    K = r.q.shape[-1]
    streamed = lambda ref: pltriton.load(ref, eviction_policy="evict_first")
    shared = lambda ref: pltriton.load(ref, eviction_policy="evict_last")
    stored = streamed(r.table_in.at[jnp.maximum(idx, 0), hv, pl.ds(0, K), cols])
    state = jnp.where(idx >= 0, stored, jnp.zeros_like(stored))

    def unit(x):
        return x * l2_row_scales(x) if normalize_qk else x

    def token(t, state):
        q_t = unit(shared(r.q.at[b, t, h, pl.ds(0, K)]).astype(jnp.float32)) * scale
        k_t = unit(shared(r.k.at[b, t, h, pl.ds(0, K)]).astype(jnp.float32))
        v_t = streamed(r.v.at[b, t, hv, cols]).astype(jnp.float32)
        if per_channel:
            state = state * jnp.exp(shared(r.g.at[b, t, hv, pl.ds(0, K)]).astype(
                jnp.float32))[:, None]
        else:
            state = state * jnp.exp(r.g[b, t, hv].astype(jnp.float32))
        v_new = (v_t - jnp.sum(k_t[:, None] * state, axis=0)) * r.beta[b, t, hv].astype(
            jnp.float32)
        state = state + k_t[:, None] * v_new[None, :]
        pltriton.store(r.o.at[b, t, hv, cols],
                       jnp.sum(q_t[:, None] * state, axis=0).astype(r.o.dtype),
                       eviction_policy="evict_first")
        return state

    state = lax.fori_loop(0, T, token, state)

    @pl.when(idx >= 0)
    def _():
        pltriton.store(r.table.at[idx, hv, pl.ds(0, K), cols], state,
                       eviction_policy="evict_first")


def recurrent_step(q, k, v, g, beta, table, state_indices, *, scale: float,
                   normalize_qk: bool = False, interpret: bool = False):
    """o [B, T, HV, V] (v's dtype) and the table [N, HV, K, V] float32 with rows
    state_indices (int32 [B], -1: none) replaced by their new states (module docstring)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    blocks = StateBlocks.recurrent(K, V, B * HV)
    bv = blocks.cols(V)
    # every ref is the whole array, indexed in the kernel
    whole = lambda shape: pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))
    ins = Operands()
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("idx", state_indices.astype(jnp.int32)),
                    ("table_in", table.astype(jnp.float32))):
        ins.add(name, whole(x.shape), x)

    def outs(out, struct):
        out.add("o", whole((B, T, HV, V)), struct((B, T, HV, V), v.dtype))
        out.add("table", whole(table.shape), struct(table.shape, jnp.float32))

    result, _ = call(recurrent_kernel, (V // bv, B * HV), ins, outs, name="recurrent_step",
                     params=blocks.params(interpret, K * bv * 4),
                     aliases={"table_in": "table"}, scale=scale, group=HV // H,
                     per_channel=g.ndim == 4, T=T, block_cols=bv, normalize_qk=normalize_qk)
    return result["o"], result["table"]
