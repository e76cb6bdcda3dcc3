"""The kind of decay gate of a delta-rule variant: one value from the public op to the kernels;
and the gate activation (``decay_from_raw``) that the ops apply with use_gate_in_kernel=True.

Per value head and token t, the state S [K, V] decays before the delta-rule update:

    Gate.SCALAR   (Gated DeltaNet)          S <- exp(g_t) S,             g [B, T, HV]
    Gate.CHANNEL  (Kimi Delta Attention)    S <- Diag(exp(g_t)) S,       g [B, T, HV, K]

Inside the chunked algorithm g always has a trailing gate axis of width ``Gate.width(K)``
(1 or K), so that the jnp stages share one code path; the gate kind itself is never read off
that width: every stage and kernel is told it.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp


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


class DecayTerms(NamedTuple):
    """The decay y and its derivatives at one gate input, elementwise (``decay_terms``)."""
    decay: jax.Array
    d_input: jax.Array       # dy / d(g_raw + dt_bias)
    d_log_a: jax.Array       # dy / dA_log


def softplus(x):
    """log(1 + e^x), in the form that neither overflows nor loses x's digits (XLA's)."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def decay_terms(x, a, lower_bound: float | None) -> DecayTerms:
    """The decay of x = g_raw + dt_bias (float32) and its derivatives, with a = exp(A_log)
    broadcast to x (None: no A_log, with lower_bound only):

        lower_bound None:  y = -a softplus(x),        dy/dx = -a sigmoid(x),
                           dy/dA_log = y
        lower_bound lb:    s = sigmoid(a x),  y = lb s,  dy/dx = lb s (1 - s) a,
                           dy/dA_log = lb s (1 - s) a x

    Plain elementwise jnp: XLA runs it in ``decay_from_raw``, the Pallas gate kernels
    (``pallas.triton.kda.gate_cumsum``) inside their tiles; unused terms cost nothing in either."""
    if lower_bound is None:
        y = -a * softplus(x)
        return DecayTerms(y, -a * sigmoid(x), y)
    s = sigmoid(x if a is None else a * x)
    slope = lower_bound * s * (1.0 - s)
    if a is None:
        return DecayTerms(lower_bound * s, slope, jnp.zeros_like(x))
    return DecayTerms(lower_bound * s, slope * a, slope * a * x)


def decay_from_raw(gate: Gate, g_raw: jax.Array, A_log: jax.Array | None,
                   dt_bias: jax.Array | None, lower_bound: float | None = None) -> jax.Array:
    """The decay from the raw gate input, float32 in g_raw's shape (FLA's contract for
    ``use_gate_in_kernel``; ``decay_terms``):

        g = -exp(A_log) * softplus(g_raw + dt_bias)                (lower_bound None)
        g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))  (KDA, lower_bound < 0;
                                                                   without A_log: of g_raw + dt_bias)

    g_raw: ``gate.dims()``, [B, T, HV] or [B, T, HV, K]; A_log [HV] (per value head);
    dt_bias [HV] (scalar gate) or [HV * K] (per-channel gate), or None. The first form is in
    (-inf, 0), the second in (lower_bound, 0)."""
    x = g_raw.astype(jnp.float32)
    per_head = (lambda p: p) if gate is Gate.SCALAR else (lambda p: p.reshape(x.shape[-2], -1))
    if dt_bias is not None:
        x = x + per_head(dt_bias.astype(jnp.float32))
    a = None if A_log is None else jnp.exp(A_log.astype(jnp.float32))
    if a is not None and gate is Gate.CHANNEL:
        a = a[:, None]
    return decay_terms(x, a, lower_bound).decay
