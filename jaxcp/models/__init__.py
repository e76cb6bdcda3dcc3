"""Flax NNX layers: GatedDeltaNet, KimiDeltaAttention and their parts."""
from jaxcp.models.conv import ShortConvolution
from jaxcp.models.layers import GatedDeltaNet, KimiDeltaAttention
from jaxcp.models.norm import RMSNorm, RMSNormGated

__all__ = ["ShortConvolution", "GatedDeltaNet", "KimiDeltaAttention", "RMSNorm", "RMSNormGated"]
