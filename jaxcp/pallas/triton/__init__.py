"""The Pallas kernels lowered through Triton.

- ``common``: what the kernels of both gates share: products (``products``), operands and
  the pallas_call (``call``), the reader of a chunk's rows (``chunk_rows``), launch
  configurations (``launch``), the in-kernel L2 normalisation of q, k (``unit_rows``),
  register-tile helpers (``tiles``), and the chunk state recurrences, one set of kernels
  for both gates (``state``, its ``gate`` argument).
- ``gdn``: Gated DeltaNet, a scalar gate per head and token (``Gate.SCALAR``): its gate
  terms (``gates``), intra-chunk terms (``intra``), input cotangents (``grads``).
- ``kda``: Kimi Delta Attention, a gate per channel (``Gate.CHANNEL``): the gate's chunk
  cumsum (``gate_cumsum``), sub-chunks (``sub_chunks``), gate factors (``gates``),
  intra-chunk terms (``intra``), input cotangents (``grads``).
"""
