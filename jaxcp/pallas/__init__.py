"""Pallas GPU kernels (Triton lowering through jaxlib), twins of the ``jaxcp.xla`` stages."""
