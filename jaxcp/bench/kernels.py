"""The kernel benchmark of one op, GDN or KDA (scripts/bench_kernels.py records), as a
markdown table."""
from __future__ import annotations

CHUNK = 64
# measured on the lent machines: memory bytes/s, dense bf16 FLOP/s
PEAKS = {"H100": (3.0e12, 790e12), "H200": (4.3e12, 790e12)}
IMPLS = ("jaxcp-pallas", "jaxcp-xla", "fla")


def floor_ms(op: str, T: int, H: int, D: int, passes: str, device: str) -> float:
    """Physical floor of the op on this shape: max(bytes / bandwidth, FLOPs / tensor peak).

    fwd bytes: q, k, v read, o written (bf16), beta and g (fp32; g one value per token and
    head for GDN, D for KDA). fwd FLOPs per (chunk, head), both ops:
    2 [C^2 (3K + 2V) + 3 C K V] (kk^T, w, u, qk^T; w S, k^T v; q S, attn v). fwd+bwd: about
    3x the FLOPs (recompute + 2x for the gradients) and 2.5x the bytes (inputs, do, five
    gradients)."""
    bw, peak = next((v for k, v in PEAKS.items() if k in device), PEAKS["H100"])
    C = CHUNK
    n_chunk_heads = T // C * H
    flops = 2 * (C * C * (3 * D + 2 * D) + 3 * C * D * D) * n_chunk_heads
    gate_bytes = 4 * (D if op == "kda" else 1)
    bytes_ = (4 * D * 2 + 4 + gate_bytes) * T * H
    if passes == "fwd+bwd":
        flops, bytes_ = 3 * flops, 2.5 * bytes_
    return 1e3 * max(bytes_ / bw, flops / peak)


def jaxcp_op(name: str):
    """jaxcp's ``chunk_kda`` (name "kda") or ``chunk_gated_delta_rule`` ("gdn")."""
    import jaxcp
    return jaxcp.chunk_kda if name == "kda" else jaxcp.chunk_gated_delta_rule


def jaxcp_inputs(op: str, T: int, H: int, D: int):
    """q, k, v [1, T, H, D] bf16 (normal), g float32 (log-sigmoid of normal; [1, T, H, D] for
    KDA, [1, T, H] for GDN), beta [1, T, H] bf16 (sigmoid of normal) and an output cotangent
    do [1, T, H, D] bf16; seed 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D)
    gate_shape = (1, T, H, D) if op == "kda" else (1, T, H)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal(gate_shape), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H))
    return q, k, v, g, beta, r(1, T, H, D)


# KDA's gate computed in the op (bench_kernels.py --gate-in-kernel), on both sides: the
# raw gate is the benchmark's g, A_log and dt_bias are zeros
GATE_IN_KERNEL = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)


def gate_in_kernel_text(records: list[dict]) -> str:
    """How the records' gate was computed, for the page's setting line."""
    if not any(r.get("gate_in_kernel") for r in records):
        return ""
    return (" KDA's gate computed in the op from the raw g (use_gate_in_kernel, safe_gate, "
            "lower_bound = -5, A_log = dt_bias = 0).")


def op_of(records: list[dict]) -> str:
    """The one op ("gdn" or "kda") that the records time."""
    ops = {r["op"] for r in records}
    if len(ops) != 1:
        raise ValueError(f"records: one op per benchmark file, got {sorted(ops)}")
    return ops.pop()


def shapes(records: list[dict]) -> list[tuple[int, int, int]]:
    """The (T, H, K) of the records, by T, then the most heads first."""
    return sorted({(r["T"], r["H"], r["K"]) for r in records}, key=lambda c: (c[0], -c[1]))


def impls(records: list[dict]) -> list[str]:
    """The implementations the records hold, in IMPLS order."""
    return [i for i in IMPLS if any(r["impl"] == i for r in records)]


def markdown(records: list[dict]) -> str:
    """Title, setting, one row per shape and pass (ms per implementation, pallas / FLA and
    the floor), and how the floor is counted."""
    device = next((r["device"] for r in records if r["impl"] != "fla"), records[0]["device"])
    jax = next((r["jax"] for r in records if r.get("jax")), "?")
    fla = next((r["fla"] for r in records if r.get("fla")), "not run")
    names = impls(records)
    op = op_of(records)
    ms = {(r["impl"], r["T"], r["H"], r["K"], r["pass"]): r["ms"] for r in records}
    peak = {(r["impl"], r["T"], r["H"], r["K"], r["pass"]): r.get("peak_bytes")
            for r in records}
    with_peaks = any(v is not None for v in peak.values())
    lines = [f"# {op.upper()} kernel benchmark", "",
             f"Device: {device}; jax {jax}; FLA {fla}. B = 1, bf16, q/k L2-normalised, "
             "median ms per call" + (", and peak GiB per call (jaxcp: the compiled call's "
                                     "arguments, outputs and temporaries; FLA: the allocator's "
                                     "peak over one call)" if with_peaks else "") + "."
             + gate_in_kernel_text(records), "",
             "| T | H | K=V | pass | " + " | ".join(names) + " | pallas / FLA | floor |"
             + (" peak GiB " + " / ".join(names) + " |" if with_peaks else ""),
             "|---|---|---|---|" + "---|" * len(names) + "---|---|"
             + ("---|" if with_peaks else "")]
    for T, H, D in shapes(records):
        for passes in ("fwd", "fwd+bwd"):
            vals = [ms.get((i, T, H, D, passes)) for i in names]
            p, f = ms.get(("jaxcp-pallas", T, H, D, passes)), ms.get(("fla", T, H, D, passes))
            ratio = f"{p / f:.2f}x" if p and f else "-"
            row = (f"| {T} | {H} | {D} | {passes} | "
                   + " | ".join("-" if v is None else f"{v:.2f}" for v in vals)
                   + f" | {ratio} | {floor_ms(op, T, H, D, passes, device):.2f} |")
            if with_peaks:
                gib = [peak.get((i, T, H, D, passes)) for i in names]
                row += " " + " / ".join("-" if b is None else f"{b / 2**30:.2f}"
                                        for b in gib) + " |"
            lines.append(row)
    lines += ["", "Floor: max(bytes / bandwidth, FLOPs / bf16 tensor peak) with the measured "
              "3.0 TB/s (H100) or 4.3 TB/s (H200) and 790 TFLOP/s (`jaxcp.bench.kernels."
              "floor_ms`)."]
    return "\n".join(lines) + "\n"
