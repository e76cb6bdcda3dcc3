"""Records of scripts/train.py runs, from their run directories, and their table.

    python scripts/report_train.py runs/gpu/*/ --json docs/benchmarks/train.json
    python scripts/report_train.py runs/more/*/ --json docs/benchmarks/train.json --keep
    python scripts/report_train.py runs/cpu/*/ --out /tmp/train.md

--json writes one record per run directory (``jaxcp.bench.train``: the run's settings,
result, speed and memory) and renders the .md beside it (with its .notes.md, if there is
one), as scripts/render_docs.py does; --out writes the table alone, as markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxcp.bench import docs, train


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
        if json_path and docs.kind(json_path) != "train":
            raise ValueError(f"{json_path}: the name must be train.json or train_*.json")
        records = [train.record(train.load_run(d)) for d in args.run_dirs]
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    written = []
    if json_path and args.keep and os.path.exists(json_path):
        names = {r["run"] for r in records}
        with open(json_path) as f:
            records = [r for r in json.load(f) if r["run"] not in names] + records
    if json_path:
        _write(json_path, json.dumps(records, indent=1))
        written += [json_path] + docs.write(json_path)
    if args.out:
        _write(args.out, train.markdown(records))
        written.append(args.out)
    print(f"wrote {', '.join(written)} ({len(records)} runs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
