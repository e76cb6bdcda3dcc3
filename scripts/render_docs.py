"""Render docs/benchmarks/NAME.md (and NAME.png) from NAME.json and NAME.notes.md.

    python scripts/render_docs.py                                  # every docs/benchmarks/*.json
    python scripts/render_docs.py docs/benchmarks/kernels.json     # one of them

tests/test_benchmark_docs.py fails when a committed .md differs from what this writes.
"""
from __future__ import annotations

import argparse
import glob
import sys

from jaxcp.bench import docs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="*", help="record files (default: docs/benchmarks/*.json)")
    ap.add_argument("--no-png", action="store_true", help="markdown only (no matplotlib)")
    args = ap.parse_args(argv)
    for path in args.json or sorted(glob.glob("docs/benchmarks/*.json")):
        try:
            written = docs.write(path, png=not args.no_png)
        except (OSError, ValueError) as e:
            ap.exit(2, f"{ap.prog}: error: {e}\n")
        print("wrote " + ", ".join(written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
