"""Charts of the kernel, CP and memory benchmark records (PNG; needs matplotlib, the bench
extra)."""
from __future__ import annotations

from benchmarks.bench import cp, kernels, memory

PASSES = ("fwd", "fwd+bwd")


def _panels(figsize, rows: int = 1):
    """A figure of `rows` rows of one log-scale panel per pass, on the Agg backend; axes
    [rows, pass]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, len(PASSES), figsize=figsize, squeeze=False)
    for ax in axes.flat:
        ax.set_ylabel("ms (lower is better)")
        ax.set_yscale("log")
    return fig, axes


def kernels_png(records: list[dict], path: str) -> None:
    """Per pass, a group of bars per shape, one bar per implementation."""
    device = kernels.device_of(records)
    keys, names = kernels.shapes(records), kernels.impls_of(records)
    ms = {(r["impl"], r["T"], r["H"], r["K"], r["pass"]): r["ms"] for r in records}
    fig, axes = _panels((11, 4))
    for ax, passes in zip(axes[0], PASSES):
        width = 0.8 / len(names)
        for n, impl in enumerate(names):
            vals = [ms.get((impl, T, H, D, passes), 0.0) for T, H, D in keys]
            ax.bar([x + n * width for x in range(len(keys))], vals, width, label=impl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
        ax.set_xticklabels([f"T={T}\nH={H} D={D}" for T, H, D in keys])
        ax.set_title(f"{kernels.op_of(records).upper()} {passes}, {device}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cp_png(records: list[dict], path: str) -> None:
    """One row of panels per op, one panel per pass, one bar per record (implementation,
    strategy, CP layout where not contiguous, sequences)."""
    W = max(r["W"] for r in records)
    ops = cp.ops_of(records)
    fig, axes = _panels((12, 5 * len(ops)), len(ops))
    for op, row in zip(ops, axes):
        for ax, passes in zip(row, PASSES):
            bars = [r for r in records if r["op"] == op and r["pass"] == passes]
            ax.bar(range(len(bars)), [r["ms"] for r in bars])
            ax.set_xticks(range(len(bars)))
            ax.set_xticklabels([_cp_label(r) for r in bars], fontsize=7, rotation=90)
            ax.set_title(f"{op.upper()} {passes}, W = {W}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cp_label(record: dict) -> str:
    """A CP record's bar label: implementation, strategy, layout (when zigzag), sequences."""
    layout = cp.layout_of(record)
    return "\n".join([record["impl"].replace("jaxcp-", ""), record["strategy"],
                      *([layout] if layout != "contiguous" else []), f"{record['nseq']} seq"])


def memory_png(records: list[dict], path: str) -> None:
    """Peak memory against T_local, one line per remat choice, and the device's memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, remats, lengths, at = memory.train_rows(records)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in remats:
        pts = [(T, at[T, m]["peak_gib"]) for T in lengths if (T, m) in at and at[T, m]["fits"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"remat {m}")
    if runs and runs[0].get("device_gib"):
        ax.axhline(runs[0]["device_gib"], color="gray", linestyle="--", label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T_local (tokens per GPU)")
    ax.set_ylabel("peak GiB")
    if runs:
        ax.set_title(f"{runs[0]['layers']}, hidden {runs[0]['hidden']}, {runs[0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
