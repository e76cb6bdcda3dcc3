"""Recurrent (decoding) ops: a few tokens per call from a state, for generation.

Per value head and token, from the state S [K, V] float32 (``reference`` has the same steps):

    S <- S * exp(g_t)  (KDA: row d of S times exp(g_t[d]));   v' = (v_t - S^T k_t) beta_t
    S <- S + k_t v'^T;                                          o_t = S^T (scale q_t)

The states come from a table: ``initial_state`` [N, HV, K, V], row b of the batch reading row
b of the table, or, with ``state_indices`` [B], row state_indices[b] (continuous batching: a
row of the batch may sit anywhere in the table; -1: start from zero and keep no state). The
op returns the outputs and the table with the rows it read replaced by their new states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcp.checks import check_backend, check_gate_activation, check_operands
from jaxcp.gate import Gate, decay_from_raw
from jaxcp.pallas.triton.common.recurrent import recurrent_step
from jaxcp.reference import token_recurrence
from jaxcp.stages import resolve_backend


def _check(gate: Gate, q, k, v, g, beta, scale, initial_state, state_indices) -> None:
    check_operands(gate, q, k, v, g, beta, scale=scale)
    B, K = q.shape[0], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices selects rows of initial_state: pass the table too")
        if (not hasattr(state_indices, "dtype")
                or not jnp.issubdtype(state_indices.dtype, jnp.integer)
                or tuple(state_indices.shape) != (B,)):
            raise TypeError(f"state_indices must be an int array [B={B}], got "
                            f"{getattr(state_indices, 'dtype', type(state_indices).__name__)} "
                            f"{tuple(getattr(state_indices, 'shape', ()))}")
    if initial_state is not None:
        want = f"[N, HV={HV}, K={K}, V={V}]"
        if initial_state.ndim != 4 or tuple(initial_state.shape[1:]) != (HV, K, V):
            raise ValueError(f"initial_state must be {want}, got {tuple(initial_state.shape)}")
        if state_indices is None and initial_state.shape[0] != B:
            raise ValueError(f"initial_state must have one state per batch row (N = B = {B}) "
                             f"without state_indices, got N = {initial_state.shape[0]}")


def kernel_fits(K: int, V: int) -> bool:
    """Whether the fused kernel takes head dims K and V: powers of two from 16 (its tiles)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (K, V))


def _pick_backend(backend: str | None, K: int, V: int) -> str:
    """None: the fused kernel on a GPU where it takes the head dims, else the recurrence."""
    if backend is None:
        return resolve_backend(None) if kernel_fits(K, V) else "xla"
    backend = "pallas" if backend == "mosaic" else backend
    if backend in ("pallas", "interpret") and not kernel_fits(K, V):
        raise ValueError(f"backend={backend!r}: the fused kernel takes head dims that are "
                         f"powers of two from 16, got K = {K}, V = {V}; use backend='xla'")
    return backend


def _recurrent_op(q, k, v, g, beta, *, scale, initial_state, state_indices,
                  use_qk_l2norm_in_kernel, backend):
    """The steps on every batch row from its state (module docstring); g is the decay."""
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    backend = _pick_backend(backend, K, V)
    if backend in ("pallas", "interpret"):
        table = (jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None
                 else initial_state)
        rows = jnp.arange(B, dtype=jnp.int32) if state_indices is None else state_indices
        return recurrent_step(q, k, v, g, beta, table, rows,
                              scale=K ** -0.5 if scale is None else float(scale),
                              normalize_qk=use_qk_l2norm_in_kernel,
                              interpret=backend == "interpret")
    if initial_state is None:
        states = jnp.zeros((B, HV, K, V), jnp.float32)
    elif state_indices is None:
        states = initial_state.astype(jnp.float32)
    else:
        idx = state_indices.astype(jnp.int32)
        rows = initial_state.astype(jnp.float32)[jnp.maximum(idx, 0)]
        states = jnp.where((idx >= 0)[:, None, None, None], rows, 0.0)
    o, new = token_recurrence(q, k, v, g, beta, scale=scale, initial_state=states,
                              output_final_state=True, cu_seqlens=None,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if state_indices is not None:
        table = initial_state.astype(jnp.float32)
        # rows with index -1 go past the table's end, where a scatter in "drop" mode drops them
        idx = jnp.where(state_indices >= 0, state_indices, table.shape[0]).astype(jnp.int32)
        new = table.at[idx].set(new, mode="drop")
    return o.astype(v.dtype), new


_DOC = """{title}

    o, state = {name}(q, k, v, g, beta, *, scale=None, initial_state=None,
        state_indices=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, ...,
        backend=None)

    A few tokens per call (decoding) from a table of states (``jaxcp.recurrent``). The same
    arguments as ``{chunk}`` where they apply: q, k [B, T, H, K]; v [B, T, HV, V]; g
    {g_shape}; beta [B, T, HV]; scale defaults to K ** -0.5; the gate arguments as there.

      initial_state: [N, HV, K, V] (float32 is kept); None: every row starts from zero.
      state_indices: int [B], the table row of each batch row (-1: start from zero, keep
        nothing); None: row b reads row b (N == B).
      backend: None (the default: "pallas" on a GPU where K and V are powers of two from 16,
        else "xla"), "xla" (the token recurrence), "pallas" (one fused kernel per call on a
        GPU, each state read once and written back in place; "mosaic" runs it too, having no
        decoding kernel of its own) or "interpret" (that kernel interpreted, any device).

    Returns o [B, T, HV, V] in v's dtype and the table [N, HV, K, V] float32 with the rows
    read replaced by the state after the last token ([B, HV, K, V] without a table).
    """


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                               beta: jax.Array, *, scale: float | None = None,
                               initial_state: jax.Array | None = None,
                               state_indices: jax.Array | None = None,
                               use_qk_l2norm_in_kernel: bool = False,
                               use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
                               dt_bias: jax.Array | None = None,
                               backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    check_backend(backend)
    check_gate_activation(Gate.SCALAR, q, v, g, use_gate_in_kernel=use_gate_in_kernel,
                          A_log=A_log, dt_bias=dt_bias)
    _check(Gate.SCALAR, q, k, v, g, beta, scale, initial_state, state_indices)
    if use_gate_in_kernel:
        g = decay_from_raw(Gate.SCALAR, g, A_log, dt_bias)
    return _recurrent_op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         state_indices=state_indices,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         backend=backend)


def recurrent_kda(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                  scale: float | None = None, initial_state: jax.Array | None = None,
                  state_indices: jax.Array | None = None, use_qk_l2norm_in_kernel: bool = False,
                  use_gate_in_kernel: bool = False, A_log: jax.Array | None = None,
                  dt_bias: jax.Array | None = None, lower_bound: float | None = None,
                  safe_gate: bool = False, backend: str | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    check_backend(backend)
    check_gate_activation(Gate.CHANNEL, q, v, g, use_gate_in_kernel=use_gate_in_kernel,
                          A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate,
                          lower_bound=lower_bound)
    _check(Gate.CHANNEL, q, k, v, g, beta, scale, initial_state, state_indices)
    if use_gate_in_kernel:
        g = decay_from_raw(Gate.CHANNEL, g, A_log, dt_bias, lower_bound)
    return _recurrent_op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         state_indices=state_indices,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         backend=backend)


recurrent_gated_delta_rule.__doc__ = _DOC.format(
    title="Gated DeltaNet, token by token (scalar gate per head and token).",
    name="recurrent_gated_delta_rule", chunk="chunk_gated_delta_rule",
    g_shape=Gate.SCALAR.dims())
recurrent_kda.__doc__ = _DOC.format(
    title="Kimi Delta Attention, token by token (per-channel gate).",
    name="recurrent_kda", chunk="chunk_kda", g_shape=Gate.CHANNEL.dims())
