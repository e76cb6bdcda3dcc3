"""Peak GPU memory of a training step and of the ops alone: how long a sequence fits.

    python -m benchmarks.bench.memory --json docs/benchmarks/memory.json    # on a GPU machine
    python -m benchmarks.bench.memory --T 32768 65536 --remat none block --ops none --json m.json
    python -m benchmarks.pages docs/benchmarks/memory.json                 # memory.md, .png

Train: scripts/train.py with the MODEL below (bf16, batch 1, mesh data=1,seq=1) for --steps
steps at each T_local and remat choice, one process per run, shortest first; a run that fails
(out of memory) is recorded as not fitting, with the last line of its error, and its remat
choice is not tried at longer T_local. XLA may use up to 95 % of the
GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION), allocated as needed.

Ops: one forward+backward call of GDN and KDA (q, k normalised in the op), jaxcp and FLA, each
in its own process: jaxcp's peak is the compiled call's memory (arguments + outputs + XLA's
temporaries - aliased bytes), FLA's the torch allocator's peak over the call, the inputs
included. Both calls keep o and return the gradients of q, k, v, g, beta.

Records are written after every measurement, two kinds told apart by "kind":

- "train": one scripts/train.py run of a model at T_local tokens on one GPU with a remat
  choice: fits (the steps ran), peak_gib (peak bytes in use), step_ms, tokens_per_s, or the
  error's last line.
- "op": one forward+backward call of an op (GDN or KDA; jaxcp or FLA) at (T, H, K = V): its
  peak bytes (inputs, output cotangent, o, gradients and temporaries), and bytes per token
  and head.

``markdown`` is their tables, the page docs/benchmarks/memory.md (``benchmarks.pages``; the
plot: ``plot.memory_png``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxcp.cli import OneLineParser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ("--layers", "gdn,gdn,gdn,attn", "--hidden", "2048", "--heads", "16",
         "--head-dim", "128")
OP_SHAPES = [(32768, 64, 128), (131072, 16, 128)]      # (T, H, K = V)
GIB = 2 ** 30


def op_jaxcp(op: str, T: int, H: int, D: int) -> dict:
    import jax
    import jax.numpy as jnp
    import jaxcp
    from benchmarks.timing import compiled_peak_bytes, forward_backward

    keys = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *s: jax.random.normal(next(keys), s, jnp.bfloat16)
    gate_shape = (1, T, H, D) if op == "kda" else (1, T, H)
    xs = (normal(1, T, H, D), normal(1, T, H, D), normal(1, T, H, D),
          jax.nn.log_sigmoid(jax.random.normal(next(keys), gate_shape, jnp.float32)),
          jax.nn.sigmoid(normal(1, T, H)), normal(1, T, H, D))
    jaxcp_op = jaxcp.chunk_kda if op == "kda" else jaxcp.chunk_gated_delta_rule
    call = lambda *a: jaxcp_op(*a, use_qk_l2norm_in_kernel=True)[0]
    # the output cotangent do is an argument, so that the call's peak counts it as FLA's does
    step = lambda *a: forward_backward(call, range(5), a[5])(*a[:5])
    compiled = jax.jit(step).lower(*xs).compile()
    jax.block_until_ready(compiled(*xs))          # and it runs
    return dict(peak_bytes=compiled_peak_bytes(compiled),
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                device=jax.devices()[0].device_kind, version=f"jax {jax.__version__}")


def op_fla(op: str, T: int, H: int, D: int) -> dict:
    import torch
    from benchmarks import fla

    fla_op = fla.op(op)
    q, k, v, g, beta = fla.inputs(op, T, H, D)
    do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    call = lambda: fla_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].backward(do)
    return dict(peak_bytes=fla.peak_bytes(call), temp_bytes=None,
                device=torch.cuda.get_device_name(),
                version=f"fla {fla.version()}, torch {torch.__version__}")


def measure_op(op: str, impl: str, T: int, H: int, D: int, timeout: int) -> dict:
    """One op measurement in a child process (a fresh allocator, the GPU to itself)."""
    base = dict(kind="op", op=op, impl=impl, T=T, H=H, K=D, V=D)
    try:
        child = subprocess.run([sys.executable, "-m", __spec__.name, "--child",
                                f"{op}:{impl}:{T}:{H}:{D}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(base, error=f"no result within {timeout} s")
    if child.returncode != 0:
        return dict(base, error=(child.stderr.strip().splitlines() or ["?"])[-1][:200])
    return dict(base, **json.loads(child.stdout.strip().splitlines()[-1]))


def measure_train(T: int, remat: str, steps: int, timeout: int, device_gib: float | None) -> dict:
    """One scripts/train.py run at T_local tokens with this remat choice."""
    base = dict(kind="train", layers=MODEL[1], hidden=int(MODEL[3]), heads=int(MODEL[5]),
                head_dim=int(MODEL[7]), T_local=T, remat=remat, device_gib=device_gib)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *MODEL,
               "--seq-len", str(T), "--mesh", "data=1,seq=1", "--batch", "1",
               "--dtype", "bfloat16", "--vocab", "8192", "--pairs", str(min(256, T // 4)),
               "--steps", str(steps), "--warmup", "1", "--eval-every", "0",
               "--ckpt-every", "0", "--remat", remat, "--run-dir", run_dir]
        try:
            run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return dict(base, fits=False, error=f"no result within {timeout} s")
        summary_path = os.path.join(run_dir, "summary.json")
        if run.returncode != 0 or not os.path.exists(summary_path):
            lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
            return dict(base, fits=False, error=(lines or ["?"])[-1][:200])
        with open(summary_path) as f:
            s = json.load(f)
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = json.load(f)
    return dict(base, fits=True, peak_gib=s["peak_mem_gib"], step_ms=s["step_ms"],
                tokens_per_s=s["tokens_per_s"], timed_steps=s["timed_steps"],
                loss=s["loss"], device=cfg["device_kind"], jax=cfg["jax_version"])


def device_memory_gib() -> tuple[str | None, float | None]:
    """(name, total GiB) of GPU 0 from nvidia-smi, (None, None) without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                             text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None, None
    name, mib = out.rsplit(",", 1)
    return name.strip(), round(float(mib) / 1024, 1)


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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m benchmarks.bench.memory",
                       description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--T", type=_positive, nargs="*", default=[32768, 65536, 131072, 262144],
                    help="T_local of the training runs (none: no training runs)")
    ap.add_argument("--remat", nargs="*", default=["none", "block", "mixer"],
                    choices=["none", "block", "mixer"])
    ap.add_argument("--steps", type=_positive, default=3, help="train steps per run (>= 2)")
    ap.add_argument("--ops", default="gdn,kda", help="ops to measure alone (none: no ops)")
    ap.add_argument("--impls", default="jaxcp,fla")
    ap.add_argument("--timeout", type=_positive, default=300, help="seconds per child process")
    ap.add_argument("--deadline", type=_positive, default=None,
                    help="seconds after which no new measurement starts")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        op, impl, T, H, D = args.child.split(":")
        fn = op_jaxcp if impl == "jaxcp" else op_fla
        print(json.dumps(fn(op, int(T), int(H), int(D))))
        return 0
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step compiles)")
    ops = [] if args.ops == "none" else args.ops.split(",")
    if not set(ops) <= {"gdn", "kda"}:
        ap.error(f"--ops takes gdn, kda or none, got {args.ops!r}")
    impls = args.impls.split(",")
    if not set(impls) <= {"jaxcp", "fla"}:
        ap.error(f"--impls takes jaxcp and fla, got {args.impls!r}")

    records = []
    start = time.monotonic()

    def in_time() -> bool:
        return args.deadline is None or time.monotonic() - start < args.deadline

    def add(record):
        records.append(record)
        print(json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)

    _, device_gib = device_memory_gib()
    too_long = set()          # remat choices that did not fit a shorter T_local
    for T in sorted(args.T):
        for remat in args.remat:
            if remat not in too_long and in_time():
                add(measure_train(T, remat, args.steps, args.timeout, device_gib))
                if not records[-1]["fits"]:
                    too_long.add(remat)
    for op in ops:
        for T, H, D in OP_SHAPES:
            for impl in impls:
                if in_time():
                    add(measure_op(op, impl, T, H, D, args.timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
