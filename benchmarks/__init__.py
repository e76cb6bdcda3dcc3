"""jaxcp on GPUs beside FLA: benchmarks (``bench``), checks against references (``check``),
per-kernel and per-stage profiles (``profile``), and the pages of docs/benchmarks/ rendered
from the benchmarks' records (``pages``, with the charts of ``plot``). What they share:
timing of jitted calls and compiled peak memory (``timing``), FLA's op and inputs (``fla``).

Not installed with jaxcp: each tool is a module with a ``main()``, run from the repository
root, e.g. ``python -m benchmarks.bench.kernels --help``.
"""
