"""Registers and spill bytes per thread of the KDA chunk kernels for sm_90, without a GPU.

    pip install triton==3.6.0                        # the Triton of the GPU image, for its ptxas
    python -m benchmarks.profile.registers --K 128 --col-block 64 --warps 4 --stages 2

Each kernel is lowered for CUDA as jax hands it to XLA (the Pallas Triton module; the GPU
info that jax would read off a device is H100's), compiled by triton for sm_90 at the given
warps and pipeline stages, and its PTX assembled by triton's ptxas -v (its counts agreed
with `ncu`'s on the H100 where both were read). One configuration serves every kernel of a
run; the shipped ones are ``ChunkBlocks.default`` (3 stages) for the forward and
``ChunkBlocks.kda_grads`` (2 stages) for the cotangents. This reads private jax modules
(the Triton lowering and its GPU info), so it follows the jax version it was written for
(0.11.2 and 0.12).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile


def _parser():
    from jaxcp.cli import OneLineParser
    ap = OneLineParser(prog="python -m benchmarks.profile.registers",
                       description=__doc__.split("\n")[0])
    ap.add_argument("--K", type=int, default=128, help="K = V")
    ap.add_argument("--col-block", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--only", default="", help="only kernels whose name contains this")
    ap.add_argument("--gate-bound", type=float, default=None,
                    help="the sub-chunk kernels' gate bound, in [-5, 0) (safe_gate)")
    ap.add_argument("--normalize-qk", action="store_true",
                    help="the kernels read q, k L2-normalised (normalize_qk, row scales)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="of q, k, v, beta and do; it picks the cotangents' products "
                         "(Fp32Products.for_inputs)")
    return ap


def _modules(fn, args) -> list[str]:
    """The Triton modules (MLIR text) of the pallas_calls in jax.jit(fn) lowered for CUDA."""
    import jax
    import jax._src.pallas.triton.gpu_info as gpu_info
    import jax._src.pallas.triton.pallas_call_registration as registration

    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def capture(*a, **kw):
        result = lower(*a, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return modules


def _registers(module: str, warps: int, stages: int) -> tuple[str, int, int]:
    """(kernel name, registers per thread, spill store bytes) of one Triton module."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    name = re.search(r"tt.func public @(\w+)", module).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{name}.ttir")
        with open(src, "w") as f:
            f.write(module)
        ptx = triton_compile(src, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
        ptx_path = os.path.join(tmp, f"{name}.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "ptxas")
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o",
                                 os.devnull], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return name, regs, spills


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("K", "col_block", "warps", "stages"):
        if getattr(args, flag) < 1:
            _parser().error(f"--{flag.replace('_', '-')} must be positive")
    if args.K % args.col_block and args.col_block < args.K:
        _parser().error("--col-block must divide --K")
    from jaxcp.pallas.triton.common.unit_rows import operand_row_scales
    from jaxcp.pallas.triton.kda.gates import MIN_GATE_BOUND, check_gate_bound
    try:
        check_gate_bound(args.gate_bound)
    except ValueError:
        _parser().error(f"--gate-bound must be in [{MIN_GATE_BOUND:g}, 0)")
    try:
        import triton  # noqa: F401
    except ImportError:
        _parser().error("triton is not installed (pip install triton==3.6.0)")

    import jax
    import jax.numpy as jnp
    from jaxcp.layout import build_layout
    from jaxcp.pallas.triton.common.launch import ChunkBlocks
    from jaxcp.pallas.triton.common.products import Fp32Products, KernelPrecision
    from jaxcp.pallas.triton.kda import grads as kda_grads, intra as kda_intra
    from jaxcp.terms import ChunkTerms

    blocks = ChunkBlocks(col_block=args.col_block, num_warps=args.warps,
                         num_stages=args.stages)
    NT, B, H, C, K = 2, 1, 2, 64, args.K
    T = NT * C
    spec = lambda *s, dtype=jnp.float32: jax.ShapeDtypeStruct((NT, B, H) + s, dtype)
    tile, square, state = spec(C, K), spec(C, C), spec(K, K)
    token = jax.ShapeDtypeStruct((B, T, H, K), args.dtype)
    token_vec = jax.ShapeDtypeStruct((B, T, H), args.dtype)
    layout, _ = build_layout(B, T, C, None, 0, T)
    # the intra kernels' products for bf16 inputs; chunk_grads' as the stage table picks them
    fast = KernelPrecision(precise=False)
    precise = KernelPrecision(products=Fp32Products.for_inputs(args.dtype))
    scale = K ** -0.5
    rows = lambda q, k: operand_row_scales(q, k, args.normalize_qk)
    programs = {
        "forward gated sums": (lambda q, k, G, beta: kda_intra.gated_sums(
            q, k, G, beta, scale, layout, gate_bound=args.gate_bound, precision=fast,
            blocks=blocks, diagonal_blocks=blocks, **rows(q, k)),
            (token, token, tile, token_vec)),
        "forward terms": (lambda q, k, v, G, beta, a: kda_intra.wy_terms(
            q, k, v, G, beta, scale, layout, a=a, precision=fast, blocks=blocks,
            with_inverse=True, **rows(q, k)), (token, token, token, tile, token_vec, square)),
        "cotangents": (lambda q, k, v, G, beta, w, u, inv, h, v_new, x, dvn, do:
                       kda_grads.chunk_grads(
                           q, k, v, G, beta, scale, layout,
                           ChunkTerms(w, u, None, None, None, None, inv), h, v_new, x, dvn, do,
                           gate_bound=args.gate_bound, precision=precise,
                           normalize_qk=args.normalize_qk, blocks=blocks),
                       (token,) * 3 + (tile, token_vec, tile, tile, square, state, tile, state,
                                       tile, token)),
    }
    print(f"K = V = {K}, {args.dtype} inputs, col_block {args.col_block}, {args.warps} warps, "
          f"{args.stages} stages, sm_90")
    print("| kernel | registers | spill stores (bytes) |\n|---|---|---|")
    for fn, shapes in programs.values():
        for module in _modules(fn, shapes):
            name, regs, spills = _registers(module, args.warps, args.stages)
            if args.only in name:
                print(f"| {name} | {regs} | {spills} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
