"""The oracle against a plain float64 loop, and varlen against separate sequences."""
import numpy as np
import pytest
import jax.numpy as jnp

from helpers import OPS, assert_rel, make_inputs


def numpy_delta_rule(q, k, v, g, beta, scale, h0):
    """One sequence, one head, float64: S [K, V]; g [T] or [T, K]."""
    S = h0.astype(np.float64).copy()
    out = []
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[..., None] if g.ndim == 2 else np.exp(g[t])
        v_new = (v[t] - S.T @ k[t]) * beta[t]
        S += np.outer(k[t], v_new)
        out.append(S.T @ (scale * q[t]))
    return np.stack(out), S


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reference_matches_numpy_loop(kind):
    q, k, v, g, beta, h0 = make_inputs(kind, 2, 37, 1, 2, 16, 32, n_states=2)
    o, final = OPS[kind][1](q, k, v, g, beta, initial_state=h0, output_final_state=True)
    f64 = lambda x: np.asarray(x, np.float64)
    for b in range(2):
        for hv in range(2):
            o_np, s_np = numpy_delta_rule(f64(q[b, :, 0]), f64(k[b, :, 0]), f64(v[b, :, hv]),
                                          f64(g[b, :, hv]), f64(beta[b, :, hv]), 16 ** -0.5,
                                          f64(h0[b, hv]))
            assert_rel(o[b, :, hv], o_np, 1e-5, "o")
            assert_rel(final[b, hv], s_np, 1e-5, "final state")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_reference_varlen_is_separate_sequences(kind):
    cu = [0, 1, 9, 30, 31]
    q, k, v, g, beta, h0 = make_inputs(kind, 1, 31, 2, 2, 16, 16, n_states=4)
    ref = OPS[kind][1]
    o, final = ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                   cu_seqlens=jnp.asarray(cu, jnp.int32), use_qk_l2norm_in_kernel=True)
    for n in range(4):
        s = slice(cu[n], cu[n + 1])
        o_n, f_n = ref(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=h0[n:n + 1],
                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_rel(o[:, s], o_n, 1e-6, f"o of sequence {n}")
        assert_rel(final[n], f_n[0], 1e-6, f"final state of sequence {n}")
