"""FLA (flash-linear-attention, PyTorch + Triton) beside jaxcp in the benchmarks: its op, its
inputs and the allocator's peak over a call. torch and fla are imported only when called."""
from __future__ import annotations


def op(name: str):
    """FLA's ``chunk_kda`` (name "kda") or ``chunk_gated_delta_rule`` ("gdn"), with FLA's
    guard against the gated backward on this triton (3.6, its issue #640) lifted: timing and
    memory only."""
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True
    if name == "kda":
        from fla.ops.kda import chunk_kda
        return chunk_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def inputs(name: str, T: int, H: int, D: int):
    """q, k, v [1, T, H, D] bf16 (normal), g fp32 (log-sigmoid of normal; [1, T, H, D] for
    KDA, [1, T, H] for GDN), beta [1, T, H] bf16 (uniform), on the GPU, all requiring
    gradients; seed 0."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    q, k, v = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, H, D)
    gate_shape = (1, T, H, D) if name == "kda" else (1, T, H)
    g = F.logsigmoid(torch.randn(*gate_shape, device="cuda")).requires_grad_(True)
    beta = torch.rand(1, T, H, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    return q, k, v, g, beta


def peak_bytes(call) -> int:
    """The torch allocator's peak over one call, what is live before it included."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def version() -> str:
    import fla
    return getattr(fla, "__version__", "?")
