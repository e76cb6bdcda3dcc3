"""Flax NNX layers: GatedDeltaNet, KimiDeltaAttention, causal softmax attention, their parts."""
from jaxcp.models.attention import CausalSelfAttention
from jaxcp.models.conv import ShortConvolution
from jaxcp.models.layers import GatedDeltaNet, KimiDeltaAttention
from jaxcp.models.lm import LM
from jaxcp.models.norm import RMSNorm, RMSNormGated

__all__ = ["LM", "CausalSelfAttention", "ShortConvolution", "GatedDeltaNet", "KimiDeltaAttention", "RMSNorm", "RMSNormGated"]
