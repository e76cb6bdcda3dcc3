"""The Pallas kernels lowered through Mosaic GPU (Hopper: TMA copies into shared memory,
wgmma products into register accumulators), beside ``jaxcp.pallas.triton``.

- ``common``: the chunk state recurrence, forward, for the scalar gate (``state``).

No backend selects them yet: the GDN forward's other kernels (intra-chunk terms, output)
come first. They run in Mosaic GPU's interpret mode on any device, and lower for CUDA from a
machine without a GPU (``jax.export``), which is how the CPU tests check them.
"""
