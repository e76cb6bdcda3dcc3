"""Benchmarks that write the records of docs/benchmarks/: the kernels of one op (``kernels``),
context parallelism on several GPUs (``cp``), peak memory (``memory``), and the training runs
of scripts/gpu_train_runs.sh, read from their run directories (``train``). Each module makes
its records and renders them as the page's tables (``markdown``)."""
