"""What one chunk gives the state recurrence and the output: the contract between the
intra-chunk stages and the state stages of every backend (``ChunkTerms``), and the
full-precision einsum that the jnp stages and the CP merges compute with."""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

einsum = partial(jnp.einsum, precision=lax.Precision.HIGHEST)


class ChunkTerms(NamedTuple):
    """What the state recurrence and the output need from one chunk.

    w [..., C, K]; u [..., C, V]; qg = scale q exp(G) [..., C, K]; kd = k exp(G_C - G)
    [..., C, K]; decay = exp(G_C) [..., Kg]; attn = lower(scale q_i . k_j exp(G_i - G_j))
    [..., C, C]; inv = (I + A)^-1 [..., C, C], only when asked for (the backward's input
    cotangents read it instead of inverting again), else None.

    Row-factored form (the Pallas GDN intra kernel): q_rows, k_rows [..., C] are given and
    qg, kd hold the bare q and k as the kernels read them, token-major [B, T, HV, K] (chunk c
    at the layout's token offsets); the terms are q_rows[..., None] * qg and
    k_rows[..., None] * kd on each chunk's rows. The state kernels scale rows of their
    products instead, so the scaled [C, K] tiles are never written. ``tiles`` gives the
    plain form of terms whose qg, kd are in chunk layout.
    """
    w: jax.Array
    u: jax.Array
    qg: jax.Array
    kd: jax.Array
    decay: jax.Array
    attn: jax.Array
    inv: jax.Array | None = None
    q_rows: jax.Array | None = None
    k_rows: jax.Array | None = None

    def tiles(self) -> "ChunkTerms":
        """The plain form: qg and kd as scaled tiles (chunk layout only)."""
        if self.q_rows is None:
            return self
        return self._replace(qg=self.q_rows[..., None] * self.qg.astype(jnp.float32),
                             kd=self.k_rows[..., None] * self.kd.astype(jnp.float32),
                             q_rows=None, k_rows=None)
