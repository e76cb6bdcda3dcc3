"""The reverse chunk state recurrence (GDN's scalar gate) as one Mosaic GPU kernel: the twin
of ``jaxcp.pallas.triton.common.state.state_bwd`` on row-factored terms (``ChunkTerms``
with q, k the token tensors [B, T, HV, K] and their row factors, as the Pallas GDN intra
kernels give them), token-major do [B, T, HV, V].

One program per (batch row b, value head hv, block of BV state columns) holds its [K, BV]
slice of the cotangent carry in float32 registers (the wgmma accumulator layout) and runs
the chunks last to first:

    X_c   = carry + (dF[seq_c] if ends_c, with d_final)               [K, BV]
    dvn_c = attn_c^T do_c + diag(k_rows_c) (k_c X_c)                 [C, BV]
    dh_c  = decay_c X_c + q_c^T (diag(q_rows_c) do_c) - w_c^T dvn_c   [K, BV]
    d_init[seq_c] = dh_c if starts_c (with_d_init);   carry = 0 if starts_c else dh_c

and returns X_c and dvn_c per chunk (bf16, for the input cotangents) and the carry after
chunk 0 (d_entry, float32). X_c, dvn_c and diag(q_rows) do_c are rounded to bf16 for their
products (float32 accumulation), as the Triton kernel's bf16 products round them.

Each chunk's tiles (w, attn, the chunk's rows of q, k and do, the row factors) arrive by TMA
into a ring of two slots, chunk c - 1's copies issued before chunk c's products; its
scalars (starts, ends, seq, decay) load during the chunk before, so that the carry's chain
(k X, dvn, w^T dvn) waits for no global load. X_c and dvn_c leave by TMA from their operand
tiles, one chunk's stores in flight while the next computes.

Shapes: w [NT, B, HV, C, K], attn [NT, B, HV, C, C] bf16; q, k (terms.qg, terms.kd) [B, T,
HV, K] bf16 with T = NT C; q_rows, k_rows [NT, B, HV, C] float32; decay [NT, B, HV, 1]; do
[B, T, HV, V] bf16; d_final [N, HV, K, V] or None; d_last [B, HV, K, V] float32. C = 64;
K, V multiples of 64, BV of 32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxcp.layout import ChunkLayout
from jaxcp.pallas.mosaic.common.state import StateBlocks
from jaxcp.pallas.mosaic.common.tiles import (SMEM_BYTES, SWIZZLE_BYTES, operand_smem, products,
                                               store_tile)
from jaxcp.terms import ChunkTerms
from jaxcp.vma import unify, vary_like

# two ring slots of 64 columns (K = V = 128: 184 KiB of shared memory), else one slot of 32
CANDIDATE_BLOCKS = (StateBlocks(64, 2), StateBlocks(32, 1))


def _smem_bytes(C: int, K: int, blocks: StateBlocks) -> int:
    """Ring slots of w, q, k [C, K], attn [C, C], do [C, BV] (bf16) and the two row factors
    (float32); the operand tiles of X [K, BV], dvn and diag(q_rows) do [C, BV]; the float32
    tile d_init's rows and d_entry leave through."""
    BV = blocks.block_cols
    per_slot = (3 * C * K + C * C + C * BV) * 2 + 2 * C * 4
    return blocks.slots * per_slot + (K * BV + 2 * C * BV) * 2 + K * BV * 4


def _refusal(terms: ChunkTerms, layout: ChunkLayout, do: jax.Array, d_last: jax.Array,
             blocks: StateBlocks) -> Exception | None:
    """The error for what the kernel does not take with these blocks, or None."""
    NT, B, HV, C, K = terms.w.shape
    V = do.shape[-1]
    if terms.k_rows is None or terms.q_rows is None:
        return ValueError("the Mosaic reverse state kernel takes row-factored terms (q, k "
                          "token tensors with k_rows and q_rows)")
    if layout.token_start is not None:
        return ValueError("the Mosaic reverse state kernel reads whole chunks: a layout "
                          "with a token table (packed sequences, or T not a multiple of C) "
                          "is not supported")
    if terms.decay.shape[-1] != 1:
        return ValueError(f"the Mosaic reverse state kernel takes the scalar gate (decay "
                          f"[..., 1]), got decay {tuple(terms.decay.shape)}")
    for name, x in (("q", terms.qg), ("k", terms.kd)):
        if tuple(x.shape) != (B, NT * C, HV, K):
            return ValueError(f"{name} must be the token tensor [B, T, HV, K] = "
                              f"{(B, NT * C, HV, K)}, got {tuple(x.shape)}")
    if tuple(do.shape) != (B, NT * C, HV, V):
        return ValueError(f"do must be [B, T, HV, V] = {(B, NT * C, HV, V)}, got "
                          f"{tuple(do.shape)}")
    if tuple(d_last.shape) != (B, HV, K, V):
        return ValueError(f"d_last must be [B, HV, K, V] = {(B, HV, K, V)}, got "
                          f"{tuple(d_last.shape)}")
    if C != 64:
        return ValueError(f"the Mosaic reverse state kernel takes chunks of 64 (the size "
                          f"measured), got C = {C}")
    for name, n, multiple in (("K", K, 64), ("V", V, 64),
                              ("block_cols", blocks.block_cols, 32)):
        if n % multiple:
            return ValueError(f"the Mosaic reverse state kernel needs {name} a multiple of "
                              f"{multiple}, got {n}")
    if V % blocks.block_cols:
        return ValueError(f"block_cols {blocks.block_cols} must divide V = {V}")
    dtypes = {x.dtype for x in (terms.w, terms.qg, terms.kd, terms.attn, do)}
    if dtypes != {jnp.dtype(jnp.bfloat16)}:
        return TypeError(f"the Mosaic reverse state kernel takes w, q, k, attn and do in "
                         f"bfloat16, got {sorted(str(d) for d in dtypes)}")
    smem = _smem_bytes(C, K, blocks)
    if smem > SMEM_BYTES:
        return ValueError(f"block_cols {blocks.block_cols} with {blocks.slots} slots at "
                          f"C = {C}, K = {K} needs {smem} bytes of shared memory, over "
                          f"{SMEM_BYTES}")
    return None


def _first_fitting(terms, layout, do, d_last) -> StateBlocks | None:
    return next((b for b in CANDIDATE_BLOCKS
                 if _refusal(terms, layout, do, d_last, b) is None), None)


def takes(terms: ChunkTerms, layout: ChunkLayout, do: jax.Array, d_last: jax.Array) -> bool:
    """Whether the kernel runs on these inputs (with the first of ``CANDIDATE_BLOCKS`` that
    fits); where it does not, ``state_bwd`` raises the reason."""
    return _first_fitting(terms, layout, do, d_last) is not None


def state_bwd(terms: ChunkTerms, layout: ChunkLayout, do: jax.Array,
              d_final: jax.Array | None, d_last: jax.Array, *, with_d_init: bool = False,
              blocks: StateBlocks | None = None, interpret: bool = False):
    """(d_entry [B, HV, K, V] float32, d_init [N, HV, K, V] float32 or None, X [NT, B, HV,
    K, V] bf16, dvn [NT, B, HV, C, V] bf16) (module docstring). interpret: Mosaic GPU's
    interpret mode (any device)."""
    NT, B, HV, C, K = terms.w.shape
    V = do.shape[-1]
    blocks = blocks or _first_fitting(terms, layout, do, d_last) or CANDIDATE_BLOCKS[0]
    error = _refusal(terms, layout, do, d_last, blocks)
    if error is not None:
        raise error
    BV, slots = blocks.block_cols, blocks.slots
    bf16, f32 = jnp.bfloat16, jnp.float32
    has_final = d_final is not None
    N = layout.seq_ends_here.shape[0]
    acc_layout = plgpu.Layout.WGMMA
    row_layout = acc_layout.reduce(1)

    def kernel(w_g, q_g, k_g, attn_g, do_g, q_rows_g, k_rows_g, decay_g, starts_g, ends_g,
               seq_g, d_final_g, d_last_g, x_g, dvn_g, d_init_g, d_entry_g,
               w_s, q_s, k_s, attn_s, do_s, q_rows_s, k_rows_s, x_s, dvn_s, qdo_s, init_s,
               arrived):
        b, hv, j = lax.axis_index("b"), lax.axis_index("hv"), lax.axis_index("j")
        cols = pl.ds(j * BV, BV)

        def fetch(c, slot):
            """Chunk c's tiles into a ring slot; arrived[slot] counts them."""
            copy = lambda src, dst: plgpu.copy_gmem_to_smem(src, dst.at[slot],
                                                            arrived.at[slot])
            rows = pl.ds(c * C, C)
            copy(w_g.at[c, b, hv], w_s)
            copy(q_g.at[b, rows, hv], q_s)
            copy(k_g.at[b, rows, hv], k_s)
            copy(attn_g.at[c, b, hv], attn_s)
            copy(do_g.at[b, rows, hv, cols], do_s)
            copy(q_rows_g.at[c, b, hv], q_rows_s)
            copy(k_rows_g.at[c, b, hv], k_rows_s)

        def tile(ref):
            """A float32 [K, BV] tile of global memory into registers (``state.py``)."""
            return plgpu.load(ref, layout=acc_layout, optimized=False) * 1.0

        def scale_rows(rows_s, slot, x):
            rows = plgpu.load(rows_s.at[slot], layout=row_layout)
            return lax.broadcast_in_dim(rows, x.shape, [0]) * x

        def chunk_scalars(step):
            """The scalars of the chunk of this step (last chunk first), seq where read."""
            c = NT - 1 - jnp.minimum(step, NT - 1)
            reads_seq = has_final or with_d_init
            return (plgpu.load(starts_g.at[c, b]),
                    plgpu.load(ends_g.at[c, b]) if has_final else None,
                    plgpu.load(seq_g.at[c, b]) if reads_seq else None,
                    plgpu.load(decay_g.at[c, b, hv]))

        def to_smem(tile_s, value, dst=None):
            """value into tile_s once the stores that read it a chunk ago are done, then to
            the products and, by TMA, to dst (X and dvn: two stores a chunk)."""
            if dst is not None:
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            tile_s[...] = value.astype(tile_s.dtype)
            plgpu.commit_smem()
            if dst is not None:
                plgpu.copy_smem_to_gmem(tile_s, dst)

        def step(s, carry):
            X, (starts, ends, seq, decay) = carry
            following = chunk_scalars(s + 1)
            c = NT - 1 - s
            slot = lax.rem(s, slots)
            if slots == 2:
                @pl.when(c > 0)
                def _():
                    fetch(c - 1, 1 - slot)

            if has_final:
                X = lax.cond(ends != 0,
                             lambda: X + tile(d_final_g.at[seq, hv, :, cols]), lambda: X)
            to_smem(x_s, X, x_g.at[c, b, hv, :, cols])
            plgpu.barrier_wait(arrived.at[slot])
            do = plgpu.load(do_s.at[slot], layout=acc_layout).astype(f32)
            to_smem(qdo_s, scale_rows(q_rows_s, slot, do))
            dvn = (products([(attn_s.at[slot].T, do_s.at[slot])], (C, BV))
                   + scale_rows(k_rows_s, slot, products([(k_s.at[slot], x_s)], (C, BV))))
            to_smem(dvn_s, dvn, dvn_g.at[c, b, hv, :, cols])
            dh = (decay * X + products([(q_s.at[slot].T, qdo_s)], (K, BV))
                  - products([(w_s.at[slot].T, dvn_s)], (K, BV)))
            if slots == 1:
                @pl.when(c > 0)
                def _():
                    fetch(c - 1, slot)
            if with_d_init:
                @pl.when(starts != 0)
                def _():
                    store_tile(init_s, dh, d_init_g.at[seq, hv, :, cols])
            fresh = lambda: plgpu.layout_cast(jnp.zeros((K, BV), f32), acc_layout)
            # a sequence start: nothing before it depends on what comes after
            return lax.cond(starts != 0, fresh, lambda: dh), following

        fetch(NT - 1, 0)
        d_entry, _ = lax.fori_loop(0, NT, step, (tile(d_last_g.at[b, hv, :, cols]),
                                                 chunk_scalars(0)))
        store_tile(init_s, d_entry, d_entry_g.at[b, hv, :, cols])
        plgpu.wait_smem_to_gmem(0)

    args, manual_axes = unify([
        terms.w, terms.qg, terms.kd, terms.attn, do, terms.q_rows, terms.k_rows,
        terms.decay[..., 0].astype(f32), layout.chunk_starts.astype(jnp.int32),
        layout.chunk_ends.astype(jnp.int32), layout.chunk_seq.astype(jnp.int32),
        d_final.astype(f32) if has_final else jnp.zeros((1, 1, 1, 1), f32),
        d_last.astype(f32)])
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                       manual_axis_type=manual_axes)
    swizzle = min(SWIZZLE_BYTES, BV * 2)
    smem = lambda shape: operand_smem(shape, bf16, swizzle)
    rows = plgpu.SMEM((slots, C), f32)
    kernel.__name__ = "mosaic_gdn_state_bwd"
    call = plgpu.kernel(
        kernel,
        out_type=(struct((NT, B, HV, K, V), bf16), struct((NT, B, HV, C, V), bf16),
                  struct((N if with_d_init else 1, HV, K, V), f32),
                  struct((B, HV, K, V), f32)),
        scratch_types=[smem((slots, C, K)), smem((slots, C, K)), smem((slots, C, K)),
                       smem((slots, C, C)), smem((slots, C, BV)), rows, rows,
                       smem((K, BV)), smem((C, BV)), smem((C, BV)),
                       plgpu.SMEM((K, BV), f32),
                       plgpu.Barrier(num_arrivals=7, num_barriers=slots)],
        grid=(B, HV, V // BV), grid_names=("b", "hv", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    x, dvn, d_init, d_entry = vary_like(call(*args), args[0])
    if with_d_init:
        # rows of sequences that start elsewhere are never written: a selection
        starts_here = jnp.zeros((N,), bool).at[
            jnp.where(layout.chunk_starts, layout.chunk_seq, N)].set(True, mode="drop")
        d_init = jnp.where(starts_here[:, None, None, None], d_init, 0.0)
    else:
        d_init = None
    return d_entry, d_init, x, dvn
