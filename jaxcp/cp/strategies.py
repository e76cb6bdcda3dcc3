"""The context-parallel strategies of the delta-rule ops, behind one call (``run_sharded``).

  allgather:  each device summarises its pieces as affine state maps, one all-gather, a
              prefix merge (``cp.exchange``, inside the op's custom_vjp);
  relay:      the state handed from device to device, W - 1 hops (``cp.exchange``; a
              baseline, contiguous layout only);
  all_to_all: the heads split over the axis around the op without CP (``cp.all_to_all``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jax import lax

from jaxcp.cp.all_to_all import head_all_to_all
from jaxcp.cp.exchange import Exchange


@dataclass(frozen=True)
class ContextParallel:
    """axis: the manual mesh axis the sequence is split over; strategy: one of
    ``checks.CP_STRATEGIES``; layout: how the tokens are split (``cp.split``)."""
    axis: str
    strategy: str = "allgather"
    layout: str = "contiguous"

    @property
    def splits_heads(self) -> bool:
        """The op runs on the whole sequence for a share of the heads."""
        return self.strategy == "all_to_all"


def run_sharded(cp: ContextParallel | None, op: Callable, q, k, v, g, beta, initial_state):
    """(o, final_state) of the op over a sequence split by cp (None: one device).

    op(q, k, v, g, beta, initial_state, exchange) -> (o, final_state) runs on the tokens it
    is given, ``Exchange`` doing the cross-device step inside it (None: the tokens are the
    whole sequence); its final states are those of the sequences that end on this device
    (zeros for the others), summed here over the axis."""
    if cp is None:
        return op(q, k, v, g, beta, initial_state, None)
    if cp.splits_heads:
        return head_all_to_all(lambda *xs: op(*xs, None), cp.axis, q, k, v, g, beta,
                               initial_state, cp.layout)
    o, final = op(q, k, v, g, beta, initial_state, Exchange(cp.axis, cp.strategy, cp.layout))
    return o, None if final is None else lax.psum(final, cp.axis)
