"""Every docs/benchmarks/NAME.md is what its NAME.json and NAME.notes.md render to."""
from __future__ import annotations

import glob
import os

import pytest

from jaxcp.bench import docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = sorted(glob.glob(os.path.join(ROOT, "docs", "benchmarks", "*.json")))


def test_every_record_file_has_a_renderer():
    assert RECORDS, "no docs/benchmarks/*.json"
    for path in RECORDS:
        assert docs.kind(path) in docs.RENDERERS


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_committed_markdown_is_the_fresh_render(path, tmp_path):
    name = os.path.splitext(os.path.basename(path))[0]
    docs.write(path, str(tmp_path), png=False)
    fresh = (tmp_path / f"{name}.md").read_text()
    committed_path = os.path.splitext(path)[0] + ".md"
    assert os.path.exists(committed_path), f"docs/benchmarks/{name}.md is missing"
    with open(committed_path) as f:
        committed = f.read()
    assert committed == fresh, (
        f"docs/benchmarks/{name}.md differs from the render of {name}.json and {name}.notes.md;"
        f" regenerate it: python scripts/render_docs.py docs/benchmarks/{name}.json")
