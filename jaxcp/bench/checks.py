"""The kernel checks (scripts/check_kernels.py --json records) as a markdown table.

A record: op, layout, keys, dtype, backend, T, D, H, repeat (runs of the op that had to agree
bit for bit), errors (relative error per name of NAMES against the float32 reference; NaN
for all when the runs disagreed), device, jax."""
from __future__ import annotations

NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def limits(dtype: str) -> tuple[float, float]:
    """The limits for o and for everything else: bf16 5e-3 and 1e-2, float32 1e-4."""
    return (5e-3, 1e-2) if dtype == "bfloat16" else (1e-4, 1e-4)


def within_limits(errors: dict, dtype: str) -> bool:
    """Whether every error of a case is below its limit (NaN is not)."""
    lim_o, lim = limits(dtype)
    return errors["o"] < lim_o and all(errors[n] < lim for n in NAMES[1:])


def _sci(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def markdown(records: list[dict]) -> str:
    """Setting and limits, then one row per case: its errors and "ok" or "over"."""
    devices = sorted({r["device"] for r in records})
    versions = sorted({r["jax"] for r in records})
    backends = sorted({r["backend"] for r in records})
    lines = ["# GPU checks of the kernels", "",
             f"Device: {', '.join(devices)}; jax {', '.join(versions)}; backend "
             f"{', '.join(backends)}.", "",
             "Relative errors ||x - ref|| / ||ref|| of o, the final states and every gradient "
             "against the float32 token recurrence (`scripts/check_kernels.py`): random inputs, "
             "q and k L2-normalised, initial states, random cotangents of o and the final states. "
             "Layouts: varlen (B = 1, packed sequences with a 1-token one), batch (B = 2, no "
             "cu_seqlens). Keys: random, or correlated (one direction per head plus 10 % noise, "
             "10x weaker decay). runs: how many runs of the op had to agree bit for bit.", "",
             "Limits: bf16 o < {}, the rest < {}; float32 everything < {}.".format(
                 *map(_sci, limits("bfloat16") + limits("float32")[:1])), "",
             "| device | op | layout | keys | dtype | T | D | H | runs | " + " | ".join(NAMES)
             + " | result |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(NAMES) + "---|"]
    for r in records:
        errs = " | ".join(f"{r['errors'][n]:.1e}" for n in NAMES)
        result = "ok" if within_limits(r["errors"], r["dtype"]) else "over"
        lines.append(f"| {r['device']} | {r['op']} | {r['layout']} | {r['keys']} | {r['dtype']} | {r['T']} | "
                     f"{r['D']} | {r['H']} | {r['repeat']} | {errs} | {result} |")
    return "\n".join(lines) + "\n"
