"""The forward chunk state recurrence (GDN's scalar gate) as one Mosaic GPU kernel, in two
forms from one body: ``state_fwd``, the twin of ``jaxcp.xla.state.state_fwd`` (h and v_new per
chunk, for the backward), and ``state_output``, the twin of ``jaxcp.xla.output.state_output``
(the recurrence fused with the output; nothing per chunk but o leaves). Terms in chunk layout
(chunks on axis 0, then batch B and value heads HV), plain or row-factored (below).

One program per (batch row b, value head hv, block of BV state columns) holds its [K, BV]
slice of the state S in float32 registers (the wgmma accumulator layout) and runs the
chunks in order:

    S_c   = init[seq_c] if starts_c else S          (zero without init)
    vn_c  = u_c - w_c S_c                           [C, BV]
    o_c   = qg_c S_c + attn_c vn_c                  [C, BV]   (state_output)
    S     = decay_c S_c + kd_c^T vn_c               [K, BV]
    finals[seq_c] = S  if ends_c                              (state_output, with_finals)

The chunk's tiles (w, kd, u; and qg, attn for the output) arrive in shared memory by TMA,
into a ring of two slots, chunk c + 1's copies issued before chunk c's products so that they
run while the products do; where two slots do not fit (K = 256), into one slot, refilled
once the chunk's products are done (``StateBlocks``, ``CANDIDATE_BLOCKS``). S_c and vn_c
are written to shared memory in the operand dtype (bf16 or f16, as the Triton kernels' bf16
products) for the wgmma products, which accumulate in float32. The tiles that leave (h_c
and vn_c from the operand tiles; o_c) go out by TMA, one chunk's stores in flight while the
next chunk computes. The last state and the finals leave in float32. A program walks its
chunks in order, so a chunk's latency is the kernel's time: each chunk's scalars (starts,
ends, seq, decay) load during the chunk before, carried in the loop, so that the state
never waits for a global load.

Row-factored terms (``ChunkTerms``, the Pallas GDN intra kernel's: qg = diag(q_rows) q,
kd = diag(k_rows) k, with q and k the token tensors [B, T, HV, K]) are read as they are: the
chunk's rows of q and k by TMA (whole chunks only: a layout without a token table), the row
factors into the accumulator's row layout, and

    o_c = diag(q_rows) (q_c S_c) + attn_c vn_c,    S = decay_c S_c + k_c^T (diag(k_rows) vn_c)

with diag(k_rows) vn_c rounded to the operand dtype for its product; o leaves token-major,
[B, T, HV, V].

Shapes: w, kd, qg [NT, B, HV, C, K] bf16 or f16 (one dtype, the operand dtype); attn
[NT, B, HV, C, C] in it; u [NT, B, HV, C, V] (float32 or the operand dtype); decay
[NT, B, HV, 1]; layout.chunk_starts, chunk_ends, chunk_seq [NT, B], seq_ends_here [N]; init
[N, HV, K, V] or None; h0 [B, HV, K, V]. C = 64 (the chunk size measured); K and V are
multiples of 64 (wgmma's tile), BV of 32.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxcp.layout import ChunkLayout, from_chunks, to_chunks
from jaxcp.pallas.mosaic.common.tiles import (SMEM_BYTES, SWIZZLE_BYTES, operand_smem, products,
                                               store_tile)
from jaxcp.terms import ChunkTerms
from jaxcp.vma import unify, vary_like

OPERAND_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclass(frozen=True)
class StateBlocks:
    """block_cols: state columns per program (BV), a multiple of 32 dividing V; slots: the
    chunk tiles' ring in shared memory, 2 (chunk c + 1's copies run while chunk c computes)
    or 1 (they are issued once chunk c's products are done)."""
    block_cols: int = 64
    slots: int = 2


# the configurations tried, fastest first, until one fits in shared memory (K = 256 needs
# the last)
CANDIDATE_BLOCKS = (StateBlocks(64, 2), StateBlocks(64, 1), StateBlocks(32, 1))


def _swizzle(blocks: StateBlocks, dtype) -> int:
    """The operand tiles' swizzle in bytes: 128, or the width of a row of BV operand columns
    where that is less (32 bf16 columns: 64). A product's two operands share it."""
    return min(SWIZZLE_BYTES, blocks.block_cols * jnp.dtype(dtype).itemsize)


def _smem_bytes(C: int, K: int, blocks: StateBlocks, u_bytes: int, out_bytes: int | None,
                factored: bool) -> int:
    """The kernel's shared memory: blocks.slots ring slots of w, kd (and qg, attn with the
    output: 2 bytes each), u (u_bytes per element) and the row factors (factored: k's, and
    q's with the output, float32), the operand tiles of S, vn (and factored, k_rows vn), o's
    tile (out_bytes per element; None: no output), and the float32 tile of the last state
    and the finals."""
    BV = blocks.block_cols
    with_output = out_bytes is not None
    per_slot = ((2 * C * K + (C * K + C * C if with_output else 0)) * 2 + C * BV * u_bytes
                + (C * 4 * (2 if with_output else 1) if factored else 0))
    return (blocks.slots * per_slot + (K * BV + C * BV * (2 if factored else 1)) * 2
            + C * BV * (out_bytes or 0) + K * BV * 4)


def _refusal(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array,
             blocks: StateBlocks, with_output: bool, out_dtype) -> Exception | None:
    """The error for what the kernel does not take with these blocks, or None."""
    block_cols = blocks.block_cols
    NT, B, HV, C, K = terms.w.shape
    V = terms.u.shape[-1]
    factored = terms.k_rows is not None
    if tuple(h0.shape) != (B, HV, K, V):
        return ValueError(f"h0 must be [B, HV, K, V] = {(B, HV, K, V)}, got {tuple(h0.shape)}")
    if init is not None and (init.ndim != 4 or tuple(init.shape[1:]) != (HV, K, V)):
        return ValueError(f"init must be [N, HV, K, V] with (HV, K, V) = {(HV, K, V)}, got "
                          f"{tuple(init.shape)}")
    if terms.decay.shape[-1] != 1:
        return ValueError(f"the Mosaic state kernel takes the scalar gate (decay [..., 1]), "
                          f"got decay {tuple(terms.decay.shape)}")
    if factored and layout.token_start is not None:
        return ValueError("the Mosaic state kernel reads row-factored terms' q, k as whole "
                          "chunks: a layout with a token table (packed sequences, or T not a "
                          "multiple of C) is not supported")
    if factored and with_output and terms.q_rows is None:
        return ValueError("row-factored terms for the output need q_rows as well as k_rows")
    if C != 64:
        return ValueError(f"the Mosaic state kernel takes chunks of 64 (the size measured), got "
                          f"C = {C}")
    for name, n, multiple in (("K", K, 64), ("V", V, 64),
                              ("block_cols", block_cols, 32)):
        if n % multiple:
            return ValueError(f"the Mosaic state kernel needs {name} a multiple of "
                              f"{multiple}, got {n}")
    if blocks.slots not in (1, 2):
        return ValueError(f"slots must be 1 or 2, got {blocks.slots}")
    if V % block_cols:
        return ValueError(f"block_cols {block_cols} must divide V = {V}")
    if with_output and jnp.dtype(out_dtype) not in OPERAND_DTYPES + (jnp.float32,):
        return TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    smem = _smem_bytes(C, K, blocks, terms.u.dtype.itemsize,
                       jnp.dtype(out_dtype).itemsize if with_output else None, factored)
    if smem > SMEM_BYTES:
        return ValueError(f"block_cols {block_cols} with {blocks.slots} slots at C = {C}, "
                          f"K = {K} needs {smem} bytes of shared memory, over {SMEM_BYTES}: "
                          f"take fewer columns or slots")
    operands = {"w": terms.w, "kd": terms.kd}
    if with_output:
        operands.update(qg=terms.qg, attn=terms.attn)
    dtypes = {name: x.dtype for name, x in operands.items()}
    if terms.w.dtype not in OPERAND_DTYPES or len(set(dtypes.values())) != 1:
        return TypeError(f"the Mosaic state kernel takes {', '.join(dtypes)} in one of "
                         f"bfloat16, float16 (its products' operands), got "
                         f"{', '.join(str(d) for d in dtypes.values())}")
    if factored:
        T = layout.chunk_starts.shape[0] * C
        tokens = {"kd": terms.kd} | ({"qg": terms.qg} if with_output else {})
        for name, x in tokens.items():
            if tuple(x.shape) != (B, T, HV, K):
                return ValueError(f"row-factored {name} must be the token tensor [B, T, HV, K] "
                                  f"= {(B, T, HV, K)}, got {tuple(x.shape)}")
    elif with_output and tuple(terms.qg.shape) != tuple(terms.w.shape):
        return ValueError(f"qg must be [NT, B, HV, C, K] = {tuple(terms.w.shape)}, got "
                          f"{tuple(terms.qg.shape)}")
    if with_output and tuple(terms.attn.shape) != (NT, B, HV, C, C):
        return ValueError(f"attn must be [NT, B, HV, C, C] = {(NT, B, HV, C, C)}, got "
                          f"{tuple(terms.attn.shape)}")
    return None


def _check(*args) -> None:
    error = _refusal(*args)
    if error is not None:
        raise error


def _first_fitting(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                   h0: jax.Array, with_output: bool, out_dtype) -> StateBlocks | None:
    """The first of ``CANDIDATE_BLOCKS`` the kernel takes, or None."""
    return next((b for b in CANDIDATE_BLOCKS
                 if _refusal(terms, layout, init, h0, b, with_output, out_dtype) is None), None)


def takes(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array, *,
          with_output: bool, out_dtype=None, blocks: StateBlocks | None = None) -> bool:
    """Whether the kernel runs on these terms and this layout (``state_output`` with_output,
    else ``state_fwd``) with blocks (None: the first of ``CANDIDATE_BLOCKS`` that fits);
    where it does not, the call raises the reason."""
    out_dtype = jnp.dtype(out_dtype or terms.w.dtype)
    if blocks is None:
        return _first_fitting(terms, layout, init, h0, with_output, out_dtype) is not None
    return _refusal(terms, layout, init, h0, blocks, with_output, out_dtype) is None


def _run(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array, *,
         with_output: bool, with_finals: bool, out_dtype, blocks: StateBlocks | None,
         interpret: bool):
    """The kernel (module docstring) with_output: o and, with_finals, the finals; otherwise h
    and v_new. Returns its outputs: (h, v_new, last) or (o, finals, last), finals [N, HV,
    K, V] with the rows of sequences that end on no chunk here unwritten."""
    NT, B, HV, C, K = terms.w.shape
    V = terms.u.shape[-1]
    # where no candidate fits, the first one's refusal names the reason
    blocks = (blocks or _first_fitting(terms, layout, init, h0, with_output, out_dtype)
              or CANDIDATE_BLOCKS[0])
    BV, slots = blocks.block_cols, blocks.slots
    _check(terms, layout, init, h0, blocks, with_output, out_dtype)
    operand = terms.w.dtype
    f32 = jnp.float32
    has_init = init is not None
    factored = terms.k_rows is not None
    N = layout.seq_ends_here.shape[0] if with_finals else 1
    acc_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # stores issued per chunk: h, v_new; or o
    stores = 1 if with_output else 2
    # copies into a ring slot: w, kd, u; qg and attn for the output; k_rows (and q_rows for
    # the output) of row-factored terms
    slot_copies = 3 + 2 * with_output + factored * (1 + with_output)

    def kernel(*refs):
        (w_g, u_g, kd_g, qg_g, attn_g, k_rows_g, q_rows_g, decay_g, starts_g, ends_g, seq_g,
         init_g, h0_g, out1_g, out2_g, last_g,
         w_s, kd_s, qg_s, attn_s, u_s, k_rows_s, q_rows_s, s_s, vn_s, vnk_s, o_s, last_s,
         arrived) = refs
        b, hv, j = lax.axis_index("b"), lax.axis_index("hv"), lax.axis_index("j")
        cols = pl.ds(j * BV, BV)

        def chunk_tile(ref, c):
            """Chunk c's [C, K] tile of q or k: chunk layout, or the token tensor's rows."""
            return ref.at[b, pl.ds(c * C, C), hv] if factored else ref.at[c, b, hv]

        def fetch(c, slot):
            """Chunk c's tiles into a ring slot; arrived[slot] counts them."""
            copy = lambda src, dst: plgpu.copy_gmem_to_smem(src, dst.at[slot],
                                                            arrived.at[slot])
            copy(w_g.at[c, b, hv], w_s)
            copy(chunk_tile(kd_g, c), kd_s)
            copy(u_g.at[c, b, hv, :, cols], u_s)
            if factored:
                copy(k_rows_g.at[c, b, hv], k_rows_s)
            if with_output:
                copy(chunk_tile(qg_g, c), qg_s)
                copy(attn_g.at[c, b, hv], attn_s)
                if factored:
                    copy(q_rows_g.at[c, b, hv], q_rows_s)

        def tile(ref):
            """A [rows, BV] float32 tile of global memory into registers (element by element:
            jax 0.11.2 has no vectorised global load in this layout). Times one: inside
            shard_map a load keeps its ref's varying axes while the kernel's arithmetic
            drops them, and the loop's carry must be of one type."""
            return plgpu.load(ref, layout=acc_layout, optimized=False) * 1.0

        def scale_rows(rows_s, slot, x):
            """diag(rows) x for a chunk's [C] row factors in shared memory."""
            rows = plgpu.load(rows_s.at[slot], layout=row_layout)
            return lax.broadcast_in_dim(rows, x.shape, [0]) * x

        def chunk_scalars(c):
            """Chunk c's (starts, ends, seq, decay), ends and seq where the form reads them
            (None elsewhere); past the last chunk, the last's."""
            c = jnp.minimum(c, NT - 1)
            load_if = lambda used, ref: plgpu.load(ref.at[c, b]) if used else None
            return (plgpu.load(starts_g.at[c, b]), load_if(with_finals, ends_g),
                    load_if(has_init or with_finals, seq_g), plgpu.load(decay_g.at[c, b, hv]))

        def entering(S, starts, seq):
            if has_init:
                fresh = lambda: tile(init_g.at[seq, hv, :, cols])
            else:
                fresh = lambda: plgpu.layout_cast(jnp.zeros((K, BV), f32), acc_layout)
            # a sequence start selects the fresh state: what came before never reaches it
            return lax.cond(starts != 0, fresh, lambda: S)

        def to_smem(tile_s, value, dst=None):
            """value in tile_s's dtype into tile_s, once the stores that read it a chunk
            ago are done (the chunk's other stores may still be in flight), and from there
            to the products and, by TMA, to dst."""
            if dst is not None:
                plgpu.wait_smem_to_gmem(stores - 1, wait_read_only=True)
            tile_s[...] = value.astype(tile_s.dtype)
            plgpu.commit_smem()
            if dst is not None:
                plgpu.copy_smem_to_gmem(tile_s, dst)

        def output_rows(c):
            """Where chunk c's o goes: chunk layout, or the token tensor's rows."""
            if factored:
                return out1_g.at[b, pl.ds(c * C, C), hv, cols]
            return out1_g.at[c, b, hv, :, cols]

        def fetch_next(c, slot):
            @pl.when(c + 1 < NT)
            def _():
                fetch(c + 1, slot)

        def chunk(c, carry):
            S, (starts, ends, seq, decay) = carry
            # chunk c + 1's scalars load while this chunk computes, off the state's chain
            following = chunk_scalars(c + 1)
            slot = lax.rem(c, slots)
            if slots == 2:
                fetch_next(c, 1 - slot)

            S = entering(S, starts, seq)
            to_smem(s_s, S, None if with_output else out1_g.at[c, b, hv, :, cols])
            plgpu.barrier_wait(arrived.at[slot])
            u = plgpu.load(u_s.at[slot], layout=acc_layout).astype(f32)
            vn = u - products([(w_s.at[slot], s_s)], (C, BV))
            to_smem(vn_s, vn, None if with_output else out2_g.at[c, b, hv, :, cols])
            if with_output:
                if factored:
                    o = (scale_rows(q_rows_s, slot, products([(qg_s.at[slot], s_s)], (C, BV)))
                         + products([(attn_s.at[slot], vn_s)], (C, BV)))
                else:
                    o = products([(qg_s.at[slot], s_s), (attn_s.at[slot], vn_s)], (C, BV))
                to_smem(o_s, o, output_rows(c))
            if factored:
                # kd^T vn = k^T (diag(k_rows) vn)
                to_smem(vnk_s, scale_rows(k_rows_s, slot, vn))
                update = products([(kd_s.at[slot].T, vnk_s)], (K, BV))
            else:
                update = products([(kd_s.at[slot].T, vn_s)], (K, BV))
            if slots == 1:
                # the chunk's products and loads have read the slot
                fetch_next(c, slot)
            S = decay * S + update
            if with_finals:
                @pl.when(ends != 0)
                def _():
                    store_tile(last_s, S, out2_g.at[seq, hv, :, cols])
            return S, following

        fetch(0, 0)
        last, _ = lax.fori_loop(0, NT, chunk,
                                (tile(h0_g.at[b, hv, :, cols]), chunk_scalars(0)))
        store_tile(last_s, last, last_g.at[b, hv, :, cols])
        plgpu.wait_smem_to_gmem(0)

    # inputs a form does not read are passed as one-element stand-ins
    stand_in = lambda x, used, ndim: x if used else jnp.zeros((1,) * ndim, f32)
    args, manual_axes = unify([
        terms.w, terms.u, terms.kd,
        stand_in(terms.qg, with_output, 5), stand_in(terms.attn, with_output, 5),
        stand_in(terms.k_rows, factored, 4), stand_in(terms.q_rows, factored and with_output, 4),
        terms.decay[..., 0].astype(f32), layout.chunk_starts.astype(jnp.int32),
        layout.chunk_ends.astype(jnp.int32), layout.chunk_seq.astype(jnp.int32),
        init.astype(f32) if has_init else jnp.zeros((1, 1, 1, 1), f32), h0.astype(f32)])
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                       manual_axis_type=manual_axes)
    if with_output:
        o_shape = (B, NT * C, HV, V) if factored else (NT, B, HV, C, V)
        out_type = (struct(o_shape, out_dtype), struct((N, HV, K, V), f32))
    else:
        out_type = (struct((NT, B, HV, K, V), operand), struct((NT, B, HV, C, V), operand))
    # tiles a form does not use get a stand-in of one swizzle tile (or 64 floats)
    swizzle = _swizzle(blocks, operand)
    smem = lambda shape, dtype=operand: operand_smem(shape, dtype, swizzle)
    tile_if = lambda used, shape, dtype=operand: smem(shape if used else shape[:-2] + (8, 64),
                                                      dtype)
    rows_if = lambda used: plgpu.SMEM((slots, C if used else 64), f32)
    # the kernel's name in profiles and in the compiled module: one per form
    kernel.__name__ = "mosaic_gdn_" + ("state_output" if with_output else "state_fwd")
    call = plgpu.kernel(
        kernel,
        out_type=out_type + (struct((B, HV, K, V), f32),),
        scratch_types=[smem((slots, C, K)), smem((slots, C, K)),
                       tile_if(with_output, (slots, C, K)), tile_if(with_output, (slots, C, C)),
                       plgpu.SMEM((slots, C, BV), terms.u.dtype),
                       rows_if(factored), rows_if(factored and with_output),
                       smem((K, BV)), smem((C, BV)),
                       tile_if(factored, (C, BV)),
                       tile_if(with_output, (C, BV), out_dtype or operand),
                       plgpu.SMEM((K, BV), f32),
                       plgpu.Barrier(num_arrivals=slot_copies, num_barriers=slots)],
        grid=(B, HV, V // BV), grid_names=("b", "hv", "j"),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    # some versions of plgpu.kernel type the outputs as varying over no manual axis of an
    # enclosing shard_map whatever the structs say; they vary over the inputs' axes
    return vary_like(call(*args), args[0])


def state_fwd(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array,
              *, blocks: StateBlocks | None = None, interpret: bool = False):
    """h [NT, B, HV, K, V] (the state entering each chunk) and v_new [NT, B, HV, C, V] in the
    operand dtype, and the state after the last chunk [B, HV, K, V] float32 (module
    docstring). interpret: run in Mosaic GPU's interpret mode (any device)."""
    return _run(terms, layout, init, h0, with_output=False, with_finals=False,
                out_dtype=None, blocks=blocks, interpret=interpret)


def state_output(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                 h0: jax.Array, with_finals: bool, *, out_dtype=None,
                 blocks: StateBlocks | None = None, interpret: bool = False):
    """(o [NT, B, HV, C, V] in out_dtype (the operand dtype if None); the final states
    [N, HV, K, V] float32 of the sequences that end here, zero for the others, or None
    without with_finals) (module docstring)."""
    o, finals, _ = _run(terms, layout, init, h0, with_output=True, with_finals=with_finals,
                        out_dtype=jnp.dtype(out_dtype or terms.w.dtype), blocks=blocks,
                        interpret=interpret)
    if not with_finals:
        return o, None
    # rows of sequences that end elsewhere are never written: a selection, not a product
    return o, jnp.where(layout.seq_ends_here[:, None, None, None], finals, 0.0)


def _reference_scan(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                    h0: jax.Array):
    """The recurrence in jnp with the kernel's operand roundings (the state, vn, and for
    row-factored terms k_rows vn, rounded to the operand dtype before their products,
    float32 accumulation). Returns the last state and, per chunk, (h, vn) in the operand
    dtype and the state after the chunk, float32."""
    operand = terms.w.dtype
    f32 = jnp.float32
    NT, C = terms.w.shape[0], terms.w.shape[-2]
    rounded = lambda x: x.astype(operand).astype(f32)
    factored = terms.k_rows is not None
    k = to_chunks(terms.kd, None, NT, C) if factored else terms.kd
    k_rows = terms.k_rows if factored else jnp.ones(terms.w.shape[:-1], f32)

    def step(S, xs):
        w, u, k, k_rows, decay, starts, seq = xs
        fresh = jnp.zeros_like(S) if init is None else init[seq].astype(f32)
        S = jnp.where(starts[:, None, None, None], fresh, S)
        vn = u.astype(f32) - jnp.einsum("bhck,bhkv->bhcv", w.astype(f32), rounded(S))
        after = decay.astype(f32)[..., None] * S + jnp.einsum(
            "bhck,bhcv->bhkv", k.astype(f32), rounded(k_rows[..., None] * vn))
        return after, (S.astype(operand), vn.astype(operand), after)

    return lax.scan(step, h0.astype(f32), (terms.w, terms.u, k, k_rows, terms.decay,
                                            layout.chunk_starts, layout.chunk_seq))


def state_fwd_reference(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                        h0: jax.Array):
    """``state_fwd``'s numbers in jnp: ``xla.state.state_fwd``'s recurrence with the state
    and vn rounded to the operand dtype before their products, as the kernel's wgmma operands
    are (float32 accumulation), and h and v_new returned in it, as the kernel's are."""
    last, (h, vn, _) = _reference_scan(terms, layout, init, h0)
    return h, vn, last


def state_output_reference(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None,
                           h0: jax.Array, with_finals: bool, *, out_dtype=None):
    """``state_output``'s numbers in jnp, with the kernel's roundings: o = qg h + attn vn
    (row-factored: diag(q_rows) q h + attn vn) from the operand-dtype h and vn (float32
    accumulation) in out_dtype, and the finals, the float32 state after each sequence's
    last chunk here."""
    f32 = jnp.float32
    NT, B, HV, C, K = terms.w.shape
    _, (h, vn, after) = _reference_scan(terms, layout, init, h0)
    factored = terms.q_rows is not None
    q = to_chunks(terms.qg, None, NT, C) if factored else terms.qg
    o = jnp.einsum("nbhck,nbhkv->nbhcv", q.astype(f32), h.astype(f32))
    if factored:
        o = terms.q_rows[..., None] * o
    o = o + jnp.einsum("nbhcd,nbhdv->nbhcv", terms.attn.astype(f32), vn.astype(f32))
    o = o.astype(out_dtype or terms.w.dtype)
    if factored:
        o = from_chunks(o, None, NT * C)
    if not with_finals:
        return o, None
    N = layout.seq_ends_here.shape[0]
    rows = jnp.where(layout.chunk_ends, layout.chunk_seq, N)      # N: dropped
    finals = jnp.zeros((N,) + after.shape[2:], f32).at[rows].set(after, mode="drop")
    return o, finals
