"""The forward chunk state recurrence (GDN's scalar gate) as one Mosaic GPU kernel: the twin
of ``jaxcp.xla.state.state_fwd``, with its signature and layout (chunks on axis 0, then batch
B and value heads HV; plain terms, chunk layout).

One program per (batch row b, value head hv, block of BV state columns) holds its [K, BV]
slice of the state S in float32 registers (the wgmma accumulator layout) and runs the
chunks in order:

    S_c   = init[seq_c] if starts_c else S          (zero without init)
    vn_c  = u_c - w_c S_c                           [C, BV]
    S     = decay_c S_c + kd_c^T vn_c               [K, BV]

w_c, kd_c [C, K] and u_c [C, BV] arrive in shared memory by TMA, into a ring of two slots:
chunk c + 1's copies are issued before chunk c's products, so they run while the products
do. S_c and vn_c are written to shared memory in the operand dtype (bf16 or f16, as the
Triton kernels' bf16 products) for the two wgmma products, which accumulate in float32; the
same tiles go out by TMA as h_c (the state entering chunk c) and vn_c, one chunk's stores
in flight while the next chunk computes. The last state leaves in float32.

Shapes: w, kd [NT, B, HV, C, K] bf16 or f16; u [NT, B, HV, C, V]; decay [NT, B, HV, 1];
layout.chunk_starts, chunk_seq [NT, B]; init [N, HV, K, V] or None; h0 [B, HV, K, V]. Returns
h [NT, B, HV, K, V] and v_new [NT, B, HV, C, V] in the operand dtype, and the last state
[B, HV, K, V] float32.
C, K and V are multiples of 64 (wgmma's tile).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxcp.layout import ChunkLayout
from jaxcp.terms import ChunkTerms

SWIZZLE_BYTES = 128
OPERAND_DTYPES = (jnp.bfloat16, jnp.float16)
SMEM_BYTES = 227 * 1024         # shared memory a Hopper block may opt in to


@dataclass(frozen=True)
class StateBlocks:
    """block_cols: state columns per program (BV), a multiple of 64 dividing V."""
    block_cols: int = 64


def _operand_smem(shape: tuple[int, int], dtype) -> plgpu.SMEM:
    """A wgmma operand tile in shared memory: 8-row tiles of 128 bytes, 128-byte swizzle."""
    transforms = (plgpu.TilingTransform((8, SWIZZLE_BYTES // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(SWIZZLE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _smem_bytes(C: int, K: int, BV: int) -> int:
    """The kernel's shared memory: two ring slots of w, kd (2 bytes) and u (float32), the
    operand tiles of S and vn (h and v_new leave from them), and the last state's float32
    tile."""
    return 2 * (2 * C * K * 2 + C * BV * 4) + (K * BV + C * BV) * 2 + K * BV * 4


def _check(terms: ChunkTerms, init: jax.Array | None, h0: jax.Array, block_cols: int) -> None:
    NT, B, HV, C, K = terms.w.shape
    V = terms.u.shape[-1]
    if tuple(h0.shape) != (B, HV, K, V):
        raise ValueError(f"h0 must be [B, HV, K, V] = {(B, HV, K, V)}, got {tuple(h0.shape)}")
    if init is not None and (init.ndim != 4 or tuple(init.shape[1:]) != (HV, K, V)):
        raise ValueError(f"init must be [N, HV, K, V] with (HV, K, V) = {(HV, K, V)}, got "
                         f"{tuple(init.shape)}")
    if terms.decay.shape[-1] != 1:
        raise ValueError(f"the Mosaic state kernel takes the scalar gate (decay [..., 1]), "
                         f"got decay {tuple(terms.decay.shape)}")
    if terms.q_rows is not None:
        raise ValueError("the Mosaic state kernel takes plain terms, not row-factored ones")
    for name, n in (("C", C), ("K", K), ("V", V), ("block_cols", block_cols)):
        if n % 64:
            raise ValueError(f"the Mosaic state kernel needs {name} a multiple of 64, got {n}")
    if V % block_cols:
        raise ValueError(f"block_cols {block_cols} must divide V = {V}")
    if _smem_bytes(C, K, block_cols) > SMEM_BYTES:
        raise ValueError(f"block_cols {block_cols} at C = {C}, K = {K} needs "
                         f"{_smem_bytes(C, K, block_cols)} bytes of shared memory, over "
                         f"{SMEM_BYTES}: take fewer columns")
    if terms.w.dtype not in OPERAND_DTYPES or terms.kd.dtype != terms.w.dtype:
        raise TypeError(f"the Mosaic state kernel takes w and kd in one of bfloat16, float16 "
                        f"(its products' operands), got {terms.w.dtype} and {terms.kd.dtype}")


def state_fwd(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array,
              *, blocks: StateBlocks = StateBlocks(), interpret: bool = False):
    """h [NT, B, HV, K, V] (the state entering each chunk) and v_new [NT, B, HV, C, V] in the
    operand dtype, and the state after the last chunk [B, HV, K, V] float32 (module
    docstring). interpret: run in
    Mosaic GPU's interpret mode (any device)."""
    NT, B, HV, C, K = terms.w.shape
    V = terms.u.shape[-1]
    BV = blocks.block_cols
    _check(terms, init, h0, BV)
    operand = terms.w.dtype
    f32 = jnp.float32
    has_init = init is not None
    acc_layout = plgpu.Layout.WGMMA

    def kernel(w_g, u_g, kd_g, decay_g, starts_g, seq_g, init_g, h0_g,
               h_g, vn_g, last_g, w_s, kd_s, u_s, s_s, vn_s, last_s, arrived):
        b, hv, j = lax.axis_index("b"), lax.axis_index("hv"), lax.axis_index("j")
        cols = pl.ds(j * BV, BV)

        def fetch(c, slot):
            """Chunk c's w, kd and u into a ring slot; arrived[slot] counts the three."""
            plgpu.copy_gmem_to_smem(w_g.at[c, b, hv], w_s.at[slot], arrived.at[slot])
            plgpu.copy_gmem_to_smem(kd_g.at[c, b, hv], kd_s.at[slot], arrived.at[slot])
            plgpu.copy_gmem_to_smem(u_g.at[c, b, hv, :, cols], u_s.at[slot], arrived.at[slot])

        def tile(ref):
            """A [rows, BV] float32 tile of global memory into registers (element by element:
            jax 0.11.2 has no vectorised global load in this layout)."""
            return plgpu.load(ref, layout=acc_layout, optimized=False)

        def entering(c, S):
            if has_init:
                fresh = lambda: tile(init_g.at[plgpu.load(seq_g.at[c, b]), hv, :, cols])
            else:
                fresh = lambda: plgpu.layout_cast(jnp.zeros((K, BV), f32), acc_layout)
            # a sequence start selects the fresh state: what came before never reaches it
            return lax.cond(plgpu.load(starts_g.at[c, b]) != 0, fresh, lambda: S)

        def product(a, b_, shape):
            def run(acc):
                plgpu.wgmma(acc, a, b_)
                return acc[...]
            return pl.run_scoped(run, plgpu.ACC(shape, f32))

        def operand_out(tile_s, value, dst):
            """value in the operand dtype into tile_s, once tile_s's store of the chunk before
            has read it (the other tile's store may still be in flight), and from there both
            to the next product and, by TMA, to dst."""
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            tile_s[...] = value.astype(operand)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile_s, dst)

        def chunk(c, S):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < NT)
            def _():
                fetch(c + 1, 1 - slot)

            S = entering(c, S)
            operand_out(s_s, S, h_g.at[c, b, hv, :, cols])
            plgpu.barrier_wait(arrived.at[slot])
            u = plgpu.load(u_s.at[slot], layout=acc_layout)
            vn = u - product(w_s.at[slot], s_s, (C, BV))
            operand_out(vn_s, vn, vn_g.at[c, b, hv, :, cols])
            decay = plgpu.load(decay_g.at[c, b, hv])
            return decay * S + product(kd_s.at[slot].T, vn_s, (K, BV))

        fetch(0, 0)
        last_s[...] = lax.fori_loop(0, NT, chunk, tile(h0_g.at[b, hv, :, cols]))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(last_s, last_g.at[b, hv, :, cols])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((NT, B, HV, K, V), operand),
                  jax.ShapeDtypeStruct((NT, B, HV, C, V), operand),
                  jax.ShapeDtypeStruct((B, HV, K, V), f32)),
        scratch_types=[_operand_smem((2, C, K), operand), _operand_smem((2, C, K), operand),
                       plgpu.SMEM((2, C, BV), f32),
                       _operand_smem((K, BV), operand), _operand_smem((C, BV), operand),
                       plgpu.SMEM((K, BV), f32),
                       plgpu.Barrier(num_arrivals=3, num_barriers=2)],
        grid=(B, HV, V // BV), grid_names=("b", "hv", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    init_arg = init.astype(f32) if has_init else jnp.zeros((1, HV, K, V), f32)
    return call(terms.w, terms.u.astype(f32), terms.kd, terms.decay[..., 0].astype(f32),
                layout.chunk_starts.astype(jnp.int32), layout.chunk_seq.astype(jnp.int32),
                init_arg, h0.astype(f32))


def state_fwd_reference(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                        h0: jax.Array):
    """The kernel's numbers in jnp: ``xla.state.state_fwd``'s recurrence with the state and
    vn rounded to the operand dtype before their products, as the kernel's wgmma operands
    are (float32 accumulation), and h and v_new returned in it, as the kernel's are."""
    operand = terms.w.dtype
    f32 = jnp.float32
    rounded = lambda x: x.astype(operand).astype(f32)

    def step(S, xs):
        w, u, kd, decay, starts, seq = xs
        fresh = jnp.zeros_like(S) if init is None else init[seq].astype(f32)
        S = jnp.where(starts[:, None, None, None], fresh, S)
        vn = u.astype(f32) - jnp.einsum("bhck,bhkv->bhcv", w.astype(f32), rounded(S))
        out = decay.astype(f32)[..., None] * S + jnp.einsum(
            "bhck,bhcv->bhkv", kd.astype(f32), rounded(vn))
        return out, (S.astype(operand), vn.astype(operand))

    last, (h, vn) = lax.scan(step, h0.astype(f32), (terms.w, terms.u, terms.kd, terms.decay,
                                                    layout.chunk_starts, layout.chunk_seq))
    return h, vn, last

