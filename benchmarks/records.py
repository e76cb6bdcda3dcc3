"""Benchmark records on disk: a JSON list, rewritten after every measurement."""
from __future__ import annotations

import json
import os
from typing import Callable


def saver(path: str | None, records: list) -> Callable:
    """save(more=()) writes records + more to path (nothing when path is None), so that a run
    cut short keeps what it measured."""
    def save(more=()):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(records + list(more), f, indent=1)
    return save
