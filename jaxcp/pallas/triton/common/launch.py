"""Launch configurations of the Pallas kernels, as data (static arguments of the kernels).

Two families of kernels, two configurations:

- ``StateBlocks``: the chunk state recurrences (``common.state``), one program per (batch,
  value head, block of state columns) looping over the chunks. Its per-chunk tiles are
  software-pipelined: as many stages as fit in a shared-memory budget.
- ``ChunkBlocks``: the per-chunk kernels (``gdn.intra``, ``gdn.grads``, ``kda.intra``,
  ``kda.grads``), one program per (chunk, batch, value head) or, for KDA's gated sums, per
  sub-chunk of 16 rows, walking K and V in blocks of columns so that no [C, K] or [C, V]
  tile stays live across the kernel.

``default(K, dtype, device)`` gives what the kernels ship with (KDA's cotangent kernels:
``ChunkBlocks.kda_grads``; its forward gated sums: ``ChunkBlocks.sub_chunk``; its
inverse and tiles: ``ChunkBlocks.wy_terms``; its state recurrences:
``StateBlocks.kda``). GDN's numbers were measured on the H100 and the H200
(docs/benchmarks/kernels.md), where they are the same; KDA's latest on the H200
(kernels_kda.md); ``device`` (``jax.Device.device_kind``) is where a per-device choice
goes.
"""
from __future__ import annotations

from dataclasses import dataclass

from jax.experimental.pallas import triton as pltriton


def _compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    if interpret:
        return {"interpret": True}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)}


# programs that fill a GPU of 132 SMs (H100, H200) about once
FULL_GRID = 128


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
    def default(cls, K: int, dtype=None, device: str | None = None) -> "StateBlocks":
        """64 state columns per program, 32 at K = 256 (to stay inside shared memory)."""
        return cls(block_cols=32 if K >= 256 else 64)

    @classmethod
    def kda(cls, kernel: str, K: int, V: int, heads: int) -> "StateBlocks":
        """KDA's state recurrences (float32 state, TF32 products for bf16 inputs, float16
        w, qg, kd, attn): per kernel (``common.state``'s kernel names), K, V and heads (B HV,
        the programs per block of state columns). 32 state columns per program, but:

        - state_bwd at K <= 128 where 64 columns still give FULL_GRID programs: 64 columns
          with 8 warps. H200, T = 32768, H = 64, K = 128 (128 programs), one device call:
          4.21 ms against 5.12 with 32 columns (16 to 64 columns, 2 to 8 warps, another
          call: 4.47 to 10.3). With 8 heads (16 programs; the training model of
          docs/benchmarks/train.md) the step took 192.2 ms with state_bwd and state_fwd at
          64 columns against 176.8 with 32 (32 programs), in two device calls.
        - state_fwd at K = 256: 16 columns. H200, T = 32768, H = 16 (256 programs against
          128): 3.60 ms against 5.30, one device call.

        state_output stays at 32 (K = 128: 4.19 ms against 4.44 to 8.09 with 16 or 64
        columns or 8 warps; K = 256: 6.03 against 6.89 to 9.4), state_fwd at K <= 128 too
        (64 columns: 2.65 against 2.65, and 2.63 against 3.07 in another call), and so do
        the CP kernels (state_last, cp_transition, state_entry_cotangent), not measured
        apart. Earlier, on the H100 with 3xBF16 products, 32 columns against 64: state_bwd
        11.3 -> 8.1 ms, state_fwd 4.7 -> 4.3, state_output 6.8 -> 6.7."""
        if kernel == "state_bwd" and K <= 128 and heads * (V // 64) >= FULL_GRID:
            return cls(block_cols=64, num_warps=8)
        if kernel == "state_fwd" and K > 128:
            return cls(block_cols=16)
        return cls(block_cols=32)

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
    the programs of one chunk launch next to each other (``kda.sub_chunks.sub_chunk_axis``)."""
    col_block: int = 64
    num_warps: int = 4
    num_stages: int = 3
    sub_chunks_first: bool = False

    @classmethod
    def default(cls, K: int, dtype=None, device: str | None = None) -> "ChunkBlocks":
        """Blocks of 64 columns (at K = 256 whole tiles would not fit in registers)."""
        return cls()

    @classmethod
    def kda_grads(cls) -> "ChunkBlocks":
        """KDA's three cotangent kernels: two pipeline stages, the sub-chunks first in the
        sub-chunk kernel's grid. The loop over value blocks of ``kda_grads_inter`` loads
        three [C, 64] and two [64, 64] float32 tiles per step; three stages would need 240
        KiB of shared memory, over the 227 KiB a block gets on the H100 and the H200. The
        other two kernels were measured with it (the sub-chunk kernel: 44.8 ms for the
        three at T = 32768, H = 64, K = 128 against 49.1 with one stage). The launch order
        (H100, same shape): 45.1 -> 42.6 ms with 3xTF32 products, 40.2 -> 37.6 with
        3xBF16 ones."""
        return cls(num_stages=2, sub_chunks_first=True)

    @classmethod
    def wy_terms(cls, K: int) -> "ChunkBlocks":
        """KDA's inverse and state tiles (``kda_wy_terms``): ``default``, but 8 warps and
        two pipeline stages at K = 256. Measured on the H200 at T = 32768, H = 16, K = 256
        (the intra-chunk terms, gated sums included), two device calls: 4.32 and 4.08 ms
        against 5.12 and 4.82 with 4 warps and 3 stages; 3.93 to 5.13 with 32 columns or
        1 stage. At K = 128, H = 64, 8 warps were slower (the kernel alone: 6.28 to 6.50 ms
        against 4.02, with one stage or float16 products)."""
        if K >= 256:
            return cls(num_warps=8, num_stages=2)
        return cls.default(K)

    @classmethod
    def across_sub_chunks(cls) -> "ChunkBlocks":
        """KDA's forward gated sums across sub-chunks (``kda_gated_sums``): one warp for
        its [16, 16] blocks. Measured on the H200 at T = 32768, H = 64, K = 128 (with the
        diagonal kernel): 5.9 ms, against 6.4 to 12.6 with 2 or 4 warps, 16 or 64 columns,
        or 1 or 3 stages, and 60 to 107 ms with whole 128-column tiles."""
        return cls(col_block=32, num_warps=1, num_stages=2)

    @classmethod
    def grads_across_sub_chunks(cls) -> "ChunkBlocks":
        """KDA's backward gated sums across sub-chunks (``kda_grads_gated_sums``). Measured
        on the H200 at T = 32768, H = 64, K = 128 (the three cotangent kernels): 27.4 ms,
        against 28.4 to 30.7 with 32 or 128 columns, 2 or 8 warps, or one stage."""
        return cls(col_block=64, num_warps=4, num_stages=2)

    @classmethod
    def sub_chunk(cls) -> "ChunkBlocks":
        """KDA's forward gated sums in the diagonal blocks (``kda_diagonal_sums``): one
        pipeline stage. Measured on the H200 at T = 32768, H = 64, K = 128 (with the kernel
        across sub-chunks): 5.9 ms, against 6.1 to 7.6 with 2 or 8 warps, 32 or 128
        columns, two stages, or the sub-chunks first in the grid."""
        return cls(num_stages=1)

    def cols(self, d: int) -> int:
        """Columns per loop step over a width of d."""
        return min(d, self.col_block)

    def params(self, interpret: bool) -> dict:
        return _compiler_params(interpret, self.num_warps, self.num_stages)
