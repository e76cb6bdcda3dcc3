"""KDA's chunk cumsum of the gate and, for the backward, its reverse, as Pallas kernels.

    forward:  G[c, s, d] = sum_{i <= s} g[c, i, d]    (``chunk_cumsum``)
    backward: dg[c, s, d] = sum_{i >= s} dG[c, i, d]  (``reverse_chunk_cumsum``)

over the C rows of each chunk c, per channel d, in float32; x [NT, B, HV, C, K] in the chunk
layout. One program per (chunk, batch, head, block of columns) scans its [C, bk] tile
(``jnp.cumsum`` over the rows, Triton's associative scan: the scan ``channel.ChannelBlock``
runs on its tiles inside the other KDA kernels). The reverse scans
the rows loaded last to first and stores them back in that order, so each dg_s sums only
the rows at and after s (no difference of two prefix sums, whose rounding would be that of
the whole chunk's sum). XLA's cumsum over 64 rows took 1.57 ms at T = 32768, H = 64, K = 128
on the H200, about three times the bytes' time.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.common import Operands, call
from jaxcp.pallas.config import ChunkBlocks

# columns per program: a [64, 64] float32 tile is 32 registers per thread at 4 warps
CUMSUM_COLS = 64


def _cumsum_kernel(*refs, names, reverse: bool):
    x_ref, y_ref = refs
    rows = x_ref.shape[0]
    if reverse:
        order = rows - 1 - lax.broadcasted_iota(jnp.int32, (rows,), 0)
        y_ref[order, :] = jnp.cumsum(x_ref[order, :].astype(jnp.float32), axis=0)
    else:
        y_ref[...] = jnp.cumsum(x_ref[...].astype(jnp.float32), axis=0)


def _scan(x: jax.Array, *, reverse: bool, interpret: bool) -> jax.Array:
    NT, B, HV, C, K = x.shape
    bk = min(K, CUMSUM_COLS)
    if K % bk:
        raise ValueError(f"K must be a multiple of {bk} or at most {CUMSUM_COLS}, got {K}")
    spec = pl.BlockSpec((None, None, None, C, bk), lambda t, b, h, j: (t, b, h, 0, j))
    ins = Operands()
    ins.add("x", spec, x)
    outs = lambda out, struct: out.add("y", spec, struct(x.shape, jnp.float32))
    name = "kda_reverse_chunk_cumsum" if reverse else "kda_chunk_cumsum"
    blocks = ChunkBlocks(col_block=bk, num_warps=4, num_stages=1)
    res, _ = call(_cumsum_kernel, (NT, B, HV, K // bk), ins, outs, name=name,
                  params=blocks.params(interpret), reverse=reverse)
    return res["y"]


def chunk_cumsum(g: jax.Array, *, interpret: bool = False) -> jax.Array:
    """G [NT, B, HV, C, K] float32: the cumsum of g [NT, B, HV, C, K] over each chunk's
    rows (module docstring)."""
    return _scan(g, reverse=False, interpret=interpret)


def reverse_chunk_cumsum(dG: jax.Array, *, interpret: bool = False) -> jax.Array:
    """dg [NT, B, HV, C, K] float32, dg_s = sum_{i >= s} dG_i over each chunk's rows: the
    transpose of ``chunk_cumsum``."""
    return _scan(dG, reverse=True, interpret=interpret)
