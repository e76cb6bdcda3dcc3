"""Causal attention of one device's queries over every earlier key of the sequence, with the
keys and values passed around the devices in a ring (one unpacked sequence under CP).

``prefix.gathered_causal_attention`` all-gathers the whole sequence's keys and values, and its
backward holds their cotangents too: at 524,288 tokens per device that is the largest memory
of a training step. Here each device holds one other device's block of keys and values at a
time (and, in the backward, the cotangent block travelling with it): memory O(T_local).

Device r's block (its pieces of the sequence, ``cp.split``) travels r -> r + 1 -> ...; at hop
s device r holds the block of device src = (r - s) mod W. Each local query piece attends each
piece of that block (``AttentionPieces``): causally to its own piece (hop 0), to all of a
piece earlier in the sequence (a prefix covering the whole piece), and not at all to a later
one. The parts merge by their log-sum-exp as they come,

    lse <- logaddexp(lse, lse_p),   o <- e^(lse_old - lse) o + e^(lse_p - lse) o_p,

and the backward runs the ring again with the merged o and lse: each hop adds the part's dq
locally and its dk, dv to a cotangent block that travels with the keys (in the keys' dtype,
as the all-gather's reduce-scatter sums them); one last hop returns every cotangent block to
its owner. Every device does the same work as under the all-gather.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.attention.pieces import AttentionPieces
from jaxcp.vma import match_cotangent, vary_like


def _split(x: jax.Array, n_pieces: int) -> list[jax.Array]:
    """[B, T_local, ...] -> the local pieces [B, T_local / n_pieces, ...]."""
    P = x.shape[1] // n_pieces
    return [x[:, i * P:(i + 1) * P] for i in range(n_pieces)]


def _own_pairs(cp_layout: str) -> list[tuple[int, int, bool]]:
    """Hop 0, a device's own block: (query piece, key piece, causal) of each pair that sees
    anything. Zigzag: the late piece 2W - 1 - r sees all of the early piece r."""
    if cp_layout == "contiguous":
        return [(0, 0, True)]
    return [(0, 0, True), (1, 1, True), (1, 0, False)]


def _ring_pairs(cp_layout: str, rank: jax.Array, src: jax.Array):
    """Hops >= 1, device src's block: (query piece, key piece, visible) of each pair that
    may see anything; visible is a traced bool, or True. Zigzag: the early piece r sees the
    early piece src when src < r and never a late piece; the late piece 2W - 1 - r sees every
    early piece, and the late piece 2W - 1 - src when src > r."""
    if cp_layout == "contiguous":
        return [(0, 0, src < rank)]
    return [(0, 0, src < rank), (1, 0, True), (1, 1, src > rank)]


def _prefix(visible, length: int):
    """The prefix length of a part that sees a whole key piece of `length` tokens when
    visible; one key (weighed out) when not."""
    if visible is True:
        return jnp.int32(length)
    return jnp.where(visible, length, 1).astype(jnp.int32)


def _add_part(acc, part, visible):
    """Merge a part's (o [B, T, N, D], lse [B, N, T]) into the running (o float32, lse)."""
    o, lse = acc
    o_p, lse_p = part
    if visible is not True:
        lse_p = jnp.where(visible, lse_p, -jnp.inf)
    new = jnp.logaddexp(lse, lse_p)
    weight = lambda l: jnp.exp(l - new).transpose(0, 2, 1)[..., None]
    return weight(lse) * o + weight(lse_p) * o_p.astype(jnp.float32), new


def _shift(x, axis: str, W: int):
    """Send x (a pytree) from every device r to r + 1 mod W."""
    return lax.ppermute(x, axis, [(i, (i + 1) % W) for i in range(W)])


def _ring_forward(pieces, axis, cp_layout, scale, q, k, v):
    W, rank = lax.axis_size(axis), lax.axis_index(axis)
    n = 1 if cp_layout == "contiguous" else 2
    qs, ks, vs = _split(q, n), _split(k, n), _split(v, n)
    P = ks[0].shape[1]
    acc = [None] * n
    for qi, kj, causal in _own_pairs(cp_layout):
        o_p, lse_p = pieces.forward(qs[qi], ks[kj], vs[kj], None if causal else jnp.int32(P),
                                    scale)
        acc[qi] = ((o_p.astype(jnp.float32), lse_p) if acc[qi] is None
                   else _add_part(acc[qi], (o_p, lse_p), True))

    def attend(s, block, acc):
        (k_b, v_b), src = block, (rank - s) % W
        k_src, v_src = _split(k_b, n), _split(v_b, n)
        acc = list(acc)
        for qi, kj, visible in _ring_pairs(cp_layout, rank, src):
            part = pieces.forward(qs[qi], k_src[kj], v_src[kj], _prefix(visible, P), scale)
            acc[qi] = _add_part(acc[qi], part, visible)
        return tuple(acc)

    if W > 1:
        def hop(s, carry):
            block, acc = carry
            # the next hop's block is on its way while this one is attended to
            return _shift(block, axis, W), attend(s, block, acc)

        block, acc = lax.fori_loop(1, W - 1, hop, (_shift((k, v), axis, W), tuple(acc)))
        acc = attend(W - 1, block, acc)
    o = jnp.concatenate([o_i for o_i, _ in acc], axis=1).astype(q.dtype)
    lse = jnp.concatenate([lse_i for _, lse_i in acc], axis=2)
    return o, lse


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring_attention(pieces, axis, cp_layout, scale, q, k, v):
    return _ring_forward(pieces, axis, cp_layout, scale, q, k, v)[0]


def _ring_attention_fwd(pieces, axis, cp_layout, scale, q, k, v):
    o, lse = _ring_forward(pieces, axis, cp_layout, scale, q, k, v)
    return o, (q, k, v, o, lse)


def _ring_attention_bwd(pieces, axis, cp_layout, scale, res, do):
    q, k, v, o, lse = res
    W, rank = lax.axis_size(axis), lax.axis_index(axis)
    n = 1 if cp_layout == "contiguous" else 2
    qs, ks, vs, os_, dos = (_split(x, n) for x in (q, k, v, o, do))
    lses = [lse[..., i * qs[0].shape[1]:(i + 1) * qs[0].shape[1]] for i in range(n)]
    P = ks[0].shape[1]
    part_grads = lambda qi, k_p, v_p, prefix: pieces.backward(qs[qi], k_p, v_p, prefix, scale,
                                                              os_[qi], lses[qi], dos[qi])
    zeros = lambda xs: [vary_like(jnp.zeros(x.shape, jnp.float32), q) for x in xs]
    dq, dk, dv = zeros(qs), zeros(ks), zeros(vs)
    for qi, kj, causal in _own_pairs(cp_layout):
        dq_p, dk_p, dv_p = part_grads(qi, ks[kj], vs[kj], None if causal else jnp.int32(P))
        dq[qi] = dq[qi] + dq_p.astype(jnp.float32)
        dk[kj] = dk[kj] + dk_p.astype(jnp.float32)
        dv[kj] = dv[kj] + dv_p.astype(jnp.float32)

    def attend(s, block, d_block, dq):
        (k_b, v_b), (dk_b, dv_b), src = block, d_block, (rank - s) % W
        k_src, v_src = _split(k_b, n), _split(v_b, n)
        dk_src, dv_src = _split(dk_b, n), _split(dv_b, n)
        dq = list(dq)
        for qi, kj, visible in _ring_pairs(cp_layout, rank, src):
            dq_p, dk_p, dv_p = part_grads(qi, k_src[kj], v_src[kj], _prefix(visible, P))
            if visible is not True:
                dq_p, dk_p, dv_p = (jnp.where(visible, x, jnp.zeros((), x.dtype))
                                    for x in (dq_p, dk_p, dv_p))
            dq[qi] = dq[qi] + dq_p.astype(jnp.float32)
            dk_src[kj] = dk_src[kj] + dk_p.astype(dk_b.dtype)
            dv_src[kj] = dv_src[kj] + dv_p.astype(dv_b.dtype)
        joined = (jnp.concatenate(dk_src, axis=1), jnp.concatenate(dv_src, axis=1))
        return joined, tuple(dq)

    d_own = (jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1))
    if W > 1:
        def hop(s, carry):
            block, d_block, dq = carry
            d_block, dq = attend(s, block, d_block, dq)
            return _shift(block, axis, W), _shift(d_block, axis, W), dq

        zeros = vary_like((jnp.zeros_like(k), jnp.zeros_like(v)), k)
        block, d_block, dq = lax.fori_loop(1, W - 1, hop,
                                           (_shift((k, v), axis, W), zeros, tuple(dq)))
        d_block, dq = attend(W - 1, block, d_block, dq)
        # one more hop brings every cotangent block home
        d_home = _shift(d_block, axis, W)
        d_own = tuple(a + b.astype(jnp.float32) for a, b in zip(d_own, d_home))
    grads = (jnp.concatenate(dq, axis=1).astype(q.dtype), d_own[0].astype(k.dtype),
             d_own[1].astype(v.dtype))
    return tuple(match_cotangent(g, p) for g, p in zip(grads, (q, k, v)))


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def ring_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str,
                          pieces: AttentionPieces, scale: float | None = None,
                          cp_layout: str = "contiguous") -> jax.Array:
    """Inside shard_map with the sequence split over `axis` in cp_layout (``cp.split``; this
    device's q [B, T, N, D], k, v [B, T, G, D] of one unpacked sequence): attend causally to
    every earlier token of the sequence, the keys and values passed around the devices
    (module docstring). The same result as ``prefix.gathered_causal_attention``."""
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q must be [B, T, N, D] and k, v [B, T, G, D] of the same tokens; "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _ring_attention(pieces, axis, cp_layout, scale, q, k, v)
