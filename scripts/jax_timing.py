"""Wall-clock timing of jitted JAX calls for the scripts: warm up, then the median."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def median_ms(fn: Callable, *args, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn(*args) over `iters` calls (each waited for), after the first
    call (compilation) and `warmup` more."""
    import jax

    for _ in range(1 + warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))
