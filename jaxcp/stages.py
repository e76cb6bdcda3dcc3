"""Which implementation runs each stage of the chunked delta rule: a table keyed by
(backend, gate).

An ``Implementation`` is one backend's code for one gate kind and what it supports; the
public op asks it for its policy (the I/O dtype of q, k, v, token-major tensors or the
chunk layout, whether q, k are L2-normalised inside the kernels) and the core runs the
``Stages`` it builds. The entries:

| backend  | gate    | intra-chunk terms, input cotangents | state recurrences | token-major, G |
|----------|---------|-------------------------------------|-------------------|----------------|
| "xla"    | both    | jnp (``jaxcp.xla``)                 | jnp               | no, no         |
| "pallas" | SCALAR  | Pallas ``gdn.intra``, ``gdn.grads`` | Pallas ``state``  | yes, no        |
| "pallas" | CHANNEL | Pallas ``kda.intra``, ``kda.grads`` | Pallas ``state``  | yes, yes       |
| "mosaic" | SCALAR  | Mosaic GPU fwd intra; as "pallas"   | Mosaic GPU        | yes, no        |

The Pallas modules are those of ``jaxcp.pallas.triton`` (``state``: ``common.state``).
"mosaic" runs GDN's forward intra-chunk terms (``intra``) and state recurrences
(``state_output``; in the backward ``state_fwd`` and ``state_bwd``) as the Mosaic GPU
kernels of ``jaxcp.pallas.mosaic`` where they take their inputs, and the "pallas" stages
for the rest; bf16 inputs only.
"interpret" runs the "pallas" entries with the kernels in Pallas interpret mode (any
device); ``backend=None`` is "mosaic" for GDN's bf16 inputs on a Hopper GPU (jax 0.11),
"pallas" on other GPUs, "xla" elsewhere (``resolve_backend``). A new delta-rule variant is
one ``Gate`` value and its entries here.

token_major: the token tensors q, k, v, g, beta, o, do and the input cotangents stay
[B, T, HV, ...] as the caller has them, and the kernels read and write each chunk in place,
at the rows the ``ChunkLayout`` gives it (packed sequences included); otherwise they are
gathered into the chunk layout [NT, B, HV, C, ...] like the terms. Stages take the layout
after ``scale``. The Pallas GDN intra kernel returns row-factored terms (``ChunkTerms``)
whose bare q, k are the token tensors as given.

The op hands the caller's gate to the ``gate`` stage first, with the gate activation when
the caller passes the raw gate input, and the other stages take what it returns as g.
G (``gate_cumsum``): that is G, the decay's cumsum over each chunk's rows in the chunk
layout [NT, B, HV, C, K], from a Pallas kernel (``kda.gate_cumsum.chunk_gate``, the gate
activation inside it), and the stages' dg is dG; the kernel's backward takes dG to the
gate. Otherwise it is the per-token decay (``xla.per_token_decay``; the activation by
XLA), which the op lays out in chunks with the other token tensors where the stages are
not token-major.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxcp import xla
from jaxcp.gate import Gate
from jaxcp.l2norm import normalized_copy

BACKENDS = ("xla", "pallas", "interpret", "mosaic")


class Stages(NamedTuple):
    """The stage functions of one implementation, with the signatures of ``jaxcp.xla`` after
    the layout argument; ``gate(g, layout, activation=None)``, the caller's gate as the
    other stages take it (module docstring; activation: None or (A_log, dt_bias,
    lower_bound), ``gate.decay_from_raw``); and two for the backward's intra terms:
    ``keep(terms)``, what the forward keeps of its terms (from ``intra(...,
    with_inverse=True)``; None: nothing), and ``intra_again(q, k, v, g, beta, scale,
    layout, kept)``, the terms with the inverse again, from the kept ones (Pallas GDN: only
    w and u are recomputed) or from scratch; ``unit_rows(x, dtype)``, the L2-normalised copy
    of q or k [B, T, H, K] in dtype that the op makes where the kernels do not normalise
    (``l2norm.normalized_copy``; the Pallas stages: ``common.l2norm.l2_normalized``)."""
    gate: Callable
    intra: Callable
    keep: Callable
    intra_again: Callable
    state_output: Callable
    state_fwd: Callable
    state_last: Callable
    cp_summary: Callable
    state_bwd: Callable
    chunk_grads: Callable
    unit_rows: Callable


@dataclass(frozen=True)
class StageOptions:
    """How the stages of one call are built, derived from the inputs by ``stage_options``.
    backend: "xla", "pallas" or "interpret"; gate: the gate's kind. dot_dtype: the operand
    dtype of the kernels' matrix products ("bfloat16" for bf16 inputs, as FLA does;
    accumulation and the state stay float32). normalize_qk: ``intra`` and ``chunk_grads``
    take raw q, k and L2-normalise them inside the kernels; the cotangents are those of the
    raw q, k. chunk_size: C. gate_bound: None, or a bound in [-5, 0) that every decay
    respects (the KDA gate computed with safe_gate and lower_bound), under which KDA's
    Pallas kernels take every diagonal sub-chunk block as products without checking
    (``kda.gates``); the others ignore it. unit_qk: every row of q and k has unit L2 norm
    (the op normalised them, or the kernels do), which bounds the terms that KDA's Pallas
    stages then keep in float16. tokens: T, the length of the token tensors, for a
    token-major implementation (KDA's state_output writes o [B, T, HV, V]); None
    otherwise."""
    backend: str
    gate: Gate
    dot_dtype: str = "float32"
    normalize_qk: bool = False
    chunk_size: int = 64
    gate_bound: float | None = None
    unit_qk: bool = False
    tokens: int | None = None

    @property
    def interpret(self) -> bool:
        return self.backend == "interpret"


@dataclass(frozen=True)
class Implementation:
    """backend, gate: the table key. token_major: reads and writes the token tensors in place
    (see the module docstring). normalize_max_k: the kernels L2-normalise q, k themselves for K
    up to this (0: never; the op copies them with unit rows first, ``Stages.unit_rows``).
    narrow_qk, narrow_v: q and k, and v, reach the kernels in bf16 when the inputs are bf16
    (else float32; v is never transformed before the kernels, so bf16 v is exact where they read
    it as float32). unit_qk_dtype: where narrow_qk is False, the dtype of bf16 inputs' q and k
    that the op has L2-normalised (None: float32). gate_cumsum: the stages take G and return dG
    (module docstring). build: the Stages for a StageOptions (``stages_for``)."""
    backend: str
    gate: Gate
    token_major: bool
    gate_cumsum: bool
    normalize_max_k: int
    narrow_qk: bool
    narrow_v: bool
    build: Callable[[StageOptions], Stages]
    unit_qk_dtype: Any = None

    def qk_dtype(self, dot_dtype: str, unit_rows: bool):
        """The dtype q and k reach the kernels in; unit_rows: the op has L2-normalised them."""
        if dot_dtype != "bfloat16":
            return jnp.float32
        if self.narrow_qk:
            return jnp.bfloat16
        if unit_rows and self.unit_qk_dtype is not None:
            return self.unit_qk_dtype
        return jnp.float32

    def v_dtype(self, dot_dtype: str):
        return jnp.bfloat16 if self.narrow_v and dot_dtype == "bfloat16" else jnp.float32

    def normalizes_qk(self, K: int) -> bool:
        return K <= self.normalize_max_k


def _xla_stages(opts: StageOptions) -> Stages:
    """Everything in jnp. Its chunk_grads recomputes the terms in its vjp and never reads
    the inverse."""
    intra = lambda q, k, v, g, beta, scale, layout, with_inverse=False: xla.intra_chunk(
        q, k, v, g, beta, scale, gate=opts.gate)
    chunk_grads = lambda q, k, v, g, beta, scale, layout, *rest: xla.chunk_grads(
        q, k, v, g, beta, scale, *rest, gate=opts.gate)
    intra_again = lambda q, k, v, g, beta, scale, layout, kept: intra(
        q, k, v, g, beta, scale, layout)
    return Stages(partial(xla.per_token_decay, gate=opts.gate), intra, lambda terms: None,
                  intra_again, xla.state_output, xla.state_fwd, xla.state_last,
                  xla.cp_summary, xla.state_bwd, chunk_grads, normalized_copy)


def _gdn_precision(opts: StageOptions):
    """GDN's ``KernelPrecision``: products, stored terms and the state recurrences in the
    dot dtype (bf16 for bf16 inputs, with bf16 and TF32 products, as FLA); precise 3xTF32
    products for fp32 inputs."""
    from jaxcp.pallas.triton.common.products import KernelPrecision
    dtype = jnp.dtype(opts.dot_dtype)
    return KernelPrecision(dot_dtype=dtype, tile_dtype=dtype, precise=dtype == jnp.float32)


def _kda_precision(opts: StageOptions):
    """KDA's ``KernelPrecision``: precise products for fp32 inputs, bf16 and TF32 ones for
    bf16 inputs (``kda.intra``; chunk_grads takes them precise for both, see
    ``_pallas_kda_stages``), and float32 state recurrences whose fp32 products are
    ``Fp32Products.for_inputs``."""
    from jaxcp.pallas.triton.common.products import Fp32Products, KernelPrecision
    precise = opts.dot_dtype == "float32"
    # The state recurrences keep KDA's terms finer than bf16 for every input dtype (TF32
    # products for bf16 inputs). GDN's kd and qg reach them as the bf16 inputs times fp32
    # row factors, exact; KDA's are rounded products, and with correlated keys w, kd, u, qg
    # and attn rounded to bf16 put o at 1e-2 of the reference, 1.6e-3 with all five float32
    # (docs/precision.md).
    # w, qg, kd and attn in float16 for bf16 inputs with unit q, k rows: the mantissa of
    # the state recurrences' TF32 products, at half the bytes (docs/precision.md); the
    # states and cotangents then meet them as scaled float16 products at twice TF32's rate,
    # with TF32's digits within 2^14 of a block's largest entry
    # (``products.scaled_float16_dot``; ``state_kernel_precision``)
    tile_dtype = jnp.float16 if opts.unit_qk and not precise else jnp.float32
    return KernelPrecision(dot_dtype=jnp.float32, tile_dtype=tile_dtype, precise=precise,
                           products=Fp32Products.for_inputs(opts.dot_dtype),
                           scaled_float16=tile_dtype == jnp.float16)


def state_kernel_precision(kernel: str, precision):
    """The ``KernelPrecision`` of the state kernel `kernel` (``common.state``'s function
    names) in a stage set of `precision`: state_fwd, which stores h and v_new every chunk,
    keeps TF32 products where the others take scaled float16 ones (it took longer with
    them: KDA, H200, 2.14 -> 2.84 ms; docs/benchmarks/kernels_kda.md)."""
    if kernel == "state_fwd":
        return replace(precision, scaled_float16=False)
    return precision


def _pallas_state_stages(opts: StageOptions, precision, out_dtype=None) -> dict:
    """The state recurrences as Pallas kernels (both gates), token-major (o, do), at
    precision (``products.KernelPrecision``); out_dtype: o's dtype where not that of the
    terms' u. With them the unit-row copies of q, k (``common.l2norm``), which both gates'
    Pallas stages share."""
    from jaxcp.pallas.triton.common import l2norm, state
    kw = lambda name: dict(gate=opts.gate, token_major=True, interpret=opts.interpret,
                           precision=state_kernel_precision(name, precision))
    stages = {name: partial(getattr(state, name), **kw(name)) for name in (
        "state_fwd", "state_last", "cp_summary", "state_bwd")}
    return dict(stages, state_output=partial(state.state_output, tokens=opts.tokens,
                                             out_dtype=out_dtype, **kw("state_output")),
                unit_rows=partial(l2norm.l2_normalized, interpret=opts.interpret))


def _pallas_gdn_stages(opts: StageOptions) -> Stages:
    """GDN: every stage but the gate a Pallas kernel, token-major."""
    from jaxcp.pallas.triton.gdn import grads as gdn_grads, intra as gdn_intra
    precision = _gdn_precision(opts)
    kw = dict(interpret=opts.interpret, precision=precision, normalize_qk=opts.normalize_qk)

    def intra(q, k, v, g, beta, scale, layout, with_inverse=False):
        return gdn_intra.intra_chunk(q, k, v, g, beta, scale, layout, opts.chunk_size,
                                     with_inverse=with_inverse, **kw)

    def intra_again(q, k, v, g, beta, scale, layout, kept):
        return gdn_intra.recompute_w_u(q, k, v, g, beta, layout, opts.chunk_size, kept, **kw)

    def chunk_grads(q, k, v, g, beta, scale, layout, *rest):
        return gdn_grads.chunk_grads(q, k, v, g, beta, scale, layout, opts.chunk_size, *rest,
                                     **kw)

    return Stages(gate=partial(xla.per_token_decay, gate=opts.gate), intra=intra,
                  keep=gdn_intra.kept_for_w_u, intra_again=intra_again, chunk_grads=chunk_grads,
                  **_pallas_state_stages(opts, precision))


# The backward's Mosaic state kernels (state_fwd, state_bwd) run up to this K. Above it they
# fit one ring slot of 32 columns in shared memory and are slower than the Triton kernels
# (H200, T = 32768, H = 16, K = 256, mosaic fwd+bwd: 15.94 ms with both, 15.06 with
# state_bwd on Triton, 13.63 with both on Triton; kernels_mosaic.notes.md). The forward's
# state_output stays on Mosaic at K = 256 (fwd 2.74 ms, 3.87 on Triton).
MOSAIC_BACKWARD_STATE_MAX_K = 128


def _mosaic_gdn_stages(opts: StageOptions) -> Stages:
    """GDN's Pallas stages with the intra-chunk terms (intra), the forward state recurrence
    fused with the output (state_output), the backward's state pass again (state_fwd) and
    its reverse state pass (state_bwd, but for the CP entry cotangent; these two up to
    ``MOSAIC_BACKWARD_STATE_MAX_K``) as Mosaic GPU kernels (``jaxcp.pallas.mosaic``)
    wherever those take their inputs (``gdn.intra.takes``: chunks of 64, K, V multiples of
    64 up to 256, by a token table too, unit q, k rows; ``state.takes``: whole chunks of 64,
    K, V multiples of 64, within shared memory), the Triton kernels elsewhere; inside
    shard_map (CP) as outside it. bf16 inputs only: the Mosaic kernels' products take bf16
    operands."""
    from jaxcp.pallas.mosaic.common import state as mosaic_state, state_bwd as mosaic_bwd
    from jaxcp.pallas.mosaic.gdn import intra as mosaic_intra
    if opts.dot_dtype != "bfloat16":
        raise ValueError(f"backend='mosaic' takes bfloat16 inputs (its kernels' products "
                         f"take bf16 operands), got inputs that run {opts.dot_dtype} "
                         f"products: use backend='pallas'")
    triton = _pallas_gdn_stages(opts)

    def intra(q, k, v, g, beta, scale, layout, with_inverse=False):
        kw = dict(normalize_qk=opts.normalize_qk, unit_qk=opts.unit_qk)
        if mosaic_intra.takes(q, k, v, layout, opts.chunk_size, **kw):
            return mosaic_intra.intra_chunk(q, k, v, g, beta, scale, layout,
                                            opts.chunk_size, with_inverse=with_inverse, **kw)
        return triton.intra(q, k, v, g, beta, scale, layout, with_inverse)

    def state_output(terms, layout, init, h0, with_finals):
        if mosaic_state.takes(terms, layout, init, h0, with_output=True):
            return mosaic_state.state_output(terms, layout, init, h0, with_finals)
        return triton.state_output(terms, layout, init, h0, with_finals)

    def state_fwd(terms, layout, init, h0):
        if (terms.w.shape[-1] <= MOSAIC_BACKWARD_STATE_MAX_K
                and mosaic_state.takes(terms, layout, init, h0, with_output=False)):
            return mosaic_state.state_fwd(terms, layout, init, h0)
        return triton.state_fwd(terms, layout, init, h0)

    def state_bwd(terms, layout, do, d_final, d_last, with_d_init=False, entry_only=False,
                  unused=None):
        if (not entry_only and terms.w.shape[-1] <= MOSAIC_BACKWARD_STATE_MAX_K
                and mosaic_bwd.takes(terms, layout, do, d_last)):
            return mosaic_bwd.state_bwd(terms, layout, do, d_final, d_last,
                                        with_d_init=with_d_init)
        return triton.state_bwd(terms, layout, do, d_final, d_last, with_d_init=with_d_init,
                                entry_only=entry_only, unused=unused)

    return triton._replace(intra=intra, state_output=state_output, state_fwd=state_fwd,
                           state_bwd=state_bwd)


def _pallas_kda_stages(opts: StageOptions) -> Stages:
    """KDA: every stage a Pallas kernel, token-major, taking G. The forward keeps T and
    attn; the backward computes w, u and the factor tiles again from T (``kda.intra``),
    and its input cotangents read T (``kda.grads``)."""
    from jaxcp.pallas.triton.kda import gate_cumsum, grads as kda_grads, intra as kda_intra
    precision = _kda_precision(opts)
    kw = dict(normalize_qk=opts.normalize_qk, interpret=opts.interpret, precision=precision)

    def gate(g, layout, activation=None):
        A_log, dt_bias, lower_bound = activation or (None, None, None)
        cfg = gate_cumsum.GateCumsum(opts.chunk_size, layout.chunk_starts.shape[0],
                                     activate=activation is not None,
                                     lower_bound=lower_bound, interpret=opts.interpret)
        return gate_cumsum.chunk_gate(cfg, g, A_log, dt_bias, layout)

    def intra(q, k, v, G, beta, scale, layout, with_inverse=False):
        return kda_intra.intra_chunk(q, k, v, G, beta, scale, layout,
                                     with_inverse=with_inverse, gate_bound=opts.gate_bound, **kw)

    def intra_again(q, k, v, G, beta, scale, layout, kept):
        return kda_intra.recompute_terms(q, k, v, G, beta, scale, layout, kept, **kw)

    # Products that keep fp32 tiles finer than bf16 for every input dtype (TF32 for bf16
    # inputs): with bf16 products, correlated keys put dq and dbeta at 9e-3 to 1.2e-2 of the
    # reference on the H100 (TF32: 2.8e-3; gpu_checks.md)
    grads_precision = replace(precision, precise=True)

    def chunk_grads(q, k, v, G, beta, scale, layout, *rest):
        return kda_grads.chunk_grads(q, k, v, G, beta, scale, layout, *rest,
                                     gate_bound=opts.gate_bound, normalize_qk=opts.normalize_qk,
                                     interpret=opts.interpret, precision=grads_precision)

    # o leaves in the inputs' dot dtype (bf16 for bf16 inputs), as the op returns it
    # (launch configurations per kernel: ``StateBlocks.kda``)
    state = _pallas_state_stages(opts, precision, out_dtype=jnp.dtype(opts.dot_dtype))
    return Stages(gate=gate, intra=intra, keep=kda_intra.kept_for_terms,
                  intra_again=intra_again, chunk_grads=chunk_grads, **state)


# In-kernel normalisation for GDN up to K = 128, where it saves the norm's passes over q, k;
# at K = 256 its cotangent kernels are slower than the op's norm. KDA's q, k reach its
# kernels normalised by the op (``unit_rows``), in float16 for bf16 inputs: the 10-bit
# mantissa its TF32 products keep (bf16 copies lose too many digits on correlated keys);
# its in-kernel path (normalize_qk) saves more memory but is slower
# (docs/benchmarks/kernels.md, kernels_kda.md).
IMPLEMENTATIONS = {(impl.backend, impl.gate): impl for impl in (
    #     backend   gate     token_major gate_cumsum normalize_max_k narrow_qk narrow_v build
    Implementation("xla", Gate.SCALAR, False, False, 0, False, False, _xla_stages),
    Implementation("xla", Gate.CHANNEL, False, False, 0, False, False, _xla_stages),
    Implementation("pallas", Gate.SCALAR, True, False, 128, True, True, _pallas_gdn_stages),
    Implementation("pallas", Gate.CHANNEL, True, True, 0, False, True, _pallas_kda_stages,
                   unit_qk_dtype=jnp.float16),
    Implementation("mosaic", Gate.SCALAR, True, False, 128, True, True, _mosaic_gdn_stages),
)}


def gpu_present() -> bool:
    return jax.default_backend() == "gpu"


def compute_capability() -> str:
    """The first default device's CUDA compute capability ("9.0"), "" where it has none."""
    return str(getattr(jax.devices()[0], "compute_capability", ""))


def hopper_present() -> bool:
    """Whether JAX's default devices are Hopper GPUs (compute capability 9.x), whose wgmma
    and TMA the Mosaic GPU kernels use."""
    return gpu_present() and compute_capability().split(".")[0] == "9"


# The jax releases on which the Mosaic GPU kernels have run on a GPU; on others they are
# only lowered (for CUDA, on the CPU), and backend=None keeps the Triton kernels.
MOSAIC_DEFAULT_JAX = ("0.11.",)


def resolve_backend(backend: str | None, gate: Gate | None = None, input_dtype=None) -> str:
    """The backend an op runs: backend itself, or for None "mosaic" for GDN (the scalar
    gate) on bf16 inputs on a Hopper GPU under a jax of ``MOSAIC_DEFAULT_JAX``, where its
    kernels beat the Triton ones at every shape measured (docs/benchmarks/kernels_mosaic.md,
    kernels_packed.md), "pallas" on other GPUs, gates, input dtypes and jax releases, and
    "xla" without a GPU."""
    if backend is not None:
        return backend
    if not gpu_present():
        return "xla"
    if (gate is Gate.SCALAR and input_dtype is not None
            and jnp.dtype(input_dtype) == jnp.bfloat16 and hopper_present()
            and jax.__version__.startswith(MOSAIC_DEFAULT_JAX)):
        return "mosaic"
    return "pallas"


def implementation(backend: str, gate: Gate) -> Implementation:
    """The table entry of a backend ("interpret" runs the "pallas" entries) and gate."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    key = ("pallas" if backend == "interpret" else backend, gate)
    if key not in IMPLEMENTATIONS:
        raise ValueError(f"backend={backend!r} has no stages for the {gate.value} gate: "
                         f"use backend='pallas'")
    return IMPLEMENTATIONS[key]


def stage_options(backend: str, gate: Gate, input_dtype, K: int, *, unit_qk: bool,
                  chunk_size: int = 64, gate_bound: float | None = None,
                  tokens: int | None = None) -> StageOptions:
    """The options of the stages for inputs whose v is of input_dtype and whose keys are K
    wide: bf16 products for bf16 inputs, q, k normalised inside the kernels where the
    implementation does it for this K and the caller asks for unit rows (unit_qk), the
    token tensors' length where the implementation is token-major."""
    impl = implementation(backend, gate)
    dot_dtype = "bfloat16" if jnp.dtype(input_dtype) == jnp.bfloat16 else "float32"
    return StageOptions(backend, gate, dot_dtype, unit_qk and impl.normalizes_qk(K),
                        chunk_size, gate_bound, unit_qk, tokens if impl.token_major else None)


@lru_cache(maxsize=None)
def stages_for(opts: StageOptions) -> Stages:
    """The Stages of (opts.backend, opts.gate) built for opts."""
    impl = implementation(opts.backend, opts.gate)
    if opts.normalize_qk and impl.normalize_max_k == 0:
        raise ValueError(f"normalize_qk: the {impl.backend} stages for the {opts.gate.value} "
                         f"gate do not normalise q, k themselves")
    return impl.build(replace(opts, unit_qk=opts.unit_qk or opts.normalize_qk))
