"""Pallas (Triton-lowered) intra-chunk terms of GDN, one program per (chunk, batch, head).

Twin of ``jaxcp.xla.intra.intra_chunk`` for a scalar gate (Kg = 1), same layout: q, k [NT, B, HV, C, K], v [NT, B, HV, C, V], g [NT, B, HV, C, 1],
beta [NT, B, HV, C].

Forward, with G = cumsum(g) inside the chunk and E_ij = exp(G_i - G_j):

    A     = strict_lower(beta_i (k_i . k_j) E_ij)
    T     = (I + A)^-1 = (I - A)(I + A^2)(I + A^4) ... (I + A^(C/2))    (A^C = 0)
    w     = T X,  X = beta exp(G) k;      u = T Y,  Y = beta v
    qg    = scale exp(G) q,   kd = exp(G_C - G) k,   decay = exp(G_C)
    attn  = lower(scale (q_i . k_j) E_ij)

The inverse is log2(C) - 1 squarings and as many products, all tensor-core dots (forward
substitution would be C dependent row updates).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcp.pallas.state import _params
from jaxcp.vma import unify
from jaxcp.xla.intra import ChunkTerms


class _Dots(NamedTuple):
    """a @ b of fp32 tiles at two precisions: `plain` for the products, `inverse` for the
    chain of products that builds (I + A)^-1 (rounding there compounds)."""
    plain: callable
    inverse: callable


def _dots(precise: bool, interpret: bool) -> _Dots:
    """precise: IEEE fp32 everywhere (fp32 inputs). Otherwise (bf16 inputs) TF32 products and
    3xTF32 for the inverse. Interpret mode on the CPU computes IEEE fp32 in both cases."""
    def dot(precision):
        return partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    if precise or interpret:
        return _Dots(dot(lax.Precision.HIGHEST), dot(lax.Precision.HIGHEST))
    return _Dots(dot(None), dot(lax.DotAlgorithmPreset.TF32_TF32_F32_X3))


def _unit_lower_inverse(a, eye, dot):
    """(I + a)^-1 of a strictly lower [n, n] a (n a power of two) as the product
    (I - a)(I + a^2)(I + a^4) ... (I + a^(n/2))."""
    inv, power, m = eye - a, a, 2
    while m < a.shape[0]:
        power = dot(power, power)
        inv = inv + dot(inv, power)
        m *= 2
    return inv


class _Chunk(NamedTuple):
    """The forward quantities of one chunk that the backward reuses."""
    G: jax.Array          # [C]
    eg: jax.Array         # exp(G) [C]
    strict: jax.Array     # E masked to j < i [C, C]
    causal: jax.Array     # E masked to j <= i [C, C]
    kk: jax.Array         # k k^T [C, C]
    a: jax.Array          # A [C, C]
    inv: jax.Array        # T [C, C]
    x: jax.Array          # beta exp(G) k [C, K]
    tail: jax.Array       # exp(G_C - G) [C]


def _chunk(k, g, beta, dots: _Dots) -> _Chunk:
    """The parts of one chunk's forward that do not involve q or v."""
    C = k.shape[0]
    G = jnp.cumsum(g)
    rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    cols = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    diff = G[:, None] - G[None, :]
    strict = jnp.exp(jnp.where(rows > cols, diff, -jnp.inf))
    causal = jnp.exp(jnp.where(rows >= cols, diff, -jnp.inf))
    kk = dots.plain(k, k.T)
    a = beta[:, None] * kk * strict
    inv = _unit_lower_inverse(a, jnp.where(rows == cols, 1.0, 0.0), dots.inverse)
    eg = jnp.exp(G)
    return _Chunk(G, eg, strict, causal, kk, a, inv, k * (beta * eg)[:, None],
                  jnp.exp(jnp.sum(g) - G))


def _load(*refs):
    return [r[...].astype(jnp.float32) for r in refs]


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kd_ref, attn_ref,
                  *, scale, dots):
    q, k, v, g, beta = _load(q_ref, k_ref, v_ref, g_ref, beta_ref)
    c = _chunk(k, g, beta, dots)
    w_ref[...] = dots.plain(c.inv, c.x).astype(w_ref.dtype)
    u_ref[...] = dots.plain(c.inv, v * beta[:, None]).astype(u_ref.dtype)
    qg_ref[...] = (q * (c.eg * scale)[:, None]).astype(qg_ref.dtype)
    kd_ref[...] = (k * c.tail[:, None]).astype(kd_ref.dtype)
    attn_ref[...] = (dots.plain(q, k.T) * c.causal * scale).astype(attn_ref.dtype)


def _specs(C: int):
    tile = lambda d: pl.BlockSpec((None, None, None, C, d), lambda t, b, h: (t, b, h, 0, 0))
    vec = pl.BlockSpec((None, None, None, C), lambda t, b, h: (t, b, h, 0))
    return tile, vec


def intra_chunk(q, k, v, g, beta, scale: float, *, interpret: bool = False,
                precise: bool = True, out_dtype=jnp.float32) -> ChunkTerms:
    """Twin of xla.intra.intra_chunk for GDN (g [..., C, 1]). precise=False (bf16 inputs)
    runs the products in TF32; out_dtype is the dtype of w, u, qg, kd and attn (decay stays
    float32)."""
    NT, B, HV, C, K = k.shape
    V = v.shape[-1]
    tile, vec = _specs(C)
    args, mat = unify([q, k, v, g[..., 0], beta])
    out = lambda *s: jax.ShapeDtypeStruct((NT, B, HV) + s, out_dtype, manual_axis_type=mat)
    w, u, qg, kd, attn = pl.pallas_call(
        partial(_intra_kernel, scale=scale, dots=_dots(precise, interpret)), grid=(NT, B, HV),
        in_specs=[tile(K), tile(K), tile(V), vec, vec],
        out_specs=[tile(K), tile(V), tile(K), tile(K), tile(C)],
        out_shape=[out(C, K), out(C, V), out(C, K), out(C, K), out(C, C)],
        **_params(interpret, 0))(*args)
    decay = jnp.exp(jnp.sum(g.astype(jnp.float32), axis=-2))
    return ChunkTerms(w=w, u=u, qg=qg, kd=kd, decay=decay, attn=attn)

