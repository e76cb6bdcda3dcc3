"""The chunked delta rule in pure jnp: the CPU default and the readable spec of every stage.

``gate`` (the decay per token), ``intra`` (gate cumsum, gated inner products, WY w/u),
``state`` (forward and backward chunk recurrences, the CP summary), ``output`` (the chunk
output, and the forward state recurrence fused with it), ``grads`` (the cotangents of the
chunk inputs). The Pallas kernels in ``jaxcp.pallas`` are twins of these functions with
the same signatures.
"""
from jaxcp.xla.gate import per_token_decay
from jaxcp.xla.grads import chunk_grads
from jaxcp.xla.intra import chunk_local_cumsum, gated_inner, intra_chunk
from jaxcp.xla.output import chunk_output, state_output
from jaxcp.xla.state import cp_summary, final_states, state_bwd, state_fwd, state_last

__all__ = [
    "chunk_grads", "chunk_local_cumsum", "gated_inner", "intra_chunk",
    "chunk_output", "state_output", "cp_summary", "final_states", "state_bwd", "state_fwd",
    "state_last", "per_token_decay",
]
