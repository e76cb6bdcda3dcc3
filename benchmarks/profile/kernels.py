"""Per-kernel GPU time of one forward+backward, jaxcp's or FLA's, under Nsight Compute.

    M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread
    ncu --profile-from-start off --clock-control none --csv --print-units base --metrics $M \\
        python -m benchmarks.profile.kernels run --impl jaxcp --op kda --T 8192 --H 64 --D 128 > jaxcp.csv
    ncu ... python -m benchmarks.profile.kernels run --impl fla --op kda --T 8192 --H 64 --D 128 > fla.csv
    python -m benchmarks.profile.kernels table jaxcp=jaxcp.csv fla=fla.csv

`run` makes the inputs of ``benchmarks.bench.kernels`` (B = 1, bf16, q/k normalised inside the
op), calls the forward+backward twice (compilation, FLA's autotuning), then once more
between cuProfilerStart and cuProfilerStop, so that ncu (--profile-from-start off) profiles
that call's kernels alone. jaxcp runs ``backend="pallas"``; FLA (its ``chunk_kda`` or
``chunk_gated_delta_rule``, fused norm) must be importable. `table` sums each CSV per kernel
name (``kernel_times``: ncu's CSV from ``--csv --print-units base --metrics`` with ``METRICS``)
and prints one markdown table per LABEL=CSV (``markdown``).

Where ncu cannot profile a run (jaxcp's under ncu crashed on the H200 machines), `run
--timeline` takes the third call's kernels from torch's profiler instead (CUPTI's activity
records, which hold every kernel of the process, JAX's included; torch must be importable):
no ncu, the kernels run as in the benchmark, and it prints the per-kernel time table itself
(``times_markdown``):

    python -m benchmarks.profile.kernels run --timeline --impl jaxcp --op kda --T 32768 --H 64 --D 128

`--segments S` runs jaxcp's op with each sequence as S segments (``jaxcp.cp.segments``;
default: the op's own choice), to see what the split's kernels cost.

FLA autotunes its kernels on their first calls, which under ncu ran past 150 s at T = 8192,
H = 64: run `run --impl fla` (or the benchmark) once without ncu first, on the same machine.
FLA keeps its autotuning results in triton's disk cache (its FLA_CACHE_RESULTS default), and
the run under ncu reads them.
"""
from __future__ import annotations

import csv
import ctypes
import sys
from dataclasses import dataclass
from functools import partial

from jaxcp.cli import OneLineParser

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


def _parser():
    ap = OneLineParser(prog="python -m benchmarks.profile.kernels",
                       description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one profiled forward+backward (under ncu)")
    run.add_argument("--impl", choices=("jaxcp", "fla"), required=True)
    run.add_argument("--op", choices=("gdn", "kda"), default="kda")
    for flag, default in (("--T", 8192), ("--H", 64), ("--D", 128)):
        run.add_argument(flag, type=int, default=default)
    run.add_argument("--timeline", action="store_true",
                     help="record the kernels with torch's profiler, not under ncu")
    run.add_argument("--segments", type=int, default=None,
                     help="jaxcp: run the sequence as this many segments (default: the op's "
                          "choice; jaxcp.cp.segments)")
    table = sub.add_parser("table", help="per-kernel tables from ncu CSVs")
    table.add_argument("runs", nargs="+", metavar="LABEL=CSV")
    return ap


def _profiled(call) -> None:
    """call() (which waits for its GPU work) twice, then once between cuProfilerStart and
    cuProfilerStop, with device 0's primary context (the one JAX and torch use) current."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(name, *args):
        status = getattr(cuda, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} returned CUDA error {status}")

    call()
    call()
    context = ctypes.c_void_p()
    check("cuInit", 0)
    check("cuDevicePrimaryCtxRetain", ctypes.byref(context), 0)
    check("cuCtxPushCurrent_v2", context)
    check("cuProfilerStart")
    call()
    check("cuProfilerStop")
    check("cuCtxPopCurrent_v2", ctypes.byref(context))


def _timeline(call, label: str) -> None:
    """call() twice, then once under torch's profiler (CUDA activities): print its kernels'
    times (``times_markdown``)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    call()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
    kernels = [(e.key, e.count, e.self_device_time_total / 1e3) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    print(times_markdown(label, kernels))


def _run_jaxcp(op: str, T: int, H: int, D: int, profiled, segments: int | None) -> None:
    import jax
    from benchmarks.bench.kernels import jaxcp_inputs, jaxcp_op
    from benchmarks.timing import forward_backward

    q, k, v, g, beta, do = jaxcp_inputs(op, T, H, D)
    op_fn = jaxcp_op(op)
    call = lambda *xs: op_fn(*xs, use_qk_l2norm_in_kernel=True, backend="pallas",
                             segments=segments)[0]
    step = jax.jit(forward_backward(call, range(5), do))
    profiled(lambda: jax.block_until_ready(step(q, k, v, g, beta)))


def _run_fla(op: str, T: int, H: int, D: int, profiled) -> None:
    import torch
    from benchmarks import fla

    fla_op = fla.op(op)
    q, k, v, g, beta = fla.inputs(op, T, H, D)
    do = torch.randn_like(v)

    def call():
        fla_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].backward(do)
        torch.cuda.synchronize()

    profiled(call)


def _table(ap, runs: list[str]) -> None:
    tables = {}
    for run in runs:
        label, sep, path = run.partition("=")
        if not sep or not label or not path:
            ap.error(f"runs: expected LABEL=CSV, got {run!r}")
        try:
            with open(path) as f:
                tables[label] = kernel_times(f.read())
        except (OSError, ValueError) as e:
            ap.error(f"runs: {path}: {e}")
    print(markdown(tables))


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "table":
        _table(ap, args.runs)
        return 0
    for flag in ("T", "H", "D"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be positive")
    if args.segments is not None and (args.impl != "jaxcp" or args.segments < 1):
        ap.error("--segments must be positive and is for --impl jaxcp")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        ap.error("run needs an NVIDIA GPU (libcuda.so.1 not found)")
    label = f"{args.impl} {args.op} T={args.T} H={args.H} D={args.D}"
    if args.segments is not None:
        label += f" segments={args.segments}"
    profiled = partial(_timeline, label=label) if args.timeline else _profiled
    if args.impl == "jaxcp":
        _run_jaxcp(args.op, args.T, args.H, args.D, profiled, args.segments)
    else:
        _run_fla(args.op, args.T, args.H, args.D, profiled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
