"""What the Pallas kernels share: products, gate terms, row scales, tiles, operands by name.

Products (``dot``, ``Dots``): fp32 accumulation always. fp32 x fp32 runs as 3xTF32 on
tensor cores (~1e-7 relative per product); bf16 tiles meet fp32 ones either rounded to
bf16 or as two bf16 parts (hi + lo, ~2^-16 relative). Interpret mode (CPU) computes IEEE
fp32.

Operands (``Operands``): a kernel's inputs and outputs are added by name with their
BlockSpecs; the kernel gets its refs back as a NamedTuple of those names (``named``), so
no kernel depends on the order in which a caller appended optional operands.
"""
from __future__ import annotations

import collections
import enum
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.l2norm import L2NORM_EPS
from jaxcp.pallas.tokens import ChunkRows, Tile, slab_spec
from jaxcp.vma import unify


# ---------------------------------------------------------------------------- products

class Fp32Products(enum.Enum):
    """How the kernels multiply fp32 operands that must keep more digits than bf16's 8 bits,
    on tensor cores (IEEE fp32 products would be FMA loops on CUDA cores).

    TF32X3 (the fp32 path): each operand as hi + lo TF32 parts, three TF32 products, ~1e-7
    relative per product. TF32 (bf16 inputs whose intermediates stay fp32, KDA's): one TF32
    product, each operand rounded to TF32's 10-bit mantissa (2^-11 relative, 8x finer than
    bf16), at the cost of two bf16 products. BF16X3: hi + lo bf16 parts, three bf16
    products, ~2^-16 relative, more digits than bf16 inputs can use; measured slower than
    TF32 for KDA's kernels (H200, T = 32768, H = 64, K = 128: op forward+backward 70.3 ->
    61.1 ms with TF32; docs/benchmarks/kernels_kda.md)."""
    TF32X3 = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    TF32 = lax.DotAlgorithmPreset.TF32_TF32_F32
    BF16X3 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3

    @classmethod
    def for_inputs(cls, dtype) -> "Fp32Products":
        """TF32X3 for fp32 inputs, TF32 for bf16 ones."""
        return cls.TF32X3 if jnp.dtype(dtype) == jnp.float32 else cls.TF32


def fp32_precision(interpret: bool, products: Fp32Products = Fp32Products.TF32X3):
    """The precision of fp32 x fp32 products: `products`; IEEE fp32 in interpret mode (CPU)."""
    return lax.Precision.HIGHEST if interpret else products.value


def bf16_dot(a, b):
    """a @ b of both operands rounded to bf16, fp32 accumulation."""
    return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)


def dot(a, b, interpret: bool, split: bool = False,
        products: Fp32Products = Fp32Products.TF32X3):
    """a @ b with fp32 accumulation. fp32 x fp32 runs at ``fp32_precision`` (`products`).
    An fp32 operand meeting a bf16 tile is rounded to bf16, or with split taken as two bf16
    parts x = hi + lo (two bf16 products, x kept to ~2^-16 relative; 3xTF32 would cost
    three TF32 products, each at half the bf16 rate). A float16 tile meets an fp32 operand
    as fp32 (exact): float16 holds the 10-bit mantissa of a TF32 operand."""
    if jnp.float16 in (a.dtype, b.dtype) and jnp.float32 in (a.dtype, b.dtype):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if a.dtype == b.dtype:
        precision = fp32_precision(interpret, products) if a.dtype == jnp.float32 else None
        return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
    if not split:
        return bf16_dot(a, b)
    if a.dtype == jnp.float32:
        hi = a.astype(jnp.bfloat16)
        return bf16_dot(hi, b) + bf16_dot(a - hi.astype(jnp.float32), b)
    hi = b.astype(jnp.bfloat16)
    return bf16_dot(a, hi) + bf16_dot(a, b - hi.astype(jnp.float32))


class Dots(NamedTuple):
    """a @ b with fp32 accumulation: `native` for tiles as loaded (bf16 MMA for bf16
    inputs), `plain` for products with fp32 operands (the inverse's chain included),
    `split` for an fp32 [C, C] a times a tile b as loaded."""
    native: Callable
    plain: Callable
    split: Callable


def dots(precise: bool, interpret: bool, *, rounded: bool = False,
         products: Fp32Products = Fp32Products.TF32X3) -> Dots:
    """precise: every fp32 x fp32 product at `products` (``Fp32Products``; 3xTF32 for fp32
    inputs). With BF16X3 a bf16 tile meets an fp32 one as two bf16 products (``dot``'s split)
    and another bf16 tile as one: pass bf16 tiles as loaded, not cast to fp32.
    Otherwise (bf16 inputs): bf16 products of the inputs and single TF32 products of fp32
    tiles, the inverse's chain included: its error, ~2e-4 relative on w, is far under the
    bf16 rounding w is stored with (~2e-3; docs/precision.md); `split` takes the fp32
    factor as two bf16 parts (``dot``), measured faster than one TF32 product for w and u
    (H100: op forward 4.47 -> 4.01 ms at T = 32768, H = 64, K = 128). rounded (bf16 inputs
    only): fp32 operands are rounded to bf16 for `plain` products, for kernels whose results
    are gradients. Interpret mode (CPU) computes IEEE fp32."""
    def with_precision(precision):
        return partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    if precise and products is Fp32Products.BF16X3 and not interpret:
        exact = partial(dot, interpret=False, split=True, products=products)
        return Dots(exact, exact, exact)
    if interpret or precise:
        exact = with_precision(fp32_precision(interpret, products))
        return Dots(exact, exact, lambda a, b: exact(a, b.astype(jnp.float32)))
    tf32 = with_precision(None)
    return Dots(tf32, bf16_dot if rounded else tf32, partial(dot, interpret=False, split=True))


def col_tiles(x: Tile, n: int):
    """The blocks of n columns of x, loaded."""
    return [x.cols(j, n) for j in range(x.width // n)]


def sum_dots(product, x: Tile, ys, n: int):
    """sum_j x[:, block j] @ ys[j]^T over blocks j of n columns of x (ys: loaded blocks)."""
    acc = None
    for j, y in enumerate(ys):
        term = product(x.cols(j, n), y.T)
        acc = term if acc is None else acc + term
    return acc


def gram(x: Tile, y: Tile, products: Dots, bk: int):
    """x y^T of two [C, K] tiles, in blocks of bk columns."""
    return sum_dots(products.native, x, col_tiles(y, bk), bk)


def unit_lower_inverse(a, product):
    """(I + a)^-1 of a strictly lower [n, n] a (n a power of two), by merging diagonal blocks
    of doubling size s: with T_s the inverse of the block-diagonal part (blocks of size s) and
    N_s the part of a inside the 2s-blocks but outside the s-blocks,
    T_2s = T_s - T_s N_s T_s, per 2s-block the identity
    [[L11, 0], [A21, L22]]^-1 = [[T11, 0], [-T22 A21 T11, T22]] with Tii = Lii^-1.
    Every intermediate is a block of the true inverse, which the delta rule keeps bounded.
    (The power series (I - a)(I + a^2)(I + a^4)... is not safe: for correlated keys the
    entries of a^m grow like binomial coefficients, and fp32 loses the inverse in cancellation.)
    """
    n = a.shape[0]
    # i ^ j < 2s: i and j lie in the same aligned block of size 2s (s a power of two)
    x = lax.broadcasted_iota(jnp.int32, (n, n), 0) ^ lax.broadcasted_iota(jnp.int32, (n, n), 1)
    inv = jnp.where(x == 0, 1.0, 0.0) - jnp.where(x < 2, a, 0.0)
    s = 2
    while s < n:
        outer = (x >= s) & (x < 2 * s)
        inv = inv - product(inv, product(jnp.where(outer, a, 0.0), inv))
        s *= 2
    return inv


# ---------------------------------------------------------------------------- gate terms

class ScalarGates(NamedTuple):
    """Gate terms of one chunk of a scalar gate, from g [C]: G = cumsum(g). The [C, C]
    decay matrices are built where they are used, so that they do not hold registers in
    between."""
    G: jax.Array          # [C]
    eg: jax.Array         # exp(G) [C]
    tail: jax.Array       # exp(G_C - G) [C]
    last: jax.Array       # exp(G_C) []

    def strict(self):
        """exp(G_i - G_j) for j < i, else 0 [C, C]."""
        return self._decays(lambda rows, cols: rows > cols)

    def causal(self):
        """exp(G_i - G_j) for j <= i, else 0 [C, C]."""
        return self._decays(lambda rows, cols: rows >= cols)

    def _decays(self, visible):
        C = self.G.shape[0]
        rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
        cols = lax.broadcasted_iota(jnp.int32, (C, C), 1)
        return jnp.exp(jnp.where(visible(rows, cols), self.G[:, None] - self.G[None, :],
                                 -jnp.inf))


def scalar_gates(g) -> ScalarGates:
    G = jnp.cumsum(g)
    total = jnp.sum(g)
    return ScalarGates(G, jnp.exp(G), jnp.exp(total - G), jnp.exp(total))


# ---------------------------------------------------------------------------- row scales

def row_scale(x: Tile, bk: int, normalize: bool):
    """1 / sqrt(sum(x^2) + eps) of each row of a [C, d] tile ([C] float32), the L2 norm
    that ``jaxcp.l2norm.l2_normalize`` applies, or None (no normalisation). The kernels fold
    it into the row scales they apply anyway, so that normalised q and k never go through
    memory."""
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


def unit_rows(x: Tile, i: int, bk: int, r):
    """Block i of bk columns of a [C, d] tile in float32, its rows scaled by r (None: as
    stored)."""
    y = x.cols(i, bk).astype(jnp.float32)
    return y if r is None else y * r[:, None]


# ---------------------------------------------------------------------------- operands

class Operands:
    """The inputs (or outputs) of one pallas_call by name, in call order: their BlockSpecs
    and arrays (or ShapeDtypeStructs)."""

    def __init__(self):
        self.names: list[str] = []
        self.specs: list = []
        self.values: list = []

    def add(self, name: str, spec, value) -> None:
        if name in self.names:
            raise ValueError(f"operand {name!r} added twice")
        self.names.append(name)
        self.specs.append(spec)
        self.values.append(value)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def unified(self) -> tuple[list, object]:
        """The arrays cast to one vma type (``vma.unify``) and the manual axis type their
        outputs take."""
        return unify(self.values)


def refs_type(name: str, required: str, optional: str = "") -> type:
    """The NamedTuple type of a kernel's refs: the operands every call has (space-separated
    names), then those a call may leave out (None in the kernel when it does)."""
    optional_names = optional.split()
    return collections.namedtuple(name, required.split() + optional_names,
                                  defaults=(None,) * len(optional_names))


def named(structure: type, names: tuple[str, ...], refs) -> NamedTuple:
    """A kernel's refs as the NamedTuple `structure`, ref i under names[i]; fields that no
    operand has are left at their default (None)."""
    return structure(**dict(zip(names, refs)))


def call(kernel, grid, ins: Operands, outs: Callable, *, name: str, params: dict,
         aliases: dict[str, str] | None = None, **static):
    """pallas_call of kernel(*refs, names=..., **static) over ins and the outputs that
    outs(struct) adds (struct(shape, dtype) makes an output's ShapeDtypeStruct with the
    inputs' vma type); aliases maps an input name to the output name it is written as.
    Returns the outputs as a dict by name."""
    args, mat = ins.unified()
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(tuple(shape), dtype,
                                                       manual_axis_type=mat)
    out = Operands()
    outs(out, struct)
    alias_idx = {ins.index(i): out.index(o) for i, o in (aliases or {}).items()}
    result = pl.pallas_call(
        partial(kernel, names=tuple(ins.names + out.names), **static), grid=grid,
        in_specs=ins.specs, out_specs=out.specs, out_shape=out.values,
        input_output_aliases=alias_idx, name=name, **params)(*args)
    return dict(zip(out.names, result)), args


# ------------------------------------------------------------- per-chunk kernels' grid

class ChunkSpecs(NamedTuple):
    """BlockSpecs of a grid over (chunk, batch, head): `tile(d)` and `vec` for chunk terms
    [NT, B, HV, C, d] and [NT, B, HV, C]; `token(d)` for the slab of a token tensor
    [B, T, HV, d] (d None: [B, T, HV]); `chunk_rows` for the layout's token_start and
    token_count [NT, B]; `scalar` for [NT, B, HV]."""
    tile: Callable
    vec: pl.BlockSpec
    token: Callable
    chunk_rows: pl.BlockSpec
    scalar: pl.BlockSpec


def chunk_specs(C: int, T: int) -> ChunkSpecs:
    return ChunkSpecs(
        tile=lambda d: pl.BlockSpec((None, None, None, C, d), lambda t, b, h: (t, b, h, 0, 0)),
        vec=pl.BlockSpec((None, None, None, C), lambda t, b, h: (t, b, h, 0)),
        token=lambda d: slab_spec(T, d, lambda t, b, h: (b, h, 0)),
        chunk_rows=pl.BlockSpec((1, 1), lambda t, b, h: (t, b)),
        scalar=pl.BlockSpec((None, None, None), lambda t, b, h: (t, b, h)),
    )


def add_chunk_rows(ins: Operands, sp: ChunkSpecs, layout) -> None:
    """The layout's token_start, token_count as inputs, when it places chunks by table."""
    if layout.token_start is not None:
        ins.add("token_start", sp.chunk_rows, layout.token_start)
        ins.add("token_count", sp.chunk_rows, layout.token_count)


def rows_of_chunk(refs, C: int, chunk_axis: int = 0) -> ChunkRows:
    """The rows of this program's chunk (grid axis chunk_axis) in the token slabs: from the
    refs' token_start, token_count [1, 1] when the layout has a table, else c C on."""
    if refs.token_start is None:
        return ChunkRows(pl.program_id(chunk_axis) * C, None, C)
    return ChunkRows(refs.token_start[0, 0], refs.token_count[0, 0], C)
