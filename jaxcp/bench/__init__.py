"""What the benchmark and check scripts share: timing of jitted calls (``timing``), and the
documents of docs/benchmarks/ rendered from their JSON records (``docs``: one renderer per
record kind in ``kernels``, ``cp``, ``checks``, ``train``; the plots in ``plot``)."""
