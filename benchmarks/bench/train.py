"""Records of scripts/train.py runs, from their run directories, and their table.

    python -m benchmarks.bench.train runs/gpu/*/ --json docs/benchmarks/train.json
    python -m benchmarks.bench.train runs/more/*/ --json docs/benchmarks/train.json --keep
    python -m benchmarks.bench.train runs/cpu/*/ --out /tmp/train.md

--json writes one record per run directory (``FIELDS``: the run's settings, result, speed and
memory) and renders the .md beside it (with its .notes.md, if there is one), as
``benchmarks.pages`` does; --out writes the table alone, as markdown.

Each run directory holds config.json (written by train.py at the start) and, once the run has
finished, summary.json; a run without summary.json falls back to the last record of
metrics.jsonl ("partial"), or shows the last line of its train.log ("failed"); a run whose
loss is not finite has "failed" too. A directory without config.json (train.py stopped
before writing it) gives a record of its name and status only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (record field, table column, digits of a number or None for text)
FIELDS = (("run", "run", None), ("result", "result", None), ("mesh", "mesh", None),
          ("layers", "layers", None), ("layout", "layout", None), ("seq_len", "seq len", None),
          ("batch", "global batch", None), ("dtype", "dtype", None),
          ("backend", "backend", None), ("remat", "remat", None), ("steps", "steps", None),
          ("loss", "loss", 4),
          ("eval_accuracy", "eval accuracy", 4), ("step_ms", "step ms", 1),
          ("tokens_per_s", "tokens/s", 0), ("tokens_per_s_per_gpu", "tokens/s per GPU", 0),
          ("mfu", "MFU", 3),
          ("peak_mem_gib", "peak mem per GPU GiB", 2), ("device", "device", None),
          ("jax", "jax", None), ("command", "command", None))


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


def record(run: dict) -> dict:
    """The FIELDS of one loaded run (None where unknown); the backend is marked "(default)"
    when --backend was not given."""
    cfg, res = run["config"], run["result"] or {}
    out = dict.fromkeys(name for name, _, _ in FIELDS)
    out.update(run=run["name"], result=run["status"])
    if cfg is None:
        return out
    args = cfg["args"]
    data, seq = args["mesh"]
    n = cfg["n_devices"]
    per_device = res.get("tokens_per_s_per_device")
    if per_device is None and res.get("tokens_per_s") is not None:
        per_device = res["tokens_per_s"] / n
    backend = cfg.get("backend", "?")
    env = " ".join(f"{k}={v}" for k, v in cfg.get("env", {}).items())
    out.update(mesh=f"data={data},seq={seq}", layers=args["layers"],
               layout=args.get("layout", "contiguous") if seq > 1 else None,
               seq_len=args["seq_len"],
               batch=args["batch"], dtype=args["dtype"],
               backend=backend if args["backend"] else f"{backend} (default)",
               remat=args.get("remat"), mfu=res.get("mfu"),
               steps=res.get("step"), loss=res.get("loss"),
               eval_accuracy=res.get("eval_accuracy"), step_ms=res.get("step_ms"),
               tokens_per_s=res.get("tokens_per_s"), tokens_per_s_per_gpu=per_device,
               peak_mem_gib=res.get("peak_mem_gib"), device=f"{n} x {cfg['device_kind']}",
               jax=cfg["jax_version"], command=f"{env} {cfg['command']}".strip())
    return out


def _cell(value, digits: int | None, code: bool) -> str:
    if value is None:
        return "-"
    text = str(value) if digits is None else f"{value:,.{digits}f}"
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text


def markdown(records: list[dict]) -> str:
    """One row per run, the columns of FIELDS."""
    lines = ["# scripts/train.py runs", "",
             "| " + " | ".join(column for _, column, _ in FIELDS) + " |",
             "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(_cell(r.get(name), digits, name == "command")
                                for name, _, digits in FIELDS) + " |" for r in records]
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    from benchmarks import pages

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench.train",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="+", help="train.py run directories")
    ap.add_argument("--json", help="records file, its .md written beside it "
                                   "(default without --out: docs/benchmarks/train.json)")
    ap.add_argument("--out", help="write the table alone here, as markdown")
    ap.add_argument("--keep", action="store_true",
                    help="keep the records already in --json (but those of the same run names), "
                         "before the new ones")
    args = ap.parse_args(argv)
    json_path = args.json or (None if args.out else "docs/benchmarks/train.json")
    try:
        if json_path and pages.kind(json_path) != "train":
            raise ValueError(f"{json_path}: the name must be train.json or train_*.json")
        records = [record(load_run(d)) for d in args.run_dirs]
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    written = []
    if json_path and args.keep and os.path.exists(json_path):
        names = {r["run"] for r in records}
        with open(json_path) as f:
            records = [r for r in json.load(f) if r["run"] not in names] + records
    if json_path:
        _write(json_path, json.dumps(records, indent=1))
        written += [json_path] + pages.write(json_path)
    if args.out:
        _write(args.out, markdown(records))
        written.append(args.out)
    print(f"wrote {', '.join(written)} ({len(records)} runs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
