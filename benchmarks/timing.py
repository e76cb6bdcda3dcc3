"""Wall-clock timing of jitted JAX calls for the benchmarks and checks: warm up, then the
median; and a compiled call's peak memory."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np


def forward_backward(call: Callable, argnums: Sequence[int], cotangent=None) -> Callable:
    """The forward and backward of call as FLA's ``o.backward(do)`` runs them: o =
    call(*args), then the cotangents of the arguments argnums for the output cotangent
    (None: ones, made inside the call as FLA's ``torch.ones_like(o)``). o is returned, so the
    forward's output is computed (under jax.grad of a loss linear in o nothing reads o and
    XLA drops the kernels that only write it), and no loss is reduced (value_and_grad of
    sum(o * do) adds a reduction over o that FLA's timing does not have)."""
    import jax
    import jax.numpy as jnp

    argnums = tuple(argnums)

    def step(*args):
        def of_diff(*diff):
            full = list(args)
            for i, x in zip(argnums, diff):
                full[i] = x
            return call(*full)

        o, vjp = jax.vjp(of_diff, *(args[i] for i in argnums))
        do = jnp.ones_like(o) if cotangent is None else cotangent.astype(o.dtype)
        return o, vjp(do)

    return step


def median_ms(fn: Callable, *args, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn(*args) over `iters` calls (each waited for), after the first
    call (compilation, unless fn is compiled already) and `warmup` more."""
    import jax

    for _ in range(1 + warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def pipelined_ms(fn: Callable, *args, iters: int = 20, calls: int = 4,
                 warmup: int = 3) -> float:
    """Milliseconds per call of fn(*args) issued `calls` times back to back and waited for
    once: the median over `iters` such rounds, after the first call and `warmup` more. The
    host dispatches a call while the previous one runs, as FLA's timings (triton's do_bench,
    CUDA events around queued launches) measure the GPU's time and not a round trip per call;
    ``median_ms`` waits for each call and so adds the dispatch and the wait to every one."""
    import jax

    for _ in range(1 + warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - t0) / calls)
    return 1e3 * float(np.median(times))


def compile_side_by_side(jobs: Sequence[tuple[Callable, tuple]], threads: int = 8) -> list:
    """Lower and compile jitted functions for their arguments, `threads` at a time (tracing
    and lowering hold the GIL; XLA's compilation, Triton's included, releases it). XLA's
    autotuner times candidate kernels on the GPU while it compiles, so compiles that overlap
    may pick from noisier timings; threads=1 compiles one at a time. Returns, per job, the
    executable or the exception its compilation raised."""
    def build(job):
        fn, args = job
        try:
            return fn.lower(*args).compile()
        except Exception as e:   # the caller reports it for that job and goes on
            return e

    with ThreadPoolExecutor(max(1, min(threads, len(jobs)))) as pool:
        return list(pool.map(build, jobs))


def compiled_peak_bytes(compiled) -> int | None:
    """The memory a compiled call holds at its peak: its arguments, outputs and XLA's
    temporaries, less the outputs that alias arguments (the executable's memory analysis;
    None where the backend gives none)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


class Timed(NamedTuple):
    """One job of ``time_side_by_side``: median ms per call and ``compiled_peak_bytes``."""
    ms: float
    peak_bytes: int | None


def time_side_by_side(jobs: Sequence[tuple[Callable, tuple]], iters: int,
                      threads: int = 8) -> Iterator[Timed | Exception]:
    """Compile the jobs side by side (``compile_side_by_side``), then time each in turn
    (``pipelined_ms``): yields, per job and as soon as it is measured, its ``Timed`` or the
    exception its compilation or run raised (so a caller can report it and go on)."""
    for (_, args), fn in zip(jobs, compile_side_by_side(jobs, threads)):
        if isinstance(fn, Exception):
            yield fn
            continue
        try:
            yield Timed(pipelined_ms(fn, *args, iters=iters), compiled_peak_bytes(fn))
        except Exception as e:   # the caller reports it for that job and goes on
            yield e
