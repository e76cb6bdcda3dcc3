"""In-kernel L2 normalisation of the rows of q and k, for GDN's and KDA's kernels.

    y = r x,  r = (x . x + eps)^(-1/2) per row        (``jaxcp.l2norm``)
    vjp:  dx = r (dy - y (dy . y))

The kernels read the raw q, k [C, K] and scale their rows by r as they read them, so no
normalised copy goes through memory. r comes from one of two places:

- the kernel, from the tile (``row_scales``; GDN's kernels, which read whole rows): r
  joins the row factors a kernel applies anyway (``scale_gram``, ``times``, ``on_tokens``),
  and the vjp runs in the kernel on the stored cotangent (``normalize_vjp``);
- XLA (``operand_row_scales``, ``l2norm.l2_row_scales``), as the operands q_rows, k_rows
  [B, T, HV] (``add_row_scales``; KDA's kernels, which read rows at many offsets): the
  kernel reads q, k through ``UnitRows`` (``with_unit_rows``), and XLA applies the vjp to
  the kernels' dq, dk (``xla_normalize_vjp``).

Either way a block of rows is read as ``unit_cols``/``UnitRows`` give it: float32, times r.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.l2norm import L2NORM_EPS, l2_normalize, l2_row_scales
from jaxcp.pallas.triton.common.chunk_rows import ChunkRef, ChunkRows, chunk_refs
from jaxcp.pallas.triton.common.products import col_tiles


def _times_rows(x, r):
    """x in float32 with its rows scaled by r [n] (None: as stored)."""
    x = x.astype(jnp.float32)
    return x if r is None else x * r[:, None]


# ------------------------------------------------------------- scales computed in the kernel

def row_scales(x: ChunkRef, bk: int, normalize: bool):
    """r of each row of a [C, d] tile ([C] float32), or None (no normalisation)."""
    if not normalize:
        return None
    sq = sum(jnp.sum(jnp.square(c.astype(jnp.float32)), axis=1) for c in col_tiles(x, bk))
    return lax.rsqrt(sq + L2NORM_EPS)


def scale_gram(xy, rx, ry):
    """diag(rx) xy diag(ry) of a [C, C] gram (rows of x scaled by rx, of y by ry)."""
    return xy if rx is None else xy * rx[:, None] * ry[None, :]


def times(row_vec, r):
    """row_vec * r, r None meaning 1."""
    return row_vec if r is None else row_vec * r


def on_tokens(r, valid):
    """Row factors r ([C], None meaning 1) zeroed past the chunk's tokens (valid [C] from
    ``ChunkRows.valid``, None: every row a token)."""
    if valid is None:
        return r
    return valid if r is None else r * valid


def unit_cols(x: ChunkRef, i: int, bk: int, r):
    """Block i of bk columns of a [C, d] tile in float32, its rows scaled by r (None: as
    stored)."""
    return _times_rows(x.cols(i, bk), r)


def normalize_vjp(dx: ChunkRef, x: ChunkRef, r, dy_y, bk: int):
    """dx = r (dy - y (dy . y)) in place of dy in the tile dx, given dy . y per row (dy_y
    [C], from dy before its last rounding). dy is read back as stored: for bf16 inputs
    rounded to bf16, as the unfused op hands the norm's vjp a bf16 cotangent. The store and
    this load of a block use the same layout, so each element is read back by the thread
    that wrote it."""
    for i in range(x.width // bk):
        y = unit_cols(x, i, bk, r)
        dy = dx.cols(i, bk).astype(jnp.float32)
        dx.set_cols(i, bk, (dy - y * dy_y[:, None]) * r[:, None])


# ------------------------------------------------------------- scales given as operands

class UnitRows:
    """A chunk tile ref [C, d] read with each row times its r from scales [C] (a ref):
    ref[rows, cols] gives float32 rows."""

    def __init__(self, ref, scales):
        self.ref, self.scales, self.shape = ref, scales, ref.shape

    def __getitem__(self, index):
        return _times_rows(self.ref[index], self.scales[index[0]].astype(jnp.float32))


def operand_row_scales(q, k, normalize_qk: bool) -> dict:
    """The keyword arguments q_rows, k_rows [B, T, HV] (r by XLA) that make the kernels read
    q, k L2-normalised; none without normalize_qk."""
    if not normalize_qk:
        return {}
    return dict(q_rows=l2_row_scales(q), k_rows=l2_row_scales(k))


def add_row_scales(ins, spec, q_rows=None, k_rows=None) -> None:
    """Add the row scales q_rows, k_rows (``operand_row_scales``; both or neither) to a
    kernel's ``call.Operands`` with BlockSpec spec."""
    if (q_rows is None) != (k_rows is None):
        raise ValueError("q_rows, k_rows: give both or neither")
    if q_rows is not None:
        ins.add("q_rows", spec, q_rows)
        ins.add("k_rows", spec, k_rows)


def with_unit_rows(r):
    """The kernel refs r (a NamedTuple) with q and k read L2-normalised (``UnitRows``)
    where their row scales q_rows, k_rows are operands."""
    scaled = {name: UnitRows(getattr(r, name), getattr(r, name + "_rows"))
              for name in ("q", "k") if getattr(r, name + "_rows", None) is not None}
    return r._replace(**scaled)


def in_place(r, rows: ChunkRows, names: tuple[str, ...]):
    """The kernel refs r with the token slabs among `names` read and written as this
    program's rows (``chunk_rows.ChunkRef``), and q, k L2-normalised where their row scales
    are operands (``with_unit_rows``)."""
    return with_unit_rows(chunk_refs(r, rows, names))


def xla_normalize_vjp(x, dx):
    """The cotangent of the raw x [..., d] from dx, that of l2_normalize(x), by XLA."""
    return jax.vjp(l2_normalize, x.astype(jnp.float32))[1](dx)[0]
