"""Shared-memory operand tiles and wgmma products of the Mosaic GPU kernels."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE_BYTES = 128
SMEM_BYTES = 227 * 1024         # shared memory a Hopper block may opt in to
# The widest staging tile (``unstage``): at 256 columns Mosaic GPU's layout inference
# searches its load plans for minutes, so wider rows are staged in pieces of this width
STAGING_WIDTH = 128


def operand_smem(shape: tuple[int, ...], dtype, swizzle: int = SWIZZLE_BYTES) -> plgpu.SMEM:
    """A wgmma operand tile in shared memory: 8-row tiles of swizzle bytes, swizzled."""
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def staging_smem(shape: tuple[int, ...], dtype, swizzle: int = SWIZZLE_BYTES) -> plgpu.SMEM:
    """A tile that TMA fills at any first row (a chunk read by a token table): 1-row tiles
    of swizzle bytes, swizzled, so that the WGMMA-layout load that moves it into an operand
    tile (``unstage``) reads it through the swizzle (untiled, the rows of a [C, 128] bf16
    tile are 256 bytes apart and eight of a warp's rows fall on the same banks). Rows of
    shape[-1] dtype elements, a multiple of swizzle bytes."""
    transforms = (plgpu.TilingTransform((1, swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def products(pairs, shape: tuple[int, int]):
    """sum_i a_i b_i, float32 accumulation, in registers (the wgmma accumulator layout):
    b_i in shared memory, a_i in shared memory or a 16-bit array in registers."""
    def run(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def store_tile(tile_s, value, dst) -> None:
    """value into the shared-memory tile tile_s once every store in flight has read its
    tiles, then from there to the global-memory ref dst by TMA (left in flight)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    tile_s[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile_s, dst)


def unstage(staging, dst, count) -> None:
    """The first count rows of a staging tile (``staging_smem``) into the operand tile dst
    (or a block of its columns as wide as the staging tile), zeros in the rest, through
    registers (the caller commits dst to shared memory).

    A chunk read by a token table starts at any row, and a TMA copy into an operand tile
    (8-row tiles) needs its first row a multiple of 8: the copy goes into a staging tile
    and this moves it. The rows past the chunk's tokens (the next sequence's, or TMA's
    zeros past T) become zeros, so nothing of another sequence, a NaN included, reaches the
    chunk's products."""
    x = plgpu.load(staging, layout=plgpu.Layout.WGMMA)
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, x.shape, 0), plgpu.Layout.WGMMA)
    dst[...] = jnp.where(rows < count, x, jnp.zeros((), x.dtype))
