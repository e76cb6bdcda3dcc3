"""Blockwise (flash-style) masked softmax attention in jnp, memory linear in the sequence length.

    o_i = sum_j softmax_j(s_ij) v_j,   s_ij = scale * q_i . k_j  where visible(i, j), else -inf
    visible(i, j) = k_pos[j] <= q_pos[i]  and  k_seq[j] == q_seq[i]

Queries are cut into chunks of block_q tokens and keys/values into blocks of block_k tokens (the
last of each zero-padded, padded tokens visible to nothing). For each query chunk the loop runs
over the key blocks [lo, hi) that can hold a visible key, keeping the online-softmax statistics
in float32: running max m, running sum l and accumulator acc,

    m' = max(m, max_j s_ij),   l' = e^(m - m') l + sum_j e^(s_ij - m'),
    acc' = e^(m - m') acc + sum_j e^(s_ij - m') v_j,   o = acc / l,   lse = m + log l.

The backward pass (custom_vjp) stores q, k, v, o and lse only and recomputes each block's
probabilities p_ij = e^(s_ij - lse_i); with delta_i = do_i . o_i,

    dv_j = sum_i p_ij do_i,   ds_ij = p_ij (do_i . v_j - delta_i),
    dq_i = scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i,

looping over key blocks and, inside, over the query chunks that can see them. No [T_q, T_k]
array is formed; the largest transient is one block of logits [B, H, block_q, block_k].
Grouped-query attention (H query heads over G = H / R key/value heads) runs on q viewed as
[B, G, R, T_q, D], without repeating k and v.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.vma import unify, vary_like

_NO_POS = jnp.iinfo(jnp.int32).max     # key padding: after every query
_NO_SEQ = -1                           # key padding: in no sequence
_MIN_INIT = -1e30                      # running max before the first visible key (finite)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                        q_seq: jax.Array, k_pos: jax.Array, k_seq: jax.Array, *,
                        scale: float | None = None, block_q: int = 1024,
                        block_k: int = 1024) -> jax.Array:
    """Masked softmax attention, q [B, T_q, H, D], k and v [B, T_k, G, D] (H % G == 0) ->
    [B, T_q, H, D] in q's dtype.

    q_pos, q_seq [T_q] and k_pos, k_seq [T_k] are int32 positions and sequence ids (>= 0),
    shared by the batch; query i sees key j iff k_pos[j] <= q_pos[i] and k_seq[j] == q_seq[i].
    scale defaults to D^-1/2. block_q, block_k: chunk sizes (capped at T_q, T_k); logits and
    softmax statistics are float32, the products take the operands' dtype with float32
    accumulation. A query row with no visible key gives zeros.
    """
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [B, T_q, H, D] and k, v [B, T_k, G, D], got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    B, T_q, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or H % k.shape[2]:
        raise ValueError(f"k {k.shape} does not match q {q.shape} (same B and D, H % G == 0)")
    T_k = k.shape[1]
    for name, a, n in (("q_pos", q_pos, T_q), ("q_seq", q_seq, T_q), ("k_pos", k_pos, T_k),
                       ("k_seq", k_seq, T_k)):
        if a.shape != (n,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer vector of length {n}, got "
                             f"{a.dtype} {a.shape}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    scale = D ** -0.5 if scale is None else float(scale)
    ints = [a.astype(jnp.int32) for a in (q_pos, q_seq, k_pos, k_seq)]
    (q, k, v, *ints), _ = unify([q, k, v, *ints])
    return _attention(q, k, v, *ints, scale, min(block_q, T_q), min(block_k, T_k))


def _blocks(x: jax.Array, axis: int, size: int, fill) -> jax.Array:
    """Pad `axis` of x to a multiple of size with fill and split it: [n, ..., size, ...]."""
    n = -(-x.shape[axis] // size)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n * size - x.shape[axis])
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblock(x: jax.Array, axis: int, length: int) -> jax.Array:
    """Inverse of _blocks: [n, ..., size, ...] -> [..., length, ...] (axis counted after it)."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return lax.slice_in_dim(x, 0, length, axis=axis)


class _Layout:
    """Blocked operands and, per query chunk and key block, the loop ranges.

    q [nq, B, G, R, bq, D]; k, v [nk, B, G, bk, D]; positions and ids [nq, bq] / [nk, bk].
    needed[i, j]: chunk i and block j may hold a visible pair (each condition is necessary), so
    the visible keys of chunk i lie in blocks [k_lo[i], k_hi[i]) and the queries that see block
    j in chunks [q_lo[j], q_hi[j]); empty ranges are [0, 0)."""

    def __init__(self, q, k, v, q_pos, q_seq, k_pos, k_seq, bq, bk):
        B, T_q, H, D = q.shape
        G = k.shape[2]
        self.q = _blocks(q.reshape(B, T_q, G, H // G, D).transpose(0, 2, 3, 1, 4), 3, bq, 0)
        self.k = _blocks(k.transpose(0, 2, 1, 3), 2, bk, 0)
        self.v = _blocks(v.transpose(0, 2, 1, 3), 2, bk, 0)
        self.q_pos = _blocks(q_pos, 0, bq, -1)
        self.q_seq = _blocks(q_seq, 0, bq, _NO_SEQ - 1)
        self.k_pos = _blocks(k_pos, 0, bk, _NO_POS)
        self.k_seq = _blocks(k_seq, 0, bk, _NO_SEQ)
        q_real = _blocks(jnp.ones(T_q, bool), 0, bq, False)
        k_real = _blocks(jnp.ones(k.shape[1], bool), 0, bk, False)
        big = jnp.iinfo(jnp.int32).max
        q_max_pos = jnp.max(self.q_pos, 1)
        q_min_seq = jnp.min(jnp.where(q_real, self.q_seq, big), 1)
        q_max_seq = jnp.max(self.q_seq, 1)
        k_min_pos = jnp.min(self.k_pos, 1)
        k_min_seq = jnp.min(jnp.where(k_real, self.k_seq, big), 1)
        k_max_seq = jnp.max(self.k_seq, 1)
        needed = ((k_min_pos[None, :] <= q_max_pos[:, None])
                  & (k_max_seq[None, :] >= q_min_seq[:, None])
                  & (k_min_seq[None, :] <= q_max_seq[:, None]))
        self.k_lo, self.k_hi = _span(needed)
        self.q_lo, self.q_hi = _span(needed.T)


def _span(needed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of a boolean [n, m]: the smallest [lo, hi) holding its True entries."""
    m = needed.shape[1]
    any_ = jnp.any(needed, 1)
    lo = jnp.argmax(needed, 1)
    hi = m - jnp.argmax(needed[:, ::-1], 1)
    return jnp.where(any_, lo, 0).astype(jnp.int32), jnp.where(any_, hi, 0).astype(jnp.int32)


def _logits(q_i, k_j, qp, qs, kp, ks, scale):
    """Masked float32 logits of one chunk/block pair: [B, G, R, bq, bk], -inf where hidden."""
    s = jnp.einsum("bgrqd,bgkd->bgrqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
    visible = (kp[None, :] <= qp[:, None]) & (ks[None, :] == qs[:, None])
    return jnp.where(visible, s, -jnp.inf)


def _take(x: jax.Array, i: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _forward(lay: _Layout, scale: float):
    """o [nq, B, G, R, bq, D] (q's dtype) and lse [nq, B, G, R, bq] (float32; +inf where a
    row sees no key)."""
    def chunk(_, xs):
        q_i, qp, qs, lo, hi = xs

        def block(j, carry):
            m, l, acc = carry
            v_j = _take(lay.v, j)
            s = _logits(q_i, _take(lay.k, j), qp, qs, _take(lay.k_pos, j), _take(lay.k_seq, j),
                        scale)
            m_new = jnp.maximum(m, jnp.max(s, -1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bgrqk,bgkd->bgrqd", p.astype(v_j.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return m_new, alpha * l + jnp.sum(p, -1), alpha[..., None] * acc + pv

        stats = q_i.shape[:-1]
        init = vary_like((jnp.full(stats, _MIN_INIT, jnp.float32), jnp.zeros(stats, jnp.float32),
                          jnp.zeros(q_i.shape, jnp.float32)), q_i)
        m, l, acc = lax.fori_loop(lo, hi, block, init)
        seen = l > 0
        o = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return None, (o.astype(q_i.dtype), lse)

    _, (o, lse) = lax.scan(chunk, None, (lay.q, lay.q_pos, lay.q_seq, lay.k_lo, lay.k_hi))
    return o, lse


def _backward(lay: _Layout, o, lse, do, scale: float):
    """dq [nq, B, G, R, bq, D], dk and dv [nk, B, G, bk, D], float32."""
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)

    def block(dq, xs):
        k_j, v_j, kp, ks, lo, hi = xs

        def chunk(i, carry):
            dq, dk, dv = carry
            q_i, do_i = _take(lay.q, i), _take(do, i)
            s = _logits(q_i, k_j, _take(lay.q_pos, i), _take(lay.q_seq, i), kp, ks, scale)
            p = jnp.exp(s - _take(lse, i)[..., None])
            dv = dv + jnp.einsum("bgrqk,bgrqd->bgkd", p.astype(do_i.dtype), do_i,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bgrqd,bgkd->bgrqk", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - _take(delta, i)[..., None])
            dq_i = jnp.einsum("bgrqk,bgkd->bgrqd", ds.astype(k_j.dtype), k_j,
                              preferred_element_type=jnp.float32) * scale
            dq = lax.dynamic_update_index_in_dim(dq, _take(dq, i) + dq_i, i, 0)
            dk = dk + jnp.einsum("bgrqk,bgrqd->bgkd", ds.astype(q_i.dtype), q_i,
                                 preferred_element_type=jnp.float32) * scale
            return dq, dk, dv

        zeros = vary_like(jnp.zeros(k_j.shape, jnp.float32), dq)
        dq, dk, dv = lax.fori_loop(lo, hi, chunk, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = vary_like(jnp.zeros(lay.q.shape, jnp.float32), do)
    dq, (dk, dv) = lax.scan(block, dq0, (lay.k, lay.v, lay.k_pos, lay.k_seq, lay.q_lo, lay.q_hi))
    return dq, dk, dv


def _unblock_q(x: jax.Array, T_q: int) -> jax.Array:
    """[nq, B, G, R, bq, D] -> [B, T_q, G * R, D]."""
    x = _unblock(x, 3, T_q)
    B, G, R, _, D = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(B, T_q, G * R, D)


def _unblock_kv(x: jax.Array, T_k: int) -> jax.Array:
    """[nk, B, G, bk, D] -> [B, T_k, G, D]."""
    return _unblock(x, 2, T_k).transpose(0, 2, 1, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q, k, v, q_pos, q_seq, k_pos, k_seq, scale, bq, bk):
    return _attention_fwd(q, k, v, q_pos, q_seq, k_pos, k_seq, scale, bq, bk)[0]


def _attention_fwd(q, k, v, q_pos, q_seq, k_pos, k_seq, scale, bq, bk):
    lay = _Layout(q, k, v, q_pos, q_seq, k_pos, k_seq, bq, bk)
    o, lse = _forward(lay, scale)
    return _unblock_q(o, q.shape[1]), (q, k, v, q_pos, q_seq, k_pos, k_seq, o, lse)


def _attention_bwd(scale, bq, bk, res, do):
    q, k, v, q_pos, q_seq, k_pos, k_seq, o, lse = res
    lay = _Layout(q, k, v, q_pos, q_seq, k_pos, k_seq, bq, bk)
    B, T_q, H, D = q.shape
    G = k.shape[2]
    do = _blocks(do.reshape(B, T_q, G, H // G, D).transpose(0, 2, 3, 1, 4), 3, bq, 0)
    dq, dk, dv = _backward(lay, o, lse, do.astype(q.dtype), scale)
    T_k = k.shape[1]
    return (_unblock_q(dq, T_q).astype(q.dtype), _unblock_kv(dk, T_k).astype(k.dtype),
            _unblock_kv(dv, T_k).astype(v.dtype), None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
