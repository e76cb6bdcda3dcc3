"""GPU checks against references: the kernels against the float32 token recurrence
(``kernels``, whose records render docs/benchmarks/gpu_checks.md), context parallelism
against one device (``cp``), and CP attention's cuDNN pieces against dense float32
(``attention``)."""
