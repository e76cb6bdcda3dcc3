"""Hand-written notes kept beside a generated benchmark report (BASE.notes.md)."""
from __future__ import annotations

import os


def notes_beside(base: str) -> list[str]:
    """The text of BASE.notes.md as one entry, or nothing when there is none."""
    path = base + ".notes.md"
    return [open(path).read()] if os.path.exists(path) else []
