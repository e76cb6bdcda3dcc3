"""GDN's intra-chunk terms (scalar gate) as one Mosaic GPU kernel: the twin of the Triton
kernel ``jaxcp.pallas.triton.gdn.intra.intra_chunk``, with its outputs (the row-factored
``ChunkTerms``) and its roundings.

One program per (chunk c, batch row b, value head hv), one warpgroup, 86 KiB of shared
memory at K = V = 128 (two programs to an SM, as its 229 registers per thread allow). The
chunk's rows of q, k [C, K] and v [C, V] arrive by TMA from the token tensors, with G, the
chunk's cumsum of the log-decay, and beta [C]. Where the layout has a token table (packed
sequences, or T not a multiple of C) a chunk starts at any row, and a TMA copy into a tiled
operand tile needs its first row a multiple of the 8-row tile: there q, k and v come
through staging tiles of at most ``tiles.STAGING_WIDTH`` columns, wider rows in pieces of
that width (one [C, 128] tile for q's and k's pieces, shared with v where K = V = 128: 16
KiB more; v's pieces in their own otherwise) and registers into their tiles
(``tiles.unstage``: zero past the chunk's tokens, so nothing of the next sequence, a NaN
included, reaches the chunk), v's copy running while the chunk computes; the row scales r
below are zero there too. With E_ij = exp(G_i - G_j) and
r(x)_i = (x_i . x_i + eps)^(-1/2) (the L2 row scales; 1 without normalize_qk):

    KK = k k^T,  QK = q k^T                              (bf16 wgmma, float32)
    A    = strict_lower(beta_i r(k)_i r(k)_j KK_ij E_ij)
    attn = lower(scale r(q)_i r(k)_j QK_ij E_ij)
    T    = (I + A)^-1                                    (merging diagonal blocks, below)
    w    = (T' diag(beta exp(G) r(k))) k,   u = (T' diag(beta)) v,   T' = T rounded to bf16
    q_rows = scale exp(G) r(q),   k_rows = exp(G_C - G) r(k)

r(k) is read off the diagonal of KK (as a row and as a column vector), r(q) from q's rows.
The inverse merges diagonal blocks of size s = 1, 2, ..., C/2: T_2s = T_s - T_s N_s T_s,
N_s the part of A inside the 2s-blocks and outside the s-blocks (``products.
unit_lower_inverse``). With T_s block-diagonal, T_s N_s T_s is T_s A T_s on those entries,
so the kernel keeps A in shared memory once and masks the product instead of A: two
products a round, T_s A and (T_s A) T_s, on float16 operands (the 10-bit mantissa of the
Triton kernel's TF32 products; in range because unit rows keep |A| <= max(beta) and the
blocks of T bounded, and the entries of T_s A outside the 2s-blocks meet zeros of T_s).
w and u are two bf16 products each, of the hi and lo bf16 parts of the float32 factor (the
Triton kernel's ``dots.split``). The left operands of these products (T_s, T_s A, the
parts) are taken from registers; in interpret mode, which takes operands in shared memory
only, through tiles of their own. w and u leave through k's and v's tiles. G and beta come
from ``chunk_gates`` (XLA), decay = exp(G_C) is left to the caller. exp and rsqrt are the
approximate instructions (``approx_math``, as Triton's exp): a few float32 ulps, far below
the bf16 outputs' rounding.

Shapes: q, k [B, T, HV, K], v [B, T, HV, V] bf16; G, beta [NT, B, HV, C] float32. Out: w
[NT, B, HV, C, K], u [NT, B, HV, C, V], attn (and inv) [NT, B, HV, C, C] bf16; q_rows,
k_rows [NT, B, HV, C] float32; with a token table its token_start, token_count [NT, B]
int32. C = 64, T at least C; K, V multiples of 64 up to 256 (128 with a token table).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxcp.l2norm import L2NORM_EPS
from jaxcp.layout import ChunkLayout, chunks_by_table, to_chunks
from jaxcp.pallas.mosaic.common.tiles import (STAGING_WIDTH, operand_smem, products,
                                               staging_smem, unstage)
from jaxcp.terms import ChunkTerms
from jaxcp.vma import unify, vary_like

CHUNK = 64                      # C: one wgmma row block
MAX_WIDTH = 256                 # K, V: a wgmma's widest N
# Shared memory for the sums over rows (the column vectors): 8 KiB takes all eight register
# columns of a [64, 64] float32 tile in one exchange between the warps (2 KiB: four)
REDUCTION_SCRATCH_BYTES = 8192


def refusal(q, k, v, layout: ChunkLayout, chunk_size: int, normalize_qk: bool,
            unit_qk: bool) -> Exception | None:
    """The error for what the kernel does not take, or None."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    if chunk_size != CHUNK:
        return ValueError(f"the Mosaic intra kernel takes chunk_size {CHUNK}, got "
                          f"{chunk_size}")
    if not (normalize_qk or unit_qk):
        return ValueError("the Mosaic intra kernel inverts on float16 operands, in range "
                          "for unit q, k rows only: normalise q, k (use_qk_l2norm)")
    if tuple(q.shape) != (B, T, HV, K):
        return ValueError(f"q must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(q.shape)}")
    if tuple(v.shape[:3]) != (B, T, HV):
        return ValueError(f"v must be [B, T, HV, V] with (B, T, HV) = {(B, T, HV)}, got "
                          f"{tuple(v.shape)}")
    for name, n in (("K", K), ("V", V)):
        if n % 64 or n > MAX_WIDTH:
            return ValueError(f"the Mosaic intra kernel needs {name} a multiple of 64 up to "
                              f"{MAX_WIDTH}, got {n}")
    if T < CHUNK:
        return ValueError(f"the Mosaic intra kernel reads chunks of {CHUNK} rows: T must be "
                          f"at least {CHUNK}, got {T}")
    if layout.token_start is None and T != layout.chunk_starts.shape[0] * CHUNK:
        return ValueError(f"T = {T} is not the layout's {layout.chunk_starts.shape[0]} "
                          f"chunks of {CHUNK} rows")
    dtypes = {x.dtype for x in (q, k, v)}
    if dtypes != {jnp.dtype(jnp.bfloat16)}:
        return TypeError(f"the Mosaic intra kernel takes bfloat16 q, k, v, got "
                         f"{', '.join(str(x.dtype) for x in (q, k, v))}")
    return None


def takes(q, k, v, layout: ChunkLayout, chunk_size: int, *, normalize_qk: bool,
          unit_qk: bool) -> bool:
    """Whether the kernel runs on these inputs; where it does not, ``intra_chunk`` raises
    the reason."""
    return refusal(q, k, v, layout, chunk_size, normalize_qk, unit_qk) is None


def chunk_gates(g: jax.Array, beta: jax.Array, layout: ChunkLayout
                ) -> tuple[jax.Array, jax.Array]:
    """G (each chunk's cumsum of the log-decay g) and beta, token-major [B, T, HV] (g may
    have a trailing 1), as the kernel reads them: [NT, B, HV, C] float32, zero past each
    chunk's tokens (g = beta = 0 there: G stays at the last token's)."""
    NT = layout.chunk_starts.shape[0]
    as_f32 = lambda x: x.reshape(beta.shape).astype(jnp.float32)
    if layout.token_start is None:
        chunks = lambda x: to_chunks(x, None, NT, CHUNK)
    else:
        chunks = lambda x: chunks_by_table(x, layout, CHUNK)
    return jnp.cumsum(chunks(as_f32(g)), axis=-1), chunks(as_f32(beta))


def intra_chunk(q, k, v, g, beta, scale: float, layout: ChunkLayout, chunk_size: int, *,
                normalize_qk: bool, unit_qk: bool = False, with_inverse: bool = False,
                interpret: bool = False) -> ChunkTerms:
    """The Triton ``gdn.intra.intra_chunk``'s terms (module docstring) from token-major q, k,
    v [B, T, HV, ...] bf16 and g, beta [B, T, HV] (g may be [B, T, HV, 1]). normalize_qk:
    the terms of q, k's L2-normalised rows; unit_qk: q, k already have unit rows. interpret:
    Mosaic GPU's interpret mode (any device). chunk_size: 64, the only one it takes."""
    error = refusal(q, k, v, layout, chunk_size, normalize_qk, unit_qk)
    if error is not None:
        raise error
    B, T, HV, K = k.shape
    V = v.shape[-1]
    C, NT = CHUNK, layout.chunk_starts.shape[0]
    f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
    G, beta_c = chunk_gates(g, beta, layout)
    table = layout.token_start is not None
    k_width, v_width = min(K, STAGING_WIDTH), min(V, STAGING_WIDTH)
    k_pieces, v_pieces = K // k_width, V // v_width
    shared_staging = K == V and k_pieces == 1

    def columns(piece, width):
        return pl.ds(piece * width, width)

    def columns_of(tile, piece, width, pieces):
        """The piece-th block of width columns of an operand tile (the tile if one)."""
        return tile if pieces == 1 else tile.at[:, columns(piece, width)]

    def v_barrier(piece):
        return 2 * k_pieces + piece
    acc_layout = plgpu.Layout.WGMMA
    row_layout = acc_layout.reduce(1)

    def kernel(q_g, k_g, v_g, G_g, beta_g, *refs):
        start_g, count_g = refs[:2] if table else (None, None)
        w_g, u_g, attn_g, q_rows_g, k_rows_g, *rest = refs[2 * table:]
        inv_g = rest[0] if with_inverse else None
        (q_s, k_s, v_s, G_s, beta_s, q_rows_s, k_rows_s, t_s, a_s, cc_s, arrived,
         *rest) = rest[with_inverse:]
        staged = staging_k = staging_v = None
        if table:
            staged, staging_k, *rest = rest
            staging_v = staging_k if shared_staging else rest.pop(0)

        def v_staging_piece(piece):
            return staging_v if shared_staging else staging_v.at[piece]
        a_tiles = rest
        c, b, hv = lax.axis_index("c"), lax.axis_index("b"), lax.axis_index("hv")
        if not table:
            rows = pl.ds(c * C, C)
            for src, dst in ((q_g.at[b, rows, hv], q_s), (k_g.at[b, rows, hv], k_s),
                             (v_g.at[b, rows, hv], v_s), (G_g.at[c, b, hv], G_s),
                             (beta_g.at[c, b, hv], beta_s)):
                plgpu.copy_gmem_to_smem(src, dst, arrived)
        else:
            rows = pl.ds(plgpu.load(start_g.at[c, b]), C)
            count = plgpu.load(count_g.at[c, b])
            for src, dst in ((G_g.at[c, b, hv], G_s), (beta_g.at[c, b, hv], beta_s)):
                plgpu.copy_gmem_to_smem(src, dst, arrived)
            for n, (src, dst) in enumerate(((q_g, q_s), (k_g, k_s))):
                for piece in range(k_pieces):
                    barrier = staged.at[n * k_pieces + piece]
                    plgpu.copy_gmem_to_smem(src.at[b, rows, hv, columns(piece, k_width)],
                                            staging_k, barrier)
                    plgpu.barrier_wait(barrier)
                    unstage(staging_k, columns_of(dst, piece, k_width, k_pieces), count)
                    plgpu.commit_smem()
            for piece in range(v_pieces):
                plgpu.copy_gmem_to_smem(v_g.at[b, rows, hv, columns(piece, v_width)],
                                        v_staging_piece(piece), staged.at[v_barrier(piece)])
        plgpu.barrier_wait(arrived)

        iota = lambda axis: plgpu.layout_cast(
            lax.broadcasted_iota(jnp.int32, (C, C), axis), acc_layout)
        i, j = iota(0), iota(1)
        as_rows = lambda x: lax.broadcast_in_dim(x, (C, C), [0])     # x_i
        as_cols = lambda x: lax.broadcast_in_dim(x, (C, C), [1])     # x_j
        diagonal = lambda x: jnp.where(i == j, x, 0.0)

        def to_cols(x):
            """A row vector (the accumulator's row layout) in the column layout: Mosaic
            GPU loads no vector in the latter, but sums over rows give it."""
            return jnp.sum(diagonal(as_rows(x)), axis=0)

        def left_operand(value, n: int):
            """value as a product's left operand: from registers on the GPU; in interpret
            mode (which takes operands in shared memory only) through a_tiles[n]."""
            if not a_tiles:
                return value
            a_tiles[n][...] = value
            plgpu.commit_smem()
            return a_tiles[n]

        def store(value, tile_s, dst):
            """value into tile_s (in its dtype) and from there to dst, by TMA."""
            tile_s[...] = value.astype(tile_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile_s, dst)

        G_row = plgpu.load(G_s, layout=row_layout)
        G_col = to_cols(G_row)
        G_last = G_s[C - 1]

        kk = products([(k_s, k_s.T)], (C, C))
        qk = products([(q_s, k_s.T)], (C, C))
        if normalize_qk:
            diag = diagonal(kk)
            rk_row = lax.rsqrt(jnp.sum(diag, axis=1) + L2NORM_EPS)
            rk_col = lax.rsqrt(jnp.sum(diag, axis=0) + L2NORM_EPS)
            q32 = plgpu.load(q_s, layout=acc_layout).astype(f32)
            rq_row = lax.rsqrt(jnp.sum(q32 * q32, axis=1) + L2NORM_EPS)
        else:
            rk_row = rq_row = jnp.ones_like(G_row)
            rk_col = jnp.ones_like(G_col)
        if table:
            # the row factors past the chunk's tokens (q, k's rows there are zero already)
            tokens = jnp.where((i == j) & (i < count), 1.0, 0.0)
            rk_row, rq_row = (x * jnp.sum(tokens, axis=1) for x in (rk_row, rq_row))
            rk_col = rk_col * jnp.sum(tokens, axis=0)
        if normalize_qk:
            kk = kk * as_rows(rk_row) * as_cols(rk_col)
            qk = qk * as_rows(rq_row) * as_cols(rk_col)
        # E_ij for j <= i, zero above the diagonal
        decays = jnp.exp(jnp.where(i >= j, as_rows(G_row) - as_cols(G_col), -jnp.inf))

        store(qk * decays * scale, cc_s, attn_g.at[c, b, hv])
        store(jnp.exp(G_row) * (scale * rq_row), q_rows_s, q_rows_g.at[c, b, hv])
        store(jnp.exp(G_last - G_row) * rk_row, k_rows_s, k_rows_g.at[c, b, hv])

        beta_row = plgpu.load(beta_s, layout=row_layout)
        a = jnp.where(i > j, kk * decays, 0.0) * as_rows(beta_row)
        block = i ^ j
        inv = jnp.where(i == j, 1.0, 0.0) - jnp.where(block < 2, a, 0.0)
        # T_2s = T_s - (T_s A T_s) on the 2s-blocks outside the s-blocks: A in shared memory
        # once, T_s and T_s A from registers, T_s through shared memory
        a_s[...] = a.astype(f16)
        s = 2
        while s < C:
            t = inv.astype(f16)
            t_s[...] = t
            plgpu.commit_smem()
            ta = products([(left_operand(t, 0), a_s)], (C, C)).astype(f16)
            tat = products([(left_operand(ta, 1), t_s)], (C, C))
            inv = inv - jnp.where((block >= s) & (block < 2 * s), tat, 0.0)
            s *= 2
        inv = inv.astype(bf16).astype(f32)
        if with_inverse:
            # attn's store has read cc_s
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            store(inv, cc_s, inv_g.at[c, b, hv])

        beta_col = to_cols(beta_row)

        def times_split(factor, x_s, dst):
            """factor @ x as the products of factor's hi and lo bf16 parts, through x_s
            (the products are done before it is written) to dst."""
            hi = factor.astype(bf16)
            lo = (factor - hi.astype(f32)).astype(bf16)
            pairs = [(left_operand(hi, 2), x_s), (left_operand(lo, 3), x_s)]
            store(products(pairs, (C, x_s.shape[-1])), x_s, dst)

        # w leaves through k's tile, u through v's: their products are the last to read them
        times_split(inv * as_cols(beta_col * jnp.exp(G_col) * rk_col), k_s, w_g.at[c, b, hv])
        if table:
            for piece in range(v_pieces):
                plgpu.barrier_wait(staged.at[v_barrier(piece)])
                unstage(v_staging_piece(piece), columns_of(v_s, piece, v_width, v_pieces), count)
            plgpu.commit_smem()
        times_split(inv * as_cols(beta_col), v_s, u_g.at[c, b, hv])
        plgpu.wait_smem_to_gmem(0)

    table_args = [layout.token_start.astype(jnp.int32),
                  layout.token_count.astype(jnp.int32)] if table else []
    args, manual_axes = unify([q, k, v, G, beta_c] + table_args)
    struct = lambda shape, dtype: jax.ShapeDtypeStruct((NT, B, HV) + shape, dtype,
                                                       manual_axis_type=manual_axes)
    out_type = [struct((C, K), bf16), struct((C, V), bf16), struct((C, C), bf16),
                struct((C,), f32), struct((C,), f32)]
    if with_inverse:
        out_type.append(struct((C, C), bf16))
    vector = plgpu.SMEM((C,), f32)
    # by a token table: a barrier for each copy (q, k, v, in pieces of STAGING_WIDTH
    # columns) and their staging tiles: one for q's and k's pieces in turn, and v's pieces
    # (all copied at once) in that one where K = V fit one piece, else in their own
    table_scratch = ([plgpu.Barrier(num_arrivals=1, num_barriers=2 * k_pieces + v_pieces),
                      staging_smem((C, k_width), bf16)]
                     + ([] if shared_staging else [staging_smem((v_pieces, C, v_width), bf16)])
                     if table else [])
    kernel.__name__ = "mosaic_gdn_intra_chunk" + ("_table" if table else "")
    call = plgpu.kernel(
        kernel, out_type=tuple(out_type),
        scratch_types=[operand_smem((C, K), bf16), operand_smem((C, K), bf16),
                       operand_smem((C, V), bf16), vector, vector, vector, vector,
                       operand_smem((C, C), f16), operand_smem((C, C), f16),
                       operand_smem((C, C), bf16),
                       plgpu.Barrier(num_arrivals=2 if table else 5)] + table_scratch
                      + ([operand_smem((C, C), dtype) for dtype in (f16, f16, bf16, bf16)]
                         if interpret else []),
        grid=(NT, B, HV), grid_names=("c", "b", "hv"),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    outs = vary_like(call(*args), args[0])
    w, u, attn, q_rows, k_rows = outs[:5]
    return ChunkTerms(w=w, u=u, qg=q, kd=k, decay=jnp.exp(G[..., -1:]), attn=attn,
                      inv=outs[5] if with_inverse else None, q_rows=q_rows, k_rows=k_rows)
