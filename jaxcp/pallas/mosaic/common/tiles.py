"""Shared-memory operand tiles and wgmma products of the Mosaic GPU kernels."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE_BYTES = 128
SMEM_BYTES = 227 * 1024         # shared memory a Hopper block may opt in to


def operand_smem(shape: tuple[int, ...], dtype, swizzle: int = SWIZZLE_BYTES) -> plgpu.SMEM:
    """A wgmma operand tile in shared memory: 8-row tiles of swizzle bytes, swizzled."""
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
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
