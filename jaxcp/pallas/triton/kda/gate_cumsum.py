"""KDA's gate as Pallas kernels: the chunk cumsum G of the decay, read from the token-major
gate in place and with the gate activation applied on the way (``use_gate_in_kernel``),
and its backward.

    forward:  y = decay(g)  (the identity, or ``gate.decay_terms`` of g + dt_bias)
              G[c, s, d] = sum_{i <= s} y[c, i, d]          (``kda_gate_cumsum``)
    backward: dy[c, s, d] = sum_{i >= s} dG[c, i, d]         (``kda_gate_cumsum_bwd``)
              dg = dy dy/dx,  dA_log = sum dy dy/dA_log,  ddt_bias = sum dg

g [B, T, HV, K] is read where the caller has it (chunk c at the layout's rows,
``chunk_rows``; rows past the chunk's tokens are padding, y = 0 there), G is written in
the chunk layout [NT, B, HV, C, K] float32: the KDA kernels read G at rows they cannot
slice out of a register tile (``gates``), and padding rows hold the chunk's last
G, as a cumsum of zeros does. One program per (chunk, batch, head, block of columns). The
forward scans its [C, bk] tile with ``jnp.cumsum``. The backward reads dG's rows and g's,
and writes dg's, last first (``ChunkRows.reversed``), so that its reverse cumsum is the
same forward scan (Pallas lowers no reverse scan): dy_s sums only the rows at and after s,
never a difference of two prefix sums, whose rounding would be that of the whole chunk's
sum. The activation's parameter cotangents leave the kernel as partial sums per (chunk,
batch, head, column) and XLA adds them up.

The gate's cumsum has the same float32 rounding as the jnp stages: in a chunk that mixes
gates of -1e3 with gates near 0, the differences of G lose digits (docs/precision.md,
"float32 with very negative gates").
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.gate import decay_terms
from jaxcp.layout import ChunkLayout
from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import add_chunk_rows, program_rows, slab_spec
from jaxcp.pallas.triton.common.launch import ChunkBlocks
from jaxcp.vma import match_cotangent

# columns per program: a [64, 64] float32 tile is 32 registers per thread at 4 warps
CUMSUM_COLS = 64


@dataclass(frozen=True)
class GateCumsum:
    """Static settings of one gate: chunk_size C and n_chunks NT of the layout; activate:
    g is the raw gate input and the decay is ``gate.decay_terms`` of it (with A_log and
    dt_bias where given, lower_bound as FLA's); else g is the decay itself."""
    chunk_size: int
    n_chunks: int
    activate: bool = False
    lower_bound: float | None = None
    interpret: bool = False


_Refs = refs_type("_Refs", "", "g token_start token_count a bias dG G dg d_log_a d_bias")


def _decay(r, x, cfg: GateCumsum):
    """decay_terms of the raw tile x [C, bk] with this program's a and bias [bk]."""
    x = x.astype(jnp.float32)
    if r.bias is not None:
        x = x + r.bias[...][None, :]
    a = None if r.a is None else r.a[...][None, :]
    return decay_terms(x, a, cfg.lower_bound)


def _forward_kernel(*refs, names, cfg: GateCumsum):
    r = named(_Refs, names, refs)
    rows = program_rows(r, cfg.chunk_size)
    y = rows.load(r.g).astype(jnp.float32)
    if cfg.activate:
        y = _decay(r, y, cfg).decay
        valid = rows.valid()
        if valid is not None:
            y = y * valid[:, None]
    r.G[...] = jnp.cumsum(y, axis=0)


def _backward_kernel(*refs, names, cfg: GateCumsum):
    r = named(_Refs, names, refs)
    C = cfg.chunk_size
    # rows last first: the reverse cumsum is the forward cumsum of the reversed rows
    rows = program_rows(r, C).reversed()
    last_first = C - 1 - lax.iota(jnp.int32, C)
    dy = jnp.cumsum(r.dG[last_first, :], axis=0)
    if not cfg.activate:
        rows.store(r.dg, dy)
        return
    terms = _decay(r, rows.load(r.g), cfg)
    valid = rows.valid()
    if valid is not None:
        dy = dy * valid[:, None]
    dx = dy * terms.d_input
    rows.store(r.dg, dx)
    r.d_bias[...] = jnp.sum(dx, axis=0)
    if r.d_log_a is not None:
        r.d_log_a[...] = jnp.sum(dy * terms.d_log_a, axis=0)


class _Specs(NamedTuple):
    """BlockSpecs of the grid (chunk, batch, head, block of bk columns): the [T, bk] slab of
    g or dg, the chunk's [C, bk] block of G or dG, the head's [bk] of a or bias, the
    program's [bk] of a partial sum [NT, B, HV, K], the layout's table [NT, B]."""
    token: pl.BlockSpec
    chunk: pl.BlockSpec
    per_column: pl.BlockSpec
    partial: pl.BlockSpec
    chunk_rows: pl.BlockSpec


def _specs(cfg: GateCumsum, T: int, bk: int) -> _Specs:
    C = cfg.chunk_size
    return _Specs(
        token=slab_spec(T, bk, lambda t, b, h, j: (b, h, j)),
        chunk=pl.BlockSpec((None, None, None, C, bk), lambda t, b, h, j: (t, b, h, 0, j)),
        per_column=pl.BlockSpec((None, bk), lambda t, b, h, j: (h, j)),
        partial=pl.BlockSpec((None, None, None, bk), lambda t, b, h, j: (t, b, h, j)),
        chunk_rows=pl.BlockSpec((1, 1), lambda t, b, h, j: (t, b)),
    )


def _operands(g, a, bias, layout: ChunkLayout, sp: _Specs) -> Operands:
    """The inputs but dG: g (None: not read), the layout's table where it has one, a and
    bias (None: not given)."""
    ins = Operands()
    if g is not None:
        ins.add("g", sp.token, g)
    add_chunk_rows(ins, sp, layout)
    for name, x in (("a", a), ("bias", bias)):
        if x is not None:
            ins.add(name, sp.per_column, x)
    return ins


def _columns(K: int) -> int:
    bk = min(K, CUMSUM_COLS)
    if K % bk:
        raise ValueError(f"K must be a multiple of {bk} or at most {CUMSUM_COLS}, got {K}")
    return bk


def _per_column(A_log, dt_bias, HV: int, K: int):
    """exp(A_log) and dt_bias as [HV, K] float32 (None where not given)."""
    a = None if A_log is None else jnp.broadcast_to(
        jnp.exp(A_log.astype(jnp.float32))[:, None], (HV, K))
    bias = None if dt_bias is None else dt_bias.astype(jnp.float32).reshape(HV, K)
    return a, bias


_LAUNCH = ChunkBlocks(col_block=CUMSUM_COLS, num_warps=4, num_stages=1)


def _forward(cfg: GateCumsum, g, A_log, dt_bias, layout: ChunkLayout):
    B, T, HV, K = g.shape
    bk = _columns(K)
    sp = _specs(cfg, T, bk)
    a, bias = _per_column(A_log, dt_bias, HV, K)
    ins = _operands(g, a, bias, layout, sp)
    shape = (cfg.n_chunks, B, HV, cfg.chunk_size, K)
    outs = lambda out, struct: out.add("G", sp.chunk, struct(shape, jnp.float32))
    res, _ = call(_forward_kernel, (cfg.n_chunks, B, HV, K // bk), ins, outs,
                  name="kda_gate_cumsum", params=_LAUNCH.params(cfg.interpret), cfg=cfg)
    return res["G"]


def _backward(cfg: GateCumsum, g, A_log, dt_bias, layout: ChunkLayout, dG):
    B, T, HV, K = g.shape
    bk = _columns(K)
    sp = _specs(cfg, T, bk)
    a, bias = _per_column(A_log, dt_bias, HV, K)
    ins = _operands(g if cfg.activate else None, a, bias, layout, sp)
    ins.add("dG", sp.chunk, dG)
    partial_shape = (cfg.n_chunks, B, HV, K)

    def outs(out, struct):
        out.add("dg", sp.token, struct(g.shape, g.dtype))
        if cfg.activate:
            if A_log is not None:
                out.add("d_log_a", sp.partial, struct(partial_shape, jnp.float32))
            out.add("d_bias", sp.partial, struct(partial_shape, jnp.float32))

    res, _ = call(_backward_kernel, (cfg.n_chunks, B, HV, K // bk), ins, outs,
                  name="kda_gate_cumsum_bwd", params=_LAUNCH.params(cfg.interpret), cfg=cfg)
    # the parameters' cotangents take the parameters' vma types (under shard_map: summed
    # over the axes the parameters are invariant on)
    d_A_log = d_bias = None
    if A_log is not None:
        d_A_log = match_cotangent(
            jnp.sum(res["d_log_a"], axis=(0, 1, 3)).astype(A_log.dtype), A_log)
    if dt_bias is not None:
        d_bias = match_cotangent(jnp.sum(res["d_bias"], axis=(0, 1)).reshape(
            dt_bias.shape).astype(dt_bias.dtype), dt_bias)
    return res["dg"], d_A_log, d_bias


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_gate(cfg: GateCumsum, g, A_log, dt_bias, layout: ChunkLayout):
    """G [NT, B, HV, C, K] float32, the chunk cumsum of the decay (module docstring), from
    g [B, T, HV, K] (any float dtype; the raw gate input with cfg.activate, else the
    decay), A_log [HV] and dt_bias [HV * K] (or None; read only with cfg.activate) and the
    chunk layout of the tokens. Differentiable in g, A_log and dt_bias."""
    return _forward(cfg, g, A_log, dt_bias, layout)


chunk_gate.defvjp(
    lambda cfg, g, A_log, dt_bias, layout: (_forward(cfg, g, A_log, dt_bias, layout),
                                            (g, A_log, dt_bias, layout)),
    lambda cfg, res, dG: (*_backward(cfg, *res, dG), None))
