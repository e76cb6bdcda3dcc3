"""Pallas GPU kernels, twins of the ``jaxcp.xla`` stages, one package per lowering:
``triton`` (Triton, through jaxlib; every backend's kernels today) and ``mosaic`` (Mosaic
GPU, its first kernels), each laid out as ``common``, ``gdn``, ``kda``."""
