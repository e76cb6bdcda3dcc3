"""Pallas GPU kernels, twins of the ``jaxcp.xla`` stages, one package per lowering:
``triton`` (Triton, through jaxlib). Another lowering (Mosaic GPU) is a sibling package
with the same layout: ``common``, ``gdn``, ``kda``."""
