"""Softmax attention ops for the layers, context parallel included.

- ``blockwise``: masked softmax attention in jnp, flash-style, memory linear in T (custom_vjp);
  any mask of positions and sequence ids, so packed sequences and CP over gathered keys.
- ``pieces``: the contract of one attention piece (forward with lse; backward with the whole
  attention's o and lse) and its dense reference; ``cudnn``: the same on cuDNN's kernels.
- ``prefix``: a device's causal attention over its own and all earlier devices' keys, two
  pieces merged by their lse (one unpacked sequence under CP).
- ``ring``: the same attention with the keys and values passed around the devices, one
  device's block at a time (memory O(T_local)).
- ``select``: which of these a layer runs; ``rope``: rotary embedding.
"""
from jaxcp.attention.blockwise import blockwise_attention
from jaxcp.attention.pieces import AttentionPieces, DensePieces
from jaxcp.attention.prefix import gathered_causal_attention, prefix_causal_attention
from jaxcp.attention.ring import ring_causal_attention
from jaxcp.attention.rope import rope
from jaxcp.attention.select import cp_pieces, fused_attention_impl

__all__ = ["AttentionPieces", "DensePieces", "blockwise_attention", "cp_pieces",
           "fused_attention_impl", "gathered_causal_attention", "prefix_causal_attention",
           "ring_causal_attention", "rope"]
