"""GDN's gate terms of one chunk (scalar gate): G = cumsum(g) over the chunk's rows [C],
exp(G), exp(G_C - G), exp(G_C), and the [C, C] decays E_ij = exp(G_i - G_j) (j < i, or
j <= i), built where they are used."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class ScalarGates(NamedTuple):
    """Gate terms of one chunk of a scalar gate, from g [C]: G = cumsum(g). The [C, C]
    decay matrices are built where they are used, so that they do not hold registers in
    between."""
    G: jax.Array          # [C]
    eg: jax.Array         # exp(G) [C]
    tail: jax.Array       # exp(G_C - G) [C]
    last: jax.Array       # exp(G_C) []

    def strict(self):
        """exp(G_i - G_j) for j < i, else 0 [C, C]."""
        return self._decays(lambda rows, cols: rows > cols)

    def causal(self):
        """exp(G_i - G_j) for j <= i, else 0 [C, C]."""
        return self._decays(lambda rows, cols: rows >= cols)

    def _decays(self, visible):
        C = self.G.shape[0]
        rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
        cols = lax.broadcasted_iota(jnp.int32, (C, C), 1)
        return jnp.exp(jnp.where(visible(rows, cols), self.G[:, None] - self.G[None, :],
                                 -jnp.inf))


def scalar_gates(g) -> ScalarGates:
    G = jnp.cumsum(g)
    total = jnp.sum(g)
    return ScalarGates(G, jnp.exp(G), jnp.exp(total - G), jnp.exp(total))

