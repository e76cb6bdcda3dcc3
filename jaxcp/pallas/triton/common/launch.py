"""Launch configurations of the Pallas kernels, as data (static arguments of the kernels).

Three families of kernels, three configurations:

- ``StateBlocks``: the chunk state recurrences (``common.state``), one program per (batch,
  value head, block of state columns) looping over the chunks. Its per-chunk tiles are
  software-pipelined: as many stages as fit in a shared-memory budget.
- ``ChunkBlocks``: the per-chunk kernels (``gdn.intra``, ``gdn.grads``, ``kda.intra``,
  ``kda.grads``), one program per (chunk, batch, value head) or, for KDA's gated sums, per
  sub-chunk of 16 rows, walking K and V in blocks of columns so that no [C, K] or [C, V]
  tile stays live across the kernel.
- ``RowBlocks``: the row-wise kernels (``common.l2norm``), one program per block of rows.

``default(K)`` gives what the kernels ship with (GDN's state recurrences:
``StateBlocks.gdn``; KDA's cotangent kernels: ``ChunkBlocks.kda_grads``,
``grads_across_sub_chunks`` and ``grads_sub_chunk``; its forward gated sums:
``ChunkBlocks.across_sub_chunks`` and ``sub_chunk``; its inverse and tiles:
``ChunkBlocks.wy_terms``; its state recurrences: ``StateBlocks.kda``). The measurements
behind them: docs/benchmarks/kernels.md and kernels_kda.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from jax.experimental.pallas import triton as pltriton

from jaxcp.pallas.triton.common.chunk_rows import chunk_grid_axis


def _compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    if interpret:
        return {"interpret": True}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}


# programs that fill a GPU of 132 SMs (H100, H200) about once
FULL_GRID = 128

# the state recurrences of the op on one device (``common.state``'s kernel names), apart
# from those of the CP summary and its cotangents
_OP_RECURRENCES = ("state_output", "state_fwd", "state_bwd")


@dataclass(frozen=True)
class StateBlocks:
    """block_cols: state columns per program (BV); num_warps; max_stages: the most pipeline
    stages; tile_budget: the bytes of per-chunk tiles the stages may hold in shared memory
    together (H100 and H200: 227 KiB per block, the rest for the products' operands)."""
    block_cols: int = 64
    num_warps: int = 4
    max_stages: int = 3
    tile_budget: int = 192 * 1024

    @classmethod
    def default(cls, K: int) -> "StateBlocks":
        """64 state columns per program, 32 at K = 256 (to stay inside shared memory)."""
        return cls(block_cols=32 if K >= 256 else 64)

    @classmethod
    def gdn(cls, kernel: str, K: int, V: int, heads: int) -> "StateBlocks":
        """GDN's state recurrences: the default, but state_output at K = 256 takes 16
        columns where 32 give at most FULL_GRID programs (heads: B HV, the programs per
        block of columns), so that two programs per SM hide the chunk loop's latency
        (state_bwd is slower at 16). The measurements: docs/benchmarks/kernels.md."""
        blocks = cls.default(K)
        if kernel == "state_output" and K > 128 and heads * (V // blocks.cols(V)) <= FULL_GRID:
            return cls(block_cols=16)
        return blocks

    @classmethod
    def kda(cls, kernel: str, K: int, V: int, heads: int) -> "StateBlocks":
        """KDA's state recurrences (float32 state, TF32 or scaled float16 products for bf16
        inputs, float16 w, qg, kd, attn): per kernel (``common.state``'s kernel names), K,
        V and heads (B HV, the programs per block of state columns). 32 state columns per
        program, but state_bwd at K <= 128 takes 64 with 8 warps where that still gives
        FULL_GRID programs, state_fwd at K = 256 takes 16 (more programs), and the op's
        three recurrences take 16 where 32 give fewer than FULL_GRID programs (few heads).
        The measurements: docs/benchmarks/kernels_kda.md, "Launch configurations
        measured"."""
        if kernel == "state_bwd" and K <= 128 and heads * (V // 64) >= FULL_GRID:
            return cls(block_cols=64, num_warps=8)
        if kernel == "state_fwd" and K > 128:
            return cls(block_cols=16)
        blocks = cls(block_cols=32)
        if kernel in _OP_RECURRENCES and heads * (V // blocks.cols(V)) < FULL_GRID:
            return cls(block_cols=16)
        return blocks

    @classmethod
    def recurrent(cls, K: int, V: int, rows: int) -> "StateBlocks":
        """The decoding step's (rows: B HV): the default's columns, halved down to 16 until
        the programs fill the GPU once (few sequences)."""
        cols = min(V, cls.default(K).block_cols)
        while cols > 16 and rows * (V // cols) < FULL_GRID:
            cols //= 2
        return cls(block_cols=cols)

    def cols(self, n: int) -> int:
        """Columns per program for a state of n columns."""
        return min(n, self.block_cols)

    def params(self, interpret: bool, tile_bytes: int) -> dict:
        """pallas_call keyword arguments: as many stages as the budget holds tiles of one
        chunk (tile_bytes), between 1 and max_stages."""
        stages = max(1, min(self.max_stages, self.tile_budget // max(tile_bytes, 1)))
        return _compiler_params(interpret, self.num_warps, stages)


@dataclass(frozen=True)
class ChunkBlocks:
    """col_block: K and V columns per step of the kernels' loops; num_warps; num_stages;
    sub_chunks_first: KDA's sub-chunk kernels put the sub-chunk first in their grid, so that
    the programs of one chunk launch next to each other (``kda.sub_chunks.sub_chunk_axis``);
    heads_first: the per-chunk kernels launch the heads of a chunk side by side, the chunk
    last in their grid (``chunk_rows.chunk_grid``), so that programs running together read
    neighbouring rows of the token tensors (measured: kernels_kda.md)."""
    col_block: int = 64
    num_warps: int = 4
    num_stages: int = 3
    sub_chunks_first: bool = False
    heads_first: bool = True

    @classmethod
    def default(cls, K: int) -> "ChunkBlocks":
        """Blocks of 64 columns (at K = 256 whole tiles would not fit in registers)."""
        return cls()

    @classmethod
    def gdn(cls, K: int) -> "ChunkBlocks":
        """GDN's per-chunk kernels (``gdn.intra``, ``gdn.grads``): ``default``, but the chunk
        first in the grid up to K = 128, where the heads first made the op's
        forward+backward slower (measured: kernels.md)."""
        return cls(heads_first=K > 128)

    @classmethod
    def kda_grads(cls) -> "ChunkBlocks":
        """KDA's per-chunk cotangent kernels (``kda_grads_inter``, ``kda_grads_wy``): two
        pipeline stages (three would need 240 KiB of shared memory in ``kda_grads_inter``,
        over the 227 KiB of a block; measured: kernels_kda.md)."""
        return cls(num_stages=2)

    @classmethod
    def grads_sub_chunk(cls, K: int) -> "ChunkBlocks":
        """KDA's backward gated sums in the diagonal blocks (``kda_grads_diagonal_sums``),
        the sub-chunks first in its grid: one warp over 32 columns a step for its [16, 32]
        tiles up to K = 128, 4 warps over 64 columns above (measured: kernels_kda.md)."""
        if K > 128:
            return cls(num_stages=2, sub_chunks_first=True)
        return cls(col_block=32, num_warps=1, num_stages=2, sub_chunks_first=True)

    @classmethod
    def wy_terms(cls, K: int) -> "ChunkBlocks":
        """KDA's inverse and state tiles (``kda_wy_terms``): ``default``, but 8 warps and
        two pipeline stages at K = 256, where they are faster (measured: kernels_kda.md)."""
        if K >= 256:
            return cls(num_warps=8, num_stages=2)
        return cls.default(K)

    @classmethod
    def across_sub_chunks(cls) -> "ChunkBlocks":
        """KDA's forward gated sums across sub-chunks (``kda_gated_sums``): one warp for
        its [16, 16] blocks over 16 columns a step (measured: kernels_kda.md)."""
        return cls(col_block=16, num_warps=1, num_stages=2)

    @classmethod
    def grads_across_sub_chunks(cls) -> "ChunkBlocks":
        """KDA's backward gated sums across sub-chunks (``kda_grads_gated_sums``; measured:
        kernels_kda.md)."""
        return cls(col_block=64, num_warps=4, num_stages=2)

    @classmethod
    def sub_chunk(cls) -> "ChunkBlocks":
        """KDA's forward gated sums in the diagonal blocks (``kda_diagonal_sums``): one
        pipeline stage (measured: kernels_kda.md)."""
        return cls(num_stages=1)

    @property
    def chunk_axis(self) -> int:
        """The grid axis of the chunk in a per-chunk kernel's grid (``chunk_rows.chunk_grid``)."""
        return chunk_grid_axis(self.heads_first)

    def cols(self, d: int) -> int:
        """Columns per loop step over a width of d."""
        return min(d, self.col_block)

    def params(self, interpret: bool) -> dict:
        return _compiler_params(interpret, self.num_warps, self.num_stages)


@dataclass(frozen=True)
class RowBlocks:
    """Row-wise kernels over an [N, d] matrix (``common.l2norm``): block_rows rows per
    program, num_warps. Each program reads its rows once, so one pipeline stage."""
    block_rows: int = 32
    num_warps: int = 4

    def params(self, interpret: bool) -> dict:
        return _compiler_params(interpret, self.num_warps, 1)
