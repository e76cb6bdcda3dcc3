"""Table of scripts/train.py runs, from their run directories, as markdown.

    python scripts/report_train.py runs/gpu/*/ --out docs/benchmarks/train.md

Each run directory holds config.json (written by train.py at the start) and, once the run has
finished, summary.json; a run without summary.json falls back to the last record of
metrics.jsonl ("partial"), or shows the last line of its train.log ("failed"); a run whose
loss is not finite has "failed" too. A directory without config.json (train.py stopped
before writing it) gives a row of its name and status.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

COLUMNS = ("run", "result", "mesh", "layers", "seq len", "global batch", "dtype", "backend",
           "steps", "loss", "eval accuracy", "step ms", "tokens/s", "tokens/s per GPU",
           "peak mem per GPU GiB", "device", "jax", "command")


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _last_line(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else None


def load_run(run_dir: str) -> dict:
    """config (None if absent), result (summary.json or the last metrics.jsonl record, None if
    neither) and status ("ok", "partial", "failed: <last log line>" or "failed: loss <loss>
    at step <step>")."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir}: not a directory")
    config = _read_json(os.path.join(run_dir, "config.json"))
    result = _read_json(os.path.join(run_dir, "summary.json"))
    status = "ok"
    if result is None:
        last = _last_line(os.path.join(run_dir, "metrics.jsonl"))
        result = None if last is None else json.loads(last)
        status = "partial"
    if result is None:
        reason = _last_line(os.path.join(run_dir, "train.log")) or "no result"
        status = f"failed: {reason[:120]}"
    elif not math.isfinite(result.get("loss", 0.0)):
        status = f"failed: loss {result['loss']} at step {result.get('step')}"
    return dict(name=os.path.basename(os.path.normpath(run_dir)), config=config, result=result,
                status=status)


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _backend(cfg: dict) -> str:
    """The backend that ran, marked "(default)" when --backend was not given."""
    ran = cfg.get("backend", "?")
    return ran if cfg["args"]["backend"] else f"{ran} (default)"


def row(run: dict) -> list[str]:
    """The table cells of one run, in COLUMNS order."""
    cfg, res = run["config"], run["result"] or {}
    if cfg is None:
        return [run["name"], run["status"]] + ["-"] * (len(COLUMNS) - 2)
    args = cfg["args"]
    data, seq = args["mesh"]
    n = cfg["n_devices"]
    per_device = res.get("tokens_per_s_per_device")
    if per_device is None and res.get("tokens_per_s") is not None:
        per_device = res["tokens_per_s"] / n
    env = " ".join(f"{k}={v}" for k, v in cfg.get("env", {}).items())
    command = f"{env} {cfg['command']}".strip()
    return [run["name"], run["status"], f"data={data},seq={seq}", args["layers"],
            str(args["seq_len"]), str(args["batch"]), args["dtype"], _backend(cfg),
            str(res.get("step", "-")), _number(res.get("loss"), 4),
            _number(res.get("eval_accuracy"), 4), _number(res.get("step_ms"), 1),
            _number(res.get("tokens_per_s"), 0),
            _number(per_device, 0), _number(res.get("peak_mem_gib"), 2),
            f"{n} x {cfg['device_kind']}", cfg["jax_version"], f"`{command}`"]


def markdown(runs: list[dict]) -> str:
    lines = ["# scripts/train.py runs", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(c) for c in row(run)) + " |" for run in runs]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="+", help="train.py run directories")
    ap.add_argument("--out", default="docs/benchmarks/train.md")
    args = ap.parse_args(argv)
    try:
        runs = [load_run(d) for d in args.run_dirs]
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(markdown(runs))
    print(f"wrote {args.out} ({len(runs)} runs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
