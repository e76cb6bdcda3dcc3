"""Inputs, error measures and losses shared by the tests."""
from __future__ import annotations

import os

import chex
import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxcp
from jaxcp.metrics import rel_error as rel_err

OPS = {"gdn": (jaxcp.chunk_gated_delta_rule, jaxcp.gated_delta_rule_reference),
       "kda": (jaxcp.chunk_kda, jaxcp.kda_reference)}
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def make_inputs(kind: str, B: int, T: int, H: int, HV: int, K: int, V: int, *, dtype=jnp.float32,
                n_states: int | None = None, seed: int = 0, correlated_keys: bool = False):
    """Random non-zero q, k, v, g (logsigmoid of normals: decays in (0, 1)), beta, and initial
    states [n_states, HV, K, V] (None if n_states is None). correlated_keys: the keys of a head
    share one direction (plus 10 % noise) and the decays are 10x weaker, as for the repeated
    tokens of real data: A = beta k k^T E is then far from small."""
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    g = jax.nn.log_sigmoid(r(B, T, HV) if kind == "gdn" else r(B, T, HV, K) + 2.0)
    if correlated_keys:
        k = 0.1 * k + r(1, 1, H, K)
        g = g / 10
    beta = jax.nn.sigmoid(r(B, T, HV))
    h0 = None if n_states is None else r(n_states, HV, K, V)
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (h0,)


def assert_rel(out, ref, tol: float, what: str = "") -> None:
    err = rel_err(out, ref)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.0e}"


def cotangents(o_shape, f_shape, seed: int = 1):
    """Random cotangents for the output and the final state."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(o_shape), jnp.float32),
            jnp.asarray(rng.standard_normal(f_shape), jnp.float32))


def loss_of(fn, wo, wf, **kw):
    """L(q, k, v, g, beta, h0) = <o, wo> + <final_state, wf>."""
    def loss(q, k, v, g, beta, h0):
        o, final = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(final * wf)
    return loss


def value_and_grads(fn, args, wo, wf, **kw):
    """(o, final_state) and the gradients w.r.t. q, k, v, g, beta and h0."""
    out = fn(*args[:5], initial_state=args[5], output_final_state=True, **kw)
    grads = jax.grad(loss_of(fn, wo, wf, **kw), argnums=tuple(range(6)))(*args)
    return out, grads


def assert_sequences_isolated(kind: str, run, args, cu_seqlens, clean) -> None:
    """A NaN in v at the last token of the sequence before the longest one and a NaN (KDA)
    or -inf (GDN) gate at the first token of the sequence after it reach nothing of the
    longest one, which the layouts of the tests spread over several devices (or segments):
    its o, final state and every gradient stay finite and equal the clean run's (a sequence
    start selects, never multiplies by zero: ``cp.merge``). And the poison took: the earlier
    sequence's o and the later one's gradients are not finite.

    run: the jitted (q, k, v, g, beta, h0) -> ((o, final state), (dq, dk, dv, dg, dbeta,
    dh0)) that gave `clean`; it runs again on the same shapes, so nothing compiles."""
    starts = np.asarray(cu_seqlens)
    n = int(np.argmax(np.diff(starts)))
    assert 0 < n < len(starts) - 2, f"the longest sequence of {starts} needs neighbours"
    a_last, c_first = int(starts[n]) - 1, int(starts[n + 1])
    q, k, v, g, beta, h0 = args
    g_poison = -jnp.inf if kind == "gdn" else jnp.nan
    poisoned = run(q, k, v.at[:, a_last].set(jnp.nan), g.at[:, c_first].set(g_poison), beta,
                   h0)

    def sequence(result):
        (o, final), (dq, dk, dv, dg, dbeta, dh0) = result
        tokens = slice(int(starts[n]), int(starts[n + 1]))
        return (o[:, tokens], final[n], *(x[:, tokens] for x in (dq, dk, dv, dg, dbeta)),
                dh0[n])

    chex.assert_tree_all_finite(sequence(poisoned))
    chex.assert_trees_all_close(sequence(poisoned), sequence(clean), rtol=1e-6, atol=1e-6)
    (o, _), (dq, *_) = poisoned
    assert not np.isfinite(np.asarray(o[:, a_last], np.float32)).all(), "the NaN in v took"
    assert not np.isfinite(np.asarray(dq[:, c_first], np.float32)).all(), "the gate took"


def cp_call(op, mesh, axis: str, *, check_vma: bool = True, cp_layout: str = "contiguous",
            **kw):
    """op under jax.jit + shard_map, the sequence dimension split over `axis` in cp_layout
    (inputs and o in sequence order: permuted into the layout and back around the call)."""
    seq, rep = P(None, axis), P()
    W = mesh.shape[axis]

    def body(q, k, v, g, beta, h0):
        return op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cp_axis=axis,
                  cp_layout=cp_layout, **kw)

    def call(q, k, v, g, beta, *, initial_state, output_final_state):
        f = jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 5 + (rep,), out_specs=(seq, rep),
                          check_vma=check_vma)
        laid = [jaxcp.to_layout(x, cp_layout, W) for x in (q, k, v, g, beta)]
        o, final = f(*laid, initial_state)
        return jaxcp.from_layout(o, cp_layout, W), final

    return call


def attention_inputs(T: int, N: int, G: int, D: int, seed: int = 0):
    """q [1, T, N, D], k, v [1, T, G, D] and an output cotangent [1, T, N, D], normal."""
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return r(1, T, N, D), r(1, T, G, D), r(1, T, G, D), r(1, T, N, D)


def whole_causal_attention(q, k, v):
    """The causal softmax attention of one sequence (``blockwise_attention``): the
    reference of every split of it."""
    from jaxcp.attention.blockwise import blockwise_attention
    pos = jnp.arange(q.shape[1])
    zero = jnp.zeros_like(pos)
    return blockwise_attention(q, k, v, pos, zero, pos, zero, block_q=8, block_k=8)


def xla_flags_with_devices(n: int) -> str:
    """This process's XLA_FLAGS (conftest's compile settings) with n fake CPU devices, for a
    child process."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
