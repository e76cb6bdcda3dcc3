"""Argument checks of the public ops: every bad input gets a ValueError/TypeError naming it.

Values known at trace time are checked at once. Traced values (cu_seqlens under jit) are
checked only inside ``check_traced_inputs()``, with ``jax.experimental.checkify``: the
caller wraps its function in ``checkify.checkify`` and calls ``err.throw()``.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jaxcp.cp.split import check_layout
from jaxcp.gate import Gate
from jaxcp.stages import (BACKENDS as STAGE_BACKENDS, compute_capability, gpu_present,
                          hopper_present)
from jaxcp.vma import manual_axis_size

HEAD_DIMS = (16, 32, 64, 128, 256)
CHUNK_SIZES = (16, 32, 64, 128)
CP_STRATEGIES = ("allgather", "all_to_all", "relay")
BACKENDS = (None,) + STAGE_BACKENDS
OPERAND_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


_TRACED = threading.local()


@contextlib.contextmanager
def check_traced_inputs():
    """Ops traced inside this context also check their traced cu_seqlens (starts at 0, ends
    at the total length, strictly increasing) with checkify.check: run the jitted function
    through ``checkify.checkify`` and ``err.throw()`` raises on a bad value::

        with jaxcp.check_traced_inputs():
            err, out = jax.jit(checkify.checkify(f))(*args)
        err.throw()
    """
    before = getattr(_TRACED, "on", False)
    _TRACED.on = True
    try:
        yield
    finally:
        _TRACED.on = before


def _check_traced_cu_seqlens(cu_seqlens, total: int) -> None:
    cu = cu_seqlens.astype(jnp.int32)
    checkify.check((cu[0] == 0) & (cu[-1] == total),
                   f"cu_seqlens must start at 0 and end at the total length {total}, got "
                   "{cu}", cu=cu)
    checkify.check(jnp.all(cu[1:] > cu[:-1]),
                   "cu_seqlens must be strictly increasing (no empty sequences), got {cu}",
                   cu=cu)


def check_backend(backend) -> None:
    """backend must be one of BACKENDS; "pallas" needs a GPU, "mosaic" a Hopper GPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("pallas", "mosaic") and not gpu_present():
        raise ValueError(f"backend={backend!r} runs GPU kernels, and JAX's backend here is "
                         f"{jax.default_backend()!r}: use backend='interpret' (the Pallas "
                         f"kernels, interpreted: slow) or 'xla'")
    if backend == "mosaic":
        capability = compute_capability()
        if capability and not hopper_present():
            raise ValueError(f"backend='mosaic' runs Hopper kernels (wgmma: compute "
                             f"capability 9.x), and this GPU's is {capability}: use "
                             f"backend='pallas'")


def check_array(name: str, x, dims: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
    if x.ndim != dims.count(",") + 1:
        raise ValueError(f"{name} must be {dims}, got shape {tuple(x.shape)}")
    if not any(x.dtype == d for d in OPERAND_DTYPES):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _concrete(x) -> np.ndarray | None:
    """The value of x if it is known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def axis_size_or_raise(cp_axis: str) -> int:
    """Size of the manual mesh axis cp_axis; ValueError when it is not bound."""
    if not isinstance(cp_axis, str):
        raise TypeError(f"cp_axis must be a mesh axis name (str) or None, got {cp_axis!r}")
    size = manual_axis_size(cp_axis)
    if size is None:
        raise ValueError(
            f"cp_axis={cp_axis!r} is not a bound mesh axis: call the op inside jax.shard_map "
            f"over a mesh with the axis {cp_axis!r} manual")
    return size


def check_operands(gate: Gate, q, k, v, g, beta, *, scale) -> None:
    """The operands every op takes, chunked or recurrent: q, k [B, T, H, K], v [B, T, HV, V]
    with HV a multiple of H, g (``gate.dims()``), beta [B, T, HV], scale > 0 or None."""
    for name, x, dims in (("q", q, "[B, T, H, K]"), ("k", k, "[B, T, H, K]"),
                          ("v", v, "[B, T, HV, V]"), ("beta", beta, "[B, T, HV]"),
                          ("g", g, gate.dims())):
        check_array(name, x, dims)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T}; got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"v's head count HV = {HV} must be a multiple of q/k's H = {H}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must have shape {(B, T, HV)}, got {tuple(beta.shape)}")
    g_shape = gate.shape(B, T, HV, K)
    if g.shape != g_shape:
        raise ValueError(f"g must have shape {g_shape}, got {tuple(g.shape)}")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")


def check_inputs(gate: Gate, q, k, v, g, beta, *, scale, initial_state, cu_seqlens, cp_axis,
                 cp_strategy, chunk_size, backend, cp_layout="contiguous",
                 segments=None) -> None:
    """Validate a call of chunk_gated_delta_rule (Gate.SCALAR) or chunk_kda (Gate.CHANNEL)."""
    check_operands(gate, q, k, v, g, beta, scale=scale)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K not in HEAD_DIMS:
        raise ValueError(f"q/k head dim K = {K} must be one of {HEAD_DIMS}")
    if V not in HEAD_DIMS:
        raise ValueError(f"v head dim V = {V} must be one of {HEAD_DIMS}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    check_backend(backend)
    if cp_strategy not in CP_STRATEGIES:
        raise ValueError(f"cp_strategy must be one of {CP_STRATEGIES}, got {cp_strategy!r}")

    world = 1 if cp_axis is None else axis_size_or_raise(cp_axis)
    check_layout(cp_layout, T if cp_axis is not None else None)
    if cp_axis is not None and cp_layout != "contiguous" and cp_strategy == "relay":
        raise ValueError(f"cp_strategy='relay' hands the state from device to device and takes "
                         f"cp_layout='contiguous' only, got cp_layout={cp_layout!r}")
    _check_segments(segments, T, cp_axis, cp_strategy, cp_layout, world)
    if cp_axis is not None and cp_strategy == "all_to_all" and H % world:
        raise ValueError(f"cp_strategy='all_to_all' splits heads over cp_axis {cp_axis!r} of size "
                         f"{world}: q/k's H = {H} must be divisible by it")

    if cu_seqlens is None:
        n_seqs = B
    else:
        if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise TypeError(f"cu_seqlens must be an integer array, got "
                            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape "
                             f"{tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got B = {B}")
        n_seqs = cu_seqlens.shape[0] - 1
        values = _concrete(cu_seqlens)
        total = T * world
        if values is not None:
            if values[0] != 0 or values[-1] != total:
                raise ValueError(f"cu_seqlens must start at 0 and end at the total length {total}"
                                 f"{' (T_local x cp size)' if world > 1 else ''}, got "
                                 f"[{values[0]}, ..., {values[-1]}]")
            if np.any(np.diff(values) <= 0):
                raise ValueError("cu_seqlens must be strictly increasing (no empty sequences)")
        elif getattr(_TRACED, "on", False):
            _check_traced_cu_seqlens(cu_seqlens, total)

    if initial_state is not None:
        if not hasattr(initial_state, "shape") or not jnp.issubdtype(initial_state.dtype, jnp.floating):
            raise TypeError("initial_state must be a floating-point jax array [N, HV, K, V]")
        if tuple(initial_state.shape) != (n_seqs, HV, K, V):
            raise ValueError(f"initial_state must have shape {(n_seqs, HV, K, V)} "
                             f"([N, HV, K, V], N = number of sequences), got "
                             f"{tuple(initial_state.shape)}")


def _check_segments(segments, T: int, cp_axis, cp_strategy: str, cp_layout: str,
                    world: int) -> None:
    """segments: None or a positive int dividing the length of each piece the op runs."""
    if segments is None:
        return
    if isinstance(segments, bool) or not isinstance(segments, (int, np.integer)) or segments < 1:
        raise ValueError(f"segments must be a positive int or None, got {segments!r}")
    if cp_axis is not None and cp_strategy == "relay" and segments > 1:
        raise ValueError("segments > 1 joins the segments by the merge of "
                         "cp_strategy='allgather' and does not combine with 'relay'")
    if cp_axis is None:
        piece, what = T, "T"
    elif cp_strategy == "all_to_all":
        piece, what = T * world, "the whole sequence (T x cp size)"
    elif cp_layout == "zigzag":
        piece, what = T // 2, "each zigzag piece (T / 2)"
    else:
        piece, what = T, "T"
    if piece % segments:
        raise ValueError(f"segments = {segments} must divide the length of {what} = {piece}")


def check_gate_activation(gate: Gate, q, v, g, *, use_gate_in_kernel, A_log, dt_bias,
                          safe_gate=False, lower_bound=None) -> None:
    """Validate the gate arguments of an op (FLA's contract; ``gate.decay_from_raw``) before
    the gate is applied; ``check_inputs`` checks q, v and the decay after."""
    if not isinstance(use_gate_in_kernel, bool):
        raise TypeError(f"use_gate_in_kernel must be a bool, got {use_gate_in_kernel!r}")
    if lower_bound is not None and not (isinstance(lower_bound, (int, float))
                                        and lower_bound < 0):
        raise ValueError(f"lower_bound must be a negative float or None, got {lower_bound!r}")
    if safe_gate and use_gate_in_kernel and (lower_bound is None or lower_bound < -5):
        raise ValueError(f"safe_gate with use_gate_in_kernel needs lower_bound in [-5, 0), "
                         f"got {lower_bound!r}")
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{name} is read only with use_gate_in_kernel=True (g is the "
                                 f"decay itself otherwise)")
        return
    check_array("q", q, "[B, T, H, K]")
    check_array("v", v, "[B, T, HV, V]")
    check_array("g", g, gate.dims())
    HV, K = v.shape[2], q.shape[3]
    g_shape = gate.shape(*v.shape[:3], K)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must have shape {g_shape}, got {tuple(g.shape)}")
    if A_log is None and lower_bound is None:
        raise ValueError("A_log [HV] is needed with use_gate_in_kernel=True"
                         + (" unless lower_bound is set" if gate is Gate.CHANNEL else ""))
    for name, x, shape in (("A_log", A_log, (HV,)),
                           ("dt_bias", dt_bias, (HV * gate.width(K),))):
        if x is None:
            continue
        if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point jax array {list(shape)}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
