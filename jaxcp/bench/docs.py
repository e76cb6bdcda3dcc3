"""docs/benchmarks/NAME.md rendered from NAME.json and the hand-written NAME.notes.md.

The kind of a record file, and so its renderer, is its name: "kernels", "cp", "train",
"gpu_checks" or "memory", alone or followed by "_" and a suffix (cp_w2.json). Kinds with a
plot also get NAME.png (matplotlib, imported only for it)."""
from __future__ import annotations

import json
import os

from jaxcp.bench import checks, cp, kernels, memory, train

RENDERERS = {"kernels": kernels.markdown, "cp": cp.markdown, "train": train.markdown,
             "gpu_checks": checks.markdown, "memory": memory.markdown}
PLOTS = {"kernels": "kernels_png", "cp": "cp_png", "memory": "memory_png"}
COMMAND = "python scripts/render_docs.py"


def kind(json_path: str) -> str:
    """The record kind of a NAME.json: the key of RENDERERS that NAME is or starts with + "_"."""
    name = os.path.splitext(os.path.basename(json_path))[0]
    for key in RENDERERS:
        if name == key or name.startswith(key + "_"):
            return key
    raise ValueError(f"{json_path}: not a benchmark record file ({', '.join(RENDERERS)}[_*])")


def render(json_path: str) -> str:
    """The markdown of a record file: a line naming its sources and the command that renders
    it, the kind's tables, the plot's link, then NAME.notes.md if there is one."""
    base = os.path.splitext(json_path)[0]
    name = os.path.basename(base)
    with open(json_path) as f:
        records = json.load(f)
    parts = [f"<!-- Rendered from {name}.json and {name}.notes.md by `{COMMAND} "
             f"docs/benchmarks/{name}.json`: edit those, not this file. -->\n",
             RENDERERS[kind(json_path)](records)]
    if kind(json_path) in PLOTS:
        parts.append(f"![{name}]({name}.png)\n")
    if os.path.exists(base + ".notes.md"):
        with open(base + ".notes.md") as f:
            parts.append(f.read())
    return "\n".join(parts)


def write(json_path: str, out_dir: str | None = None, png: bool = True) -> list[str]:
    """Write NAME.md (and NAME.png where the kind has a plot and png is set) into out_dir
    (default: beside the JSON); returns the paths written."""
    base = os.path.splitext(json_path)[0]
    out = os.path.join(out_dir or os.path.dirname(base), os.path.basename(base))
    with open(out + ".md", "w") as f:
        f.write(render(json_path))
    written = [out + ".md"]
    if png and kind(json_path) in PLOTS:
        from jaxcp.bench import plot
        with open(json_path) as f:
            getattr(plot, PLOTS[kind(json_path)])(json.load(f), out + ".png")
        written.append(out + ".png")
    return written
