"""The context-parallel benchmark (scripts/bench_cp.py records) as markdown tables."""
from __future__ import annotations


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(records: list[dict]) -> str:
    """Every record with its rate and overhead against the run without CP, then the target's
    two ratios per layout and pass."""
    W = max(r["W"] for r in records)
    first = records[0]
    none = {(r["impl"], r["nseq"], r["pass"]): r["ms"] for r in records if r["strategy"] == "none"}
    lines = ["# Context-parallel GDN benchmark", "",
             f"Device: {W} x {first['device']}; T = {first['T']}, H = {first['H']}, "
             f"K = V = {first['K']}, bf16, B = 1, median ms per call.", "",
             "rate = (t_none / W) / t (1.0 is a perfect split); overhead = t - t_none / W: what "
             "CP adds to this device's share of the work (summary, collectives, merge).", "",
             "| impl | strategy | sequences | pass | ms | rate | overhead ms |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        t_none = none.get((r["impl"], r["nseq"], r["pass"]))
        cp = r["strategy"] != "none" and t_none
        rate = f"{t_none / W / r['ms']:.0%}" if cp else "-"
        overhead = f"{r['ms'] - t_none / W:.2f}" if cp else "-"
        lines.append(f"| {r['impl']} | {r['strategy']} | {r['nseq']} | {r['pass']} | "
                     f"{r['ms']:.2f} | {rate} | {overhead} |")
    lines += ["", "Target: allgather faster than FLA's KCP, and >= 1.3x faster than all_to_all.",
              "", "| sequences | pass | allgather ms | FLA KCP ms | allgather / KCP (< 1: met) "
              "| all_to_all / allgather (>= 1.3: met) |", "|---|---|---|---|---|---|"]
    ms = {(r["strategy"], r["nseq"], r["pass"]): r["ms"] for r in records}
    for nseq, passes in sorted({(r["nseq"], r["pass"]) for r in records}):
        ag = ms.get(("allgather", nseq, passes))
        kcp, a2a = ms.get(("fla-kcp", nseq, passes)), ms.get(("all_to_all", nseq, passes))
        lines.append(f"| {nseq} | {passes} | {_ms(ag)} | {_ms(kcp)} | {_ratio(ag, kcp)} | "
                     f"{_ratio(a2a, ag)} |")
    return "\n".join(lines) + "\n"
