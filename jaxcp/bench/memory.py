"""Memory records (scripts/bench_memory.py) as tables (the plot: ``plot.memory_png``).

Two kinds of record, told apart by "kind":

- "train": one scripts/train.py run of a model at T_local tokens on one GPU with a remat
  choice: fits (the steps ran), peak_gib (peak bytes in use), step_ms, tokens_per_s, or the
  error's last line.
- "op": one forward+backward call of an op (GDN or KDA; jaxcp or FLA) at (T, H, K = V): its
  peak bytes (inputs, output cotangent, o, gradients and temporaries), and bytes per token
  and head.
"""
from __future__ import annotations

GIB = 2 ** 30


def train_rows(records):
    """The train records, their remat choices and T_local values (in order), and the records
    by (T_local, remat)."""
    runs = [r for r in records if r["kind"] == "train"]
    remats = sorted({r["remat"] for r in runs}, key=("none", "block", "mixer").index)
    lengths = sorted({r["T_local"] for r in runs})
    at = {(r["T_local"], r["remat"]): r for r in runs}
    return runs, remats, lengths, at


def _train_cell(r) -> str:
    if r is None:
        return "-"
    if not r["fits"]:
        error = r.get("error", "")
        return ("out of memory" if "RESOURCE_EXHAUSTED" in error or "Out of memory" in error
                else f"failed: {error}")
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
    return f"{peak}, {r['step_ms'] / 1e3:.2f} s"


def markdown(records: list[dict]) -> str:
    lines = ["# Memory", ""]
    runs, remats, lengths, at = train_rows(records)
    if runs:
        first = runs[0]
        lines += [f"## A training step on one GPU ({first['device']})", "",
                  f"`{first['layers']}`, hidden {first['hidden']}, {first['heads']} heads of "
                  f"{first['head_dim']}, bf16, batch 1, jax {first['jax']}. Each cell: peak "
                  "memory in use, step time.", "",
                  "| T_local | " + " | ".join(f"remat {m}" for m in remats) + " |",
                  "|---|" + "---|" * len(remats)]
        lines += [f"| {T:,} | " + " | ".join(_train_cell(at.get((T, m))) for m in remats)
                  + " |" for T in lengths]
        lines.append("")
    ops = [r for r in records if r["kind"] == "op"]
    if ops:
        device = next((r["device"] for r in ops if "device" in r), "?")
        lines += [f"## One op, forward+backward ({device})", "",
                  "Peak bytes of one call: inputs (q, k, v bf16, g fp32, beta), the output "
                  "cotangent, o, the gradients and the temporaries.", "",
                  "| op | impl | T | H | K = V | peak GiB | KB per token and head |",
                  "|---|---|---|---|---|---|---|"]
        for r in ops:
            if "error" in r:
                lines.append(f"| {r['op'].upper()} | {r['impl']} | {r['T']:,} | {r['H']} | "
                             f"{r['K']} | failed: {r['error']} | |")
                continue
            per = r["peak_bytes"] / (r["T"] * r["H"]) / 1e3
            lines.append(f"| {r['op'].upper()} | {r['impl']} | {r['T']:,} | {r['H']} | "
                         f"{r['K']} | {r['peak_bytes'] / GIB:.2f} | {per:.2f} |")
        lines.append("")
    return "\n".join(lines)
