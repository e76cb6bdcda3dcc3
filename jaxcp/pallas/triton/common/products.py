"""Matrix products of the Pallas kernels: fp32 accumulation always, and how fp32 operands
keep their digits on tensor cores.

fp32 x fp32 runs as 3xTF32 on tensor cores (~1e-7 relative per product); bf16 tiles meet
fp32 ones either rounded to bf16 or as two bf16 parts (hi + lo, ~2^-16 relative); float16
tiles meet them as TF32 or as scaled float16 products (``scaled_float16_dot``). Interpret
mode (CPU) computes IEEE fp32 where the GPU runs TF32 products, and the GPU's bf16 and
float16 roundings as they are. Also the block products of [C, d] tiles (``gram``,
``sum_dots``) and the inverse (I + A)^-1 of a strictly lower A (``unit_lower_inverse``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax import lax

from jaxcp.pallas.triton.common.chunk_rows import ChunkRef

class Fp32Products(enum.Enum):
    """How the kernels multiply fp32 operands that must keep more digits than bf16's 8 bits,
    on tensor cores (IEEE fp32 products would be FMA loops on CUDA cores).

    TF32X3 (the fp32 path): each operand as hi + lo TF32 parts, three TF32 products, ~1e-7
    relative per product. TF32 (bf16 inputs whose intermediates stay fp32, KDA's): one TF32
    product, each operand rounded to TF32's 10-bit mantissa (2^-11 relative, 8x finer than
    bf16), at the cost of two bf16 products. BF16X3: hi + lo bf16 parts, three bf16
    products, ~2^-16 relative, more digits than bf16 inputs can use, and slower than TF32
    in KDA's kernels (docs/benchmarks/kernels_kda.md)."""
    TF32X3 = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    TF32 = lax.DotAlgorithmPreset.TF32_TF32_F32
    BF16X3 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3

    @classmethod
    def for_inputs(cls, dtype) -> "Fp32Products":
        """TF32X3 for fp32 inputs, TF32 for bf16 ones."""
        return cls.TF32X3 if jnp.dtype(dtype) == jnp.float32 else cls.TF32


@dataclass(frozen=True)
class KernelPrecision:
    """How a kernel multiplies and what it stores, one per stage set (``jaxcp.stages`` picks
    it from the input dtype); the defaults are those of fp32 inputs.

    dot_dtype: the state kernels' u, do and stored h, v_new, X, dvn (bf16 halves GDN's bytes).
    tile_dtype: the terms' tiles as stored and read (float16: TF32's mantissa, half the bytes).
    precise: fp32 products at `products`; else bf16 and TF32 ones, for bf16-stored results.
    products: how precise fp32 products run on tensor cores (``Fp32Products``).
    scaled_float16: float16 tiles meet the state kernels' fp32 operands (states, v_new,
    cotangents) as ``scaled_float16_dot`` products instead of TF32 ones.
    """
    dot_dtype: Any = jnp.float32
    tile_dtype: Any = jnp.float32
    precise: bool = True
    products: Fp32Products = Fp32Products.TF32X3
    scaled_float16: bool = False


def fp32_precision(interpret: bool, products: Fp32Products = Fp32Products.TF32X3):
    """The precision of fp32 x fp32 products: `products`; IEEE fp32 in interpret mode (CPU)."""
    return lax.Precision.HIGHEST if interpret else products.value


def bf16_dot(a, b):
    """a @ b of both operands rounded to bf16, fp32 accumulation."""
    return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)


def scaled_float16_dot(a, b):
    """a @ b of a float16 tile and an fp32 operand x (either side), fp32 accumulation: x
    divided by s, the power of two at or above its largest magnitude, rounded to float16,
    the product times s. Scaling by s is exact and puts every entry of x / s within
    [-1, 1], so no magnitude of x overflows float16. An entry within 2^14 of x's largest
    keeps float16's 11 significant bits (2^-12 relative, rounded to nearest; TF32 keeps as
    many); a smaller one keeps an absolute error under 2^-25 of the largest, fewer bits of
    its own: each product entry is off by at most sum_k |t_k| (2^-12 |x_k| + 2^-25 max |x|)
    for the tile's entries t_k it sums over. Twice a TF32 product's rate, and the float16
    tile enters as it is stored. A NaN or infinity in x makes the whole product non-finite,
    as it makes the product's rows or columns non-finite in TF32."""
    x = a if a.dtype == jnp.float32 else b
    largest = jnp.maximum(jnp.max(jnp.abs(x)), jnp.float32(1e-30))
    s = jnp.exp2(jnp.ceil(jnp.log2(largest)))
    scaled = (x * (1.0 / s)).astype(jnp.float16)
    if a.dtype == jnp.float32:
        a, b = scaled, b.astype(jnp.float16)
    else:
        a, b = a.astype(jnp.float16), scaled
    return jnp.dot(a, b, preferred_element_type=jnp.float32) * s


def _two_parts(x, split):
    """x as hi + lo with hi = x rounded to bf16 where split (True, or a traced bool scalar
    that differs between programs), else hi = x and lo = 0: a product by hi then rounds x
    as the unsplit product does, and the one by lo adds an exact zero."""
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32)
    if split is True:
        return rounded, x - rounded
    hi = jnp.where(split, rounded, x)
    return hi, jnp.where(split, x - hi, 0.0)


def _split_dot(a, b, split, product, tile_dtype):
    """a @ b as two products of the fp32 operand's ``_two_parts`` with the other operand,
    a tile taken as tile_dtype (exact in the product's inputs)."""
    if a.dtype == jnp.float32:
        hi, lo = _two_parts(a, split)
        b = b.astype(tile_dtype)
        return product(hi, b) + product(lo, b)
    hi, lo = _two_parts(b, split)
    a = a.astype(tile_dtype)
    return product(a, hi) + product(a, lo)


def dot(a, b, interpret: bool, split=False, products: Fp32Products = Fp32Products.TF32X3,
        scaled_float16: bool = False):
    """a @ b with fp32 accumulation. fp32 x fp32 runs at ``fp32_precision`` (`products`).
    An fp32 operand meeting a bf16 tile is rounded to bf16, or with split taken as two bf16
    parts x = hi + lo (two bf16 products, x kept to ~2^-16 relative; 3xTF32 would cost
    three TF32 products, each at half the bf16 rate). A float16 tile (bf16 inputs: TF32
    `products`) meets an fp32 operand as fp32, exact: float16 holds the 10-bit mantissa of
    a TF32 operand; with split, on the GPU, as two TF32 products of the operand's parts,
    ~2^-20 relative, where 3xTF32 would spend a third product on the tile's zero low part;
    unsplit with scaled_float16 as ``scaled_float16_dot`` (in interpret mode too: its
    roundings are float16's, the GPU's).
    split may be a traced bool scalar (it differs between the programs of
    ``state.cp_summary``): where false, the result is the unsplit product's."""
    if jnp.float16 in (a.dtype, b.dtype) and jnp.float32 in (a.dtype, b.dtype):
        if split is False and scaled_float16:
            return scaled_float16_dot(a, b)
        if split is not False and not interpret:
            tf32 = partial(jnp.dot, preferred_element_type=jnp.float32,
                           precision=Fp32Products.TF32.value)
            return _split_dot(a, b, split, tf32, jnp.float32)
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if a.dtype == b.dtype:
        precision = fp32_precision(interpret, products) if a.dtype == jnp.float32 else None
        return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
    if split is False:
        return bf16_dot(a, b)
    return _split_dot(a, b, split, bf16_dot, jnp.bfloat16)


class Dots(NamedTuple):
    """a @ b with fp32 accumulation: `native` for tiles as loaded (bf16 MMA for bf16
    inputs), `plain` for products with fp32 operands (the inverse's chain included),
    `split` for an fp32 [C, C] a times a tile b as loaded."""
    native: Callable
    plain: Callable
    split: Callable


def dots(precision: KernelPrecision, interpret: bool, *, rounded: bool = False) -> Dots:
    """precision.precise: every fp32 x fp32 product at precision.products
    (``Fp32Products``; 3xTF32 for fp32 inputs). With BF16X3 a bf16 tile meets an fp32 one
    as two bf16 products (``dot``'s split) and another bf16 tile as one: pass bf16 tiles as
    loaded, not cast to fp32.
    Otherwise (bf16 inputs): bf16 products of the inputs and single TF32 products of fp32
    tiles, the inverse's chain included: its error, ~2e-4 relative on w, is far under the
    bf16 rounding w is stored with (~2e-3; docs/precision.md); `split` takes the fp32
    factor as two bf16 parts (``dot``), faster than one TF32 product for w and u
    (docs/benchmarks/kernels.md). rounded (bf16 inputs
    only): fp32 operands are rounded to bf16 for `plain` products, for kernels whose results
    are gradients. Interpret mode (CPU) computes IEEE fp32."""
    def with_precision(level):
        return partial(jnp.dot, preferred_element_type=jnp.float32, precision=level)
    precise, products = precision.precise, precision.products
    if precise and products is Fp32Products.BF16X3 and not interpret:
        exact = partial(dot, interpret=False, split=True, products=products)
        return Dots(exact, exact, exact)
    if interpret or precise:
        exact = with_precision(fp32_precision(interpret, products))
        return Dots(exact, exact, lambda a, b: exact(a, b.astype(jnp.float32)))
    tf32 = with_precision(None)
    return Dots(tf32, bf16_dot if rounded else tf32, partial(dot, interpret=False, split=True))


def col_tiles(x: ChunkRef, n: int):
    """The blocks of n columns of x, loaded."""
    return [x.cols(j, n) for j in range(x.width // n)]


def sum_dots(product, x: ChunkRef, ys, n: int):
    """sum_j x[:, block j] @ ys[j]^T over blocks j of n columns of x (ys: loaded blocks)."""
    acc = None
    for j, y in enumerate(ys):
        term = product(x.cols(j, n), y.T)
        acc = term if acc is None else acc + term
    return acc


def gram(x: ChunkRef, y: ChunkRef, products: Dots, bk: int):
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
