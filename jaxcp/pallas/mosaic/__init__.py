"""The Pallas kernels lowered through Mosaic GPU (Hopper: TMA copies into shared memory,
wgmma products into register accumulators), beside ``jaxcp.pallas.triton``.

- ``common``: the chunk state recurrence, forward, for the scalar gate (``state``): alone
  (h and v_new per chunk) or fused with the output; shared-memory operand tiles and wgmma
  products (``tiles``).
- ``gdn``: GDN's intra-chunk terms (``intra``: the grams, the inverse, w, u, attn).

The "mosaic" backend (``jaxcp.stages``) runs them for GDN where they take the terms, and
the Triton kernels for every other stage. They run in Mosaic GPU's interpret mode on any
device, and lower for CUDA from a machine without a GPU (``jax.export``), which is how the
CPU tests check them.
"""
