"""Model FLOPs of a training step and the utilisation they give (MFU).

Per token, forward, of an ``LM``:
  matmuls      2 n_in n_out for every linear layer (the head included; the embedding is a
               lookup and the short convolutions are elementwise: neither counts);
  attention    2 T H D per causal layer: q k^T and p v over the half triangle of a T-token
               sequence (4 H D (T + 1) / 2), H query heads of D;
  delta rule   per value head, chunk C, keys K, values V: 6 C K (the chunk's k k^T, q k^T and
               w), 4 C V (u and the chunk's own output), 2 C^2 / 3 (the triangular inverse),
               6 K V (w S, q S and the state update).
A training step counts three times the forward (the backward is twice it); recomputation
under remat is not counted, so MFU stays the model's rate, not the hardware's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from flax import nnx

# dense bf16 tensor-core peak, FLOP/s, by a name in jax's device_kind
PEAK_BF16_FLOPS = (("H100", 989.4e12), ("H200", 989.4e12), ("H800", 989.4e12),
                   ("GH200", 989.4e12), ("A100", 312e12), ("B200", 2250e12))


@dataclass(frozen=True)
class TokenFlops:
    """Forward FLOPs per token by kind; ``step`` is the training step's (3x forward)."""
    matmul: float
    attention: float
    delta_rule: float

    @property
    def forward(self) -> float:
        return self.matmul + self.attention + self.delta_rule

    @property
    def step(self) -> float:
        return 3 * self.forward


def delta_rule_flops(chunk_size: int, head_k_dim: int, head_v_dim: int) -> float:
    """Forward FLOPs per token and value head of the chunked delta rule (module docstring)."""
    C, K, V = chunk_size, head_k_dim, head_v_dim
    return 6 * C * K + 4 * C * V + 2 * C * C / 3 + 6 * K * V


def token_flops(model, seq_len: int, chunk_size: int = 64) -> TokenFlops:
    """The FLOPs of an ``jaxcp.models.LM`` per token of seq_len-token sequences."""
    from jaxcp.models.attention import CausalSelfAttention
    from jaxcp.models.layers import _DeltaRuleLayer

    _, params = nnx.split(model, nnx.Param)
    matmul = sum(2 * math.prod(leaf.shape)
                 for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                 if "kernel" in (getattr(k, "key", None) for k in path))
    attention = delta = 0.0
    for block in model.blocks:
        mixer = block.mixer
        if isinstance(mixer, CausalSelfAttention):
            attention += 2 * seq_len * mixer.num_heads * mixer.head_dim
        elif isinstance(mixer, _DeltaRuleLayer):
            delta += mixer.num_v_heads * delta_rule_flops(chunk_size, mixer.head_k_dim,
                                                          mixer.head_v_dim)
    return TokenFlops(float(matmul), float(attention), float(delta))


def peak_flops(device: jax.Device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, None where it is not known (CPUs)."""
    if device.platform != "gpu":
        return None
    for name, peak in PEAK_BF16_FLOPS:
        if name in device.device_kind:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_s_per_device: float | None,
        peak: float | None) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s per device over the device's peak."""
    if tokens_per_s_per_device is None or peak is None:
        return None
    return flops_per_token * tokens_per_s_per_device / peak
