"""The relative error of a result against its reference, shared by the tests and the scripts."""
from __future__ import annotations

import numpy as np


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64, for any array type and dtype (bf16 included); a zero
    ref divides by 1. inf when out has a NaN or an infinity anywhere, so that such a result
    never passes a limit. The shapes must match (no broadcasting)."""
    out, ref = (np.asarray(x).astype(np.float64) for x in (out, ref))
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {out.shape} against {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    scale = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (scale if scale > 0 else 1.0))
