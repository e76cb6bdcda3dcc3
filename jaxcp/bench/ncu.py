"""Per-kernel GPU time and traffic from Nsight Compute's CSV (``ncu --csv --print-units base
--metrics`` with ``METRICS``), summed per kernel name, and a markdown table of several runs
side by side; and the table of per-kernel times alone, as torch's profiler records them
without ncu (scripts/profile_kernels.py)."""
from __future__ import annotations

import csv
from dataclasses import dataclass

TIME, READ, WRITTEN, REGISTERS = ("gpu__time_duration.sum", "dram__bytes_read.sum",
                                  "dram__bytes_write.sum", "launch__registers_per_thread")
METRICS = (TIME, READ, WRITTEN, REGISTERS)


@dataclass(frozen=True)
class KernelTime:
    """The launches of one kernel name: their count, summed time (ns) and DRAM bytes read and
    written, and the registers per thread (the most of any launch)."""
    name: str
    launches: int
    ns: float
    bytes_read: float
    bytes_written: float
    registers: int

    @property
    def tb_per_s(self) -> float:
        return (self.bytes_read + self.bytes_written) / max(self.ns, 1.0) / 1e3


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def kernel_times(csv_text: str) -> list[KernelTime]:
    """The kernels of one ncu CSV (one row per launch and metric; ncu's own messages, which
    do not start with a quote, skipped), summed per name in the order of first launch.
    Raises ValueError if a launch lacks one of ``METRICS`` or no launch is there."""
    rows = csv.DictReader(line for line in csv_text.splitlines() if line.startswith('"'))
    launches: dict[str, tuple[str, dict[str, str]]] = {}
    for row in rows:
        launches.setdefault(row["ID"], (row["Kernel Name"], {}))[1][row["Metric Name"]] = \
            row["Metric Value"]
    if not launches:
        raise ValueError("no kernel launch in the ncu CSV (was ncu run with --csv?)")
    sums: dict[str, list] = {}
    for launch_id, (name, metrics) in launches.items():
        missing = [m for m in METRICS if m not in metrics]
        if missing:
            raise ValueError(f"launch {launch_id} ({name}) has no {', '.join(missing)}: run "
                             f"ncu with --metrics {','.join(METRICS)}")
        acc = sums.setdefault(name, [0, 0.0, 0.0, 0.0, 0])
        acc[0] += 1
        for i, metric in enumerate((TIME, READ, WRITTEN), start=1):
            acc[i] += _number(metrics[metric])
        acc[4] = max(acc[4], int(_number(metrics[REGISTERS])))
    return [KernelTime(name, *acc) for name, acc in sums.items()]


def markdown(runs: dict[str, list[KernelTime]], width: int = 60) -> str:
    """One table per run (label -> kernels): ms, launches, DRAM GB read / written, achieved
    TB/s and registers per kernel name (cut to width characters), then the total time."""
    lines = []
    for label, kernels in runs.items():
        lines += [f"## {label}", "",
                  "| kernel | launches | ms | GB read | GB written | TB/s | registers |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| `{k.name[:width]}` | {k.launches} | {k.ns / 1e6:.3f} | "
                  f"{k.bytes_read / 1e9:.2f} | {k.bytes_written / 1e9:.2f} | "
                  f"{k.tb_per_s:.2f} | {k.registers} |" for k in kernels]
        total = sum(k.ns for k in kernels) / 1e6
        lines += ["", f"Total: {total:.3f} ms over {sum(k.launches for k in kernels)} "
                      f"launches.", ""]
    return "\n".join(lines)


def times_markdown(label: str, kernels: list[tuple[str, int, float]], width: int = 60) -> str:
    """One run's table from (kernel name, launches, summed ms) per name, in the given order:
    ms and launches per kernel (names cut to width characters), then the total time."""
    lines = [f"## {label}", "", "| kernel | launches | ms |", "|---|---|---|"]
    lines += [f"| `{name[:width]}` | {launches} | {ms:.3f} |" for name, launches, ms in kernels]
    total = sum(ms for _, _, ms in kernels)
    lines += ["", f"Total: {total:.3f} ms over {sum(n for _, n, _ in kernels)} launches.", ""]
    return "\n".join(lines)
