"""The sequential part in jnp: chunk-to-chunk state recurrences, forward and backward.

Chunks on axis 0 (NT), then batch B and value heads HV; per chunk the ChunkTerms of
``intra.py`` (w, u, kd [NT, B, HV, C, K|V], decay [NT, B, HV, Kg]) and the layout's
chunk_starts / chunk_seq / chunk_ends [NT, B]. States are [B, HV, K, V] float32.

Forward, per chunk c:   S_c   = init[seq_c] if starts_c else S_out(c-1)    (S_0 = h0 unless reset)
                        vn_c  = u_c - w_c S_c
                        S_out = decay_c * S_c + kd_c^T vn_c
Backward, per chunk c from the last, X_c = dL/dS_out(c) and dh_c = dL/dS_c:
                        dvn_c = attn_c^T do_c + kd_c X_c
                        dh_c  = decay_c * X_c + qg_c^T do_c - w_c^T dvn_c
                        X_c-1 = (0 if starts_c else dh_c) + [ends_c-1] dF[seq_c-1]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcp.layout import ChunkLayout
from jaxcp.vma import vary_like
from jaxcp.terms import ChunkTerms, einsum


def _reset(state, starts, seq, init):
    """The state entering a chunk: the sequence's initial state (or zero) on a reset."""
    fresh = jnp.zeros_like(state) if init is None else init[seq]
    return jnp.where(starts[:, None, None, None], fresh, state)


def _advance(state, w, u, kd, decay):
    """One chunk: returns (v_new, S_out); u None means the linear part only (u = 0)."""
    wS = einsum("bhck,bhkv->bhcv", w, state)
    v_new = -wS if u is None else u - wS
    return v_new, decay[..., :, None] * state + einsum("bhck,bhcv->bhkv", kd, v_new)


def state_fwd(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array):
    """Run the chunks from h0. Returns h [NT, B, HV, K, V] (state entering each chunk), v_new
    [NT, B, HV, C, V] and the state after the last chunk [B, HV, K, V]."""
    def step(state, xs):
        w, u, kd, decay, starts, seq = xs
        state = _reset(state, starts, seq, init)
        v_new, out = _advance(state, w, u, kd, decay)
        return out, (state, v_new)

    xs = (terms.w, terms.u, terms.kd, terms.decay, layout.chunk_starts, layout.chunk_seq)
    last, (h, v_new) = lax.scan(step, vary_like(h0, terms.w), xs)
    return h, v_new, last


def state_last(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, h0: jax.Array):
    """Only the state after the last chunk, starting from h0 [B, HV, K, V]."""
    def step(state, xs):
        w, u, kd, decay, starts, seq = xs
        return _advance(_reset(state, starts, seq, init), w, u, kd, decay)[1], None

    xs = (terms.w, terms.u, terms.kd, terms.decay, layout.chunk_starts, layout.chunk_seq)
    return lax.scan(step, vary_like(h0, terms.w), xs)[0]


def cp_summary(terms: ChunkTerms, layout: ChunkLayout, init: jax.Array | None, *,
               unused: jax.Array | None = None):
    """The device's affine map S_out = M S_in + S_ext over all its chunks.

    S_ext [B, HV, K, V] is the state reached from S_in = 0; M [B, HV, K, K] the product of
    the chunk transitions Diag(decay) - kd^T w, zero once a chunk resets (the state after a
    sequence start does not depend on what came before). unused (bool scalar: the caller
    never reads the result, which the Pallas twin then skips): both zero."""
    B, HV, _, K = terms.w.shape[1:]
    V = terms.u.shape[-1]
    ext0 = jnp.zeros((B, HV, K, V), jnp.float32)
    m0 = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, HV, K, K))

    def step(carry, xs):
        ext, m = carry
        w, u, kd, decay, starts, seq = xs
        ext = _advance(_reset(ext, starts, seq, init), w, u, kd, decay)[1]
        m = _advance(_reset(m, starts, seq, None), w, None, kd, decay)[1]
        return (ext, m), None

    xs = (terms.w, terms.u, terms.kd, terms.decay, layout.chunk_starts, layout.chunk_seq)
    (ext, m), _ = lax.scan(step, vary_like((ext0, m0), terms.w), xs)
    if unused is not None:
        ext, m = (jnp.where(unused, 0.0, x) for x in (ext, m))
    return ext, m


def final_states(terms: ChunkTerms, layout: ChunkLayout, h: jax.Array, v_new: jax.Array):
    """State after each sequence's last token, [N, HV, K, V]; zero for sequences that end on
    another device."""
    flat = lambda x: x.reshape(-1, *x.shape[2:])[layout.seq_last_chunk]
    hs, kd, vn, decay = flat(h), flat(terms.kd), flat(v_new), flat(terms.decay)
    out = decay[..., :, None] * hs + einsum("nhck,nhcv->nhkv", kd, vn)
    return jnp.where(layout.seq_ends_here[:, None, None, None], out, 0.0)


def state_bwd(terms: ChunkTerms, layout: ChunkLayout, do: jax.Array, d_final: jax.Array | None,
              d_last: jax.Array, *, with_d_init: bool = False, entry_only: bool = False,
              unused: jax.Array | None = None):
    """Reverse scan of the state gradient.

    do [NT, B, HV, C, V]: output cotangent; d_final [N, HV, K, V] or None: cotangent of the
    final states; d_last [B, HV, K, V]: cotangent of the state after the last chunk (from the
    devices after this one). Returns (d_entry, d_init, X, dvn): the gradient w.r.t. the
    state entering the first chunk (zero if it resets); with with_d_init the gradients
    w.r.t. the initial states [N, HV, K, V] (dh of each sequence's reset chunk, zero for
    sequences that start elsewhere), else None; X = dL/dS_out and dv_new per chunk. With
    entry_only, d_entry alone; then unused (bool scalar: the caller never reads it, which the
    Pallas twin then skips) makes it zero.
    """
    p = einsum("...ij,...iv->...jv", terms.attn, do)          # attn^T do   [NT, B, HV, C, V]
    qdo = einsum("...ck,...cv->...kv", terms.qg, do)           # qg^T do     [NT, B, HV, K, V]

    def step(carry, xs):
        w, kd, decay, p_c, qdo_c, starts, ends, seq = xs
        x = carry
        if d_final is not None:
            x = x + jnp.where(ends[:, None, None, None], d_final[seq], 0.0)
        dvn = p_c + einsum("bhck,bhkv->bhcv", kd, x)
        dh = decay[..., :, None] * x + qdo_c - einsum("bhck,bhcv->bhkv", w, dvn)
        is_start = starts[:, None, None, None]
        nxt = jnp.where(is_start, 0.0, dh)
        if entry_only:
            return nxt, None
        return nxt, (jnp.where(is_start, dh, 0.0) if with_d_init else None, x, dvn)

    xs = (terms.w, terms.kd, terms.decay, p, qdo, layout.chunk_starts, layout.chunk_ends,
          layout.chunk_seq)
    d_entry, ys = lax.scan(step, vary_like(d_last, terms.w), xs, reverse=True)
    if entry_only:
        return d_entry if unused is None else jnp.where(unused, 0.0, d_entry)
    dh_starts, x, dvn = ys
    d_init = None
    if with_d_init:
        flat = dh_starts.reshape(-1, *dh_starts.shape[2:])
        d_init = jax.ops.segment_sum(flat, layout.chunk_seq.reshape(-1),
                                     layout.seq_ends_here.shape[0])
    return d_entry, d_init, x, dvn
