"""The kind of decay gate of a delta-rule variant: one value from the public op to the kernels.

Per value head and token t, the state S [K, V] decays before the delta-rule update:

    Gate.SCALAR   (Gated DeltaNet)          S <- exp(g_t) S,             g [B, T, HV]
    Gate.CHANNEL  (Kimi Delta Attention)    S <- Diag(exp(g_t)) S,       g [B, T, HV, K]

Inside the chunked algorithm g always has a trailing gate axis of width ``Gate.width(K)``
(1 or K), so that the jnp stages share one code path; the gate kind itself is never read off
that width: every stage and kernel is told it.
"""
from __future__ import annotations

import enum


class Gate(enum.Enum):
    SCALAR = "scalar"
    CHANNEL = "channel"

    def width(self, K: int) -> int:
        """Kg, the width of the gate's trailing axis in the chunk stages: 1 or K."""
        return 1 if self is Gate.SCALAR else K

    def dims(self) -> str:
        """The public op's g dimensions, for error messages and docs."""
        return "[B, T, HV]" if self is Gate.SCALAR else "[B, T, HV, K]"

    def shape(self, B: int, T: int, HV: int, K: int) -> tuple[int, ...]:
        """The public op's g shape."""
        return (B, T, HV) if self is Gate.SCALAR else (B, T, HV, K)
