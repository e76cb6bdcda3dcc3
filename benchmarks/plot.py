"""Charts of the kernel, CP and memory benchmark records (PNG; needs matplotlib, the bench
extra)."""
from __future__ import annotations

from benchmarks.bench import kernels, memory

PASSES = ("fwd", "fwd+bwd")


def _panels(figsize):
    """A figure of one log-scale panel per pass, on the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PASSES), figsize=figsize)
    for ax in axes:
        ax.set_ylabel("ms (lower is better)")
        ax.set_yscale("log")
    return fig, axes


def kernels_png(records: list[dict], path: str) -> None:
    """Per pass, a group of bars per shape, one bar per implementation."""
    device = next((r["device"] for r in records if r["impl"] != "fla"), records[0]["device"])
    keys, names = kernels.shapes(records), kernels.impls_of(records)
    ms = {(r["impl"], r["T"], r["H"], r["K"], r["pass"]): r["ms"] for r in records}
    fig, axes = _panels((11, 4))
    for ax, passes in zip(axes, PASSES):
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
    """Per pass, one bar per record (implementation, strategy, layout)."""
    W = max(r["W"] for r in records)
    fig, axes = _panels((12, 5))
    for ax, passes in zip(axes, PASSES):
        rows = [r for r in records if r["pass"] == passes]
        labels = [f"{r['impl'].replace('jaxcp-', '')}\n{r['strategy']}\n{r['nseq']} seq"
                  for r in rows]
        ax.bar(range(len(rows)), [r["ms"] for r in rows])
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7, rotation=90)
        ax.set_title(f"GDN {passes}, W = {W}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
