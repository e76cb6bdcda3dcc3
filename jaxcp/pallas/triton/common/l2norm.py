"""L2-normalised copies of q and k as Pallas kernels: one pass over the rows each way.

    y = r x,  r = (x . x + eps)^(-1/2) per row               (``jaxcp.l2norm``)
    vjp:  dx = r (dy - y (dy . y)),  y = r x again from x and the kept r

x [..., d] is read as its N rows of d (N the product of the leading axes), ``RowBlocks``
rows per program, masked past N. The forward (``l2norm_fwd``) reads x once and writes y in
the dtype asked for and r [N] float32; the backward (``l2norm_bwd``) reads x, r and dy and
writes dx in x's dtype: one pass each way. XLA's twin (``l2norm.normalized_copy``) is as
fast in a forward alone, but under a backward it keeps float32 intermediates and its vjp
takes several passes (forward and backward of q and k: 1.9 against 1.5 to 1.7 ms at
T = 32768, H = 64, K = 128, docs/benchmarks/kernels_kda.md); the op uses these kernels where its stages are
Pallas ones (``stages.Stages.unit_rows``). The arithmetic is XLA's, in float32: y is r x
rounded once to its dtype, dx the vjp of ``l2_normalize`` rounded once to x's.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.l2norm import L2NORM_EPS
from jaxcp.pallas.triton.common.call import Operands, call, named, refs_type
from jaxcp.pallas.triton.common.chunk_rows import ChunkRows
from jaxcp.pallas.triton.common.launch import RowBlocks

_FwdRefs = refs_type("_FwdRefs", "x y r")
_BwdRefs = refs_type("_BwdRefs", "x r dy dx")


def _block_rows(n_rows: int, block_rows: int) -> ChunkRows:
    """This program's rows of the [N, d] matrix, masked past N where N % block_rows != 0."""
    first = pl.program_id(0) * block_rows
    return ChunkRows(first, None if n_rows % block_rows == 0 else n_rows - first, block_rows)


def _forward_kernel(*refs, names, n_rows, block_rows):
    """For a block of rows x [BR, d]: y = r x [BR, d] in y's dtype, r [BR] float32."""
    r = named(_FwdRefs, names, refs)
    rows = _block_rows(n_rows, block_rows)
    x = rows.load(r.x).astype(jnp.float32)
    scales = lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS)
    rows.store(r.y, x * scales[:, None])
    rows.store(r.r, scales)


def _backward_kernel(*refs, names, n_rows, block_rows):
    """For a block of rows x, dy [BR, d] and their r [BR]: dx = r (dy - y (dy . y)), y = r x,
    in dx's dtype."""
    r = named(_BwdRefs, names, refs)
    rows = _block_rows(n_rows, block_rows)
    scales = rows.load(r.r)[:, None]
    y = rows.load(r.x).astype(jnp.float32) * scales
    dy = rows.load(r.dy).astype(jnp.float32)
    rows.store(r.dx, scales * (dy - y * jnp.sum(dy * y, axis=1, keepdims=True)))


def _specs(n_rows: int, d: int):
    """BlockSpecs of the whole [N, d] matrix and [N] vector (each program masks its rows)."""
    return (pl.BlockSpec((n_rows, d), lambda i: (0, 0)),
            pl.BlockSpec((n_rows,), lambda i: (0,)))


def _forward(x2, dtype, interpret: bool, blocks: RowBlocks):
    """(y [N, d] in dtype, r [N] float32) of the rows x2 [N, d]."""
    n_rows, d = x2.shape
    matrix, vector = _specs(n_rows, d)
    ins = Operands()
    ins.add("x", matrix, x2)

    def outs(out, struct):
        out.add("y", matrix, struct((n_rows, d), dtype))
        out.add("r", vector, struct((n_rows,), jnp.float32))

    res, _ = call(_forward_kernel, (pl.cdiv(n_rows, blocks.block_rows),), ins, outs,
                  name="l2norm_fwd", params=blocks.params(interpret), n_rows=n_rows,
                  block_rows=blocks.block_rows)
    return res["y"], res["r"]


def _backward(x2, r, dy2, interpret: bool, blocks: RowBlocks):
    """dx [N, d] in x2's dtype from the rows x2, their r and the cotangent dy2 of y."""
    n_rows, d = x2.shape
    matrix, vector = _specs(n_rows, d)
    ins = Operands()
    for name, spec, value in (("x", matrix, x2), ("r", vector, r), ("dy", matrix, dy2)):
        ins.add(name, spec, value)

    def outs(out, struct):
        out.add("dx", matrix, struct((n_rows, d), x2.dtype))

    res, _ = call(_backward_kernel, (pl.cdiv(n_rows, blocks.block_rows),), ins, outs,
                  name="l2norm_bwd", params=blocks.params(interpret), n_rows=n_rows,
                  block_rows=blocks.block_rows)
    return res["dx"]


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _normalized_rows(x2, dtype, interpret, blocks):
    return _forward(x2, dtype, interpret, blocks)[0]


def _normalized_rows_fwd(x2, dtype, interpret, blocks):
    y, r = _forward(x2, dtype, interpret, blocks)
    return y, (x2, r)


def _normalized_rows_bwd(dtype, interpret, blocks, res, dy):
    x2, r = res
    return (_backward(x2, r, dy, interpret, blocks),)


_normalized_rows.defvjp(_normalized_rows_fwd, _normalized_rows_bwd)


def l2_normalized(x: jax.Array, dtype, *, interpret: bool = False,
                  blocks: RowBlocks = RowBlocks()) -> jax.Array:
    """x [..., d] with each row over d L2-normalised, in dtype (``l2norm.l2_normalize``
    rounded once); differentiable, the cotangent in x's dtype. d a power of two."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"l2_normalized: the row width must be a power of two, got {d}")
    y = _normalized_rows(x.reshape(-1, d), jnp.dtype(dtype), interpret, blocks)
    return y.reshape(x.shape)
