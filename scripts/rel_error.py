"""Relative error of a result against its reference, for the GPU check scripts."""
from __future__ import annotations

import numpy as np


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (any array type and dtype, bf16 included); inf when
    out has a NaN or an infinity anywhere, so that such a result never passes a limit."""
    out, ref = (np.asarray(x, np.float64) for x in (out, ref))
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
