"""Render docs/benchmarks/NAME.md (and NAME.png) from NAME.json and NAME.notes.md.

    python -m benchmarks.pages                                  # every docs/benchmarks/*.json
    python -m benchmarks.pages docs/benchmarks/kernels.json     # one of them

NAME.json holds a benchmark's records, NAME.notes.md the hand-written rest of the page. The
kind of a record file, and so its renderer, is its name: "kernels", "cp", "train", "decode",
"segments", "gpu_checks" or "memory", alone or followed by "_" and a suffix (cp_w2.json).
Kinds with a plot also get NAME.png (matplotlib, imported only for it). tests/test_benchmark_docs.py
fails when a committed .md differs from what this writes.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from benchmarks.bench import cp, decode, kernels, memory, segments, train
from benchmarks.check import kernels as checks

RENDERERS = {"kernels": kernels.markdown, "cp": cp.markdown, "train": train.markdown,
             "decode": decode.markdown, "segments": segments.markdown,
             "gpu_checks": checks.markdown, "memory": memory.markdown}
PLOTS = {"kernels": "kernels_png", "cp": "cp_png", "memory": "memory_png"}
COMMAND = "python -m benchmarks.pages"


def kind(json_path: str) -> str:
    """The record kind of a NAME.json: the key of RENDERERS that NAME is or starts with + "_"."""
    name = os.path.splitext(os.path.basename(json_path))[0]
    for key in RENDERERS:
        if name == key or name.startswith(key + "_"):
            return key
    raise ValueError(f"{json_path}: not a benchmark record file ({', '.join(RENDERERS)}[_*])")


def render(json_path: str, record_kind: str | None = None) -> str:
    """The markdown of a record file: a line naming its sources and the command that renders
    it, the tables of its kind (record_kind, default ``kind`` of its name), the plot's link,
    then NAME.notes.md if there is one."""
    base = os.path.splitext(json_path)[0]
    name = os.path.basename(base)
    record_kind = record_kind or kind(json_path)
    with open(json_path) as f:
        records = json.load(f)
    parts = [f"<!-- Rendered from {name}.json and {name}.notes.md by `{COMMAND} "
             f"docs/benchmarks/{name}.json`: edit those, not this file. -->\n",
             RENDERERS[record_kind](records)]
    if record_kind in PLOTS:
        parts.append(f"![{name}]({name}.png)\n")
    if os.path.exists(base + ".notes.md"):
        with open(base + ".notes.md") as f:
            parts.append(f.read())
    return "\n".join(parts)


def write(json_path: str, out_dir: str | None = None, png: bool = True,
          record_kind: str | None = None) -> list[str]:
    """Write NAME.md (and NAME.png where the kind has a plot and png is set) into out_dir
    (default: beside the JSON); the kind is record_kind, default ``kind`` of the name.
    Returns the paths written."""
    base = os.path.splitext(json_path)[0]
    out = os.path.join(out_dir or os.path.dirname(base), os.path.basename(base))
    record_kind = record_kind or kind(json_path)
    with open(out + ".md", "w") as f:
        f.write(render(json_path, record_kind))
    written = [out + ".md"]
    if png and record_kind in PLOTS:
        from benchmarks import plot
        with open(json_path) as f:
            getattr(plot, PLOTS[record_kind])(json.load(f), out + ".png")
        written.append(out + ".png")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="*", help="record files (default: docs/benchmarks/*.json)")
    ap.add_argument("--no-png", action="store_true", help="markdown only (no matplotlib)")
    args = ap.parse_args(argv)
    for path in args.json or sorted(glob.glob("docs/benchmarks/*.json")):
        try:
            written = write(path, png=not args.no_png)
        except (OSError, ValueError) as e:
            ap.exit(2, f"{ap.prog}: error: {e}\n")
        print("wrote " + ", ".join(written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
