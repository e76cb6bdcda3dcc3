"""GDN's Mosaic GPU kernels on the current device: the state recurrence in both its forms
(``state_fwd``: h and v_new per chunk; ``state_output``: fused with the output) and the
intra-chunk terms (``intra``): their numbers and their time beside the Triton kernels'.

    python -m benchmarks.check.mosaic --NT 128 512 --H 64          # on a Hopper GPU
    python -m benchmarks.check.mosaic --NT 2 --H 1 --interpret     # anywhere (no times)

Per case (NT chunks of 64 tokens, one sequence, H value heads, K = V = 128) the terms are
GDN's own: ``xla.intra_chunk`` of L2-normalised keys and queries, decays exp(logsigmoid(x + 4))
and sigmoid betas, w, kd, qg and attn in bf16 (the operand dtype), and a random entering
state. Each form's outputs (h, v_new, last; o, finals) are compared with its jnp reference
(the same operand roundings: float32 accumulation order is all that may differ,
``LIMIT_REFERENCE``) and with ``jaxcp.xla`` in float32 (the bf16 limit, 1e-2). Without
--interpret each form is then timed beside the Triton kernel of the same form at bf16
precision (``benchmarks.timing.pipelined_ms``, whose median leaves out the first rounds, in
which the allocator's pool grows by the outputs: h alone is NT x H x 32 KiB). --json writes
one record per case and form: form, NT, H, errors (name -> relative error, "ref" against
the reference, "f32" against float32), ms (impl -> ms, or none), device, jax.

The ``intra`` form reads the token tensors of the same kind of case (bf16 q, k, v, raw q, k
normalised in the kernel) and writes w, u, attn and the kept inverse; its reference is the
Triton kernel (``gdn.intra``) at the "pallas" backend's bf16 precision, whose inverse runs
TF32 products where the Mosaic kernel's runs float16 ones (the same mantissa), and its
float32 twin is ``xla.intra_chunk`` of the normalised float32 inputs.
"""
from __future__ import annotations

import argparse
import json
import sys

# against the reference: the float32 states (last, finals) to float32 accumulation order over
# the chunks; h, v_new and o, stored in bf16, to one bf16 rounding step where the two round
# apart
LIMIT_REFERENCE = {"h": 2.0 ** -8, "v_new": 2.0 ** -8, "o": 2.0 ** -8, "last": 1e-4,
                   "finals": 1e-4, "w": 2.0 ** -8, "u": 2.0 ** -8, "attn": 2.0 ** -8,
                   "inv": 2.0 ** -8}
FORMS = {"state_fwd": ("h", "v_new", "last"), "state_output": ("o", "finals"),
         "intra": ("w", "u", "attn", "inv")}
LIMIT_FLOAT32 = 1e-2       # bf16 operands


def gdn_terms(NT: int, H: int, C: int = 64, D: int = 128):
    """(terms, layout, h0): one sequence of NT chunks, the chunk layout of the state kernels."""
    import jax
    import jax.numpy as jnp
    from jaxcp.gate import Gate
    from jaxcp.layout import build_layout
    from jaxcp.l2norm import l2_normalize
    from jaxcp.xla import intra_chunk

    keys = jax.random.split(jax.random.key(0), 6)
    shape = (NT, 1, H, C)
    q = l2_normalize(jax.random.normal(keys[0], shape + (D,)))
    k = l2_normalize(jax.random.normal(keys[1], shape + (D,)))
    v = jax.random.normal(keys[2], shape + (D,))
    g = jax.nn.log_sigmoid(jax.random.normal(keys[3], shape + (1,)) + 4.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], shape))
    terms = jax.jit(lambda *a: intra_chunk(*a, D ** -0.5, gate=Gate.SCALAR))(q, k, v, g, beta)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    terms = terms._replace(w=bf16(terms.w), kd=bf16(terms.kd), qg=bf16(terms.qg),
                           attn=bf16(terms.attn))
    layout, _ = build_layout(1, NT * C, C, None, 0, NT * C)
    h0 = 0.1 * jax.random.normal(keys[5], (1, H, D, D))
    return terms, layout, h0


def gdn_tokens(NT: int, H: int, C: int = 64, D: int = 128):
    """(q, k, v, g, beta, layout): the token tensors of one sequence of NT chunks, q, k, v in
    bf16 (q, k raw), g and beta [1, T, H] float32."""
    import jax
    import jax.numpy as jnp
    from jaxcp.layout import build_layout

    keys = jax.random.split(jax.random.key(0), 5)
    T = NT * C
    normal = lambda key, shape: jax.random.normal(key, shape)
    q, k, v = (normal(key, (1, T, H, D)).astype(jnp.bfloat16) for key in keys[:3])
    g = jax.nn.log_sigmoid(normal(keys[3], (1, T, H)) + 4.0)
    beta = jax.nn.sigmoid(normal(keys[4], (1, T, H)))
    layout, _ = build_layout(1, T, C, None, 0, T)
    return q, k, v, g, beta, layout


def relative_errors(form: str, got, want, f32) -> dict:
    """name -> relative error of each of the form's outputs, "ref" against the reference,
    "f32" against float32 (NaN where the output is not finite)."""
    import jax.numpy as jnp
    from jaxcp.metrics import rel_error

    errors = {}
    for name, a, b, c in zip(FORMS[form], got, want, f32):
        finite = bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
        errors[f"{name} ref"] = rel_error(a, b) if finite else float("nan")
        errors[f"{name} f32"] = rel_error(a, c) if finite else float("nan")
    return errors


def check_intra(NT: int, H: int, interpret: bool) -> dict:
    """The intra form's record (module docstring)."""
    import jax
    import jax.numpy as jnp
    from benchmarks.timing import pipelined_ms
    from jaxcp.gate import Gate
    from jaxcp.l2norm import l2_normalize
    from jaxcp.layout import to_chunks
    from jaxcp.pallas.mosaic.gdn import intra as mosaic
    from jaxcp.pallas.triton.common.products import KernelPrecision
    from jaxcp.pallas.triton.gdn import intra as triton
    from jaxcp import xla

    *inputs, layout = gdn_tokens(NT, H)
    scale = inputs[0].shape[-1] ** -0.5
    bf16 = KernelPrecision(dot_dtype=jnp.bfloat16, tile_dtype=jnp.bfloat16, precise=False)
    # the jitted calls return the kernels' tiles only: returning ChunkTerms whole would time
    # copies of q and k (its qg and kd) into outputs of their own too
    named = lambda terms: [getattr(terms, name) for name in FORMS["intra"]]
    kernel = jax.jit(lambda *a: named(mosaic.intra_chunk(
        *a, scale, layout, 64, normalize_qk=True, with_inverse=True, interpret=interpret)))
    reference = jax.jit(lambda *a: named(triton.intra_chunk(
        *a, scale, layout, 64, with_inverse=True, interpret=interpret, precision=bf16,
        normalize_qk=True)))
    q, k, v, g, beta = inputs
    chunks = lambda x: to_chunks(x.astype(jnp.float32), None, NT, 64)
    exact = jax.jit(lambda q, k, v, g, beta: xla.intra_chunk(
        chunks(l2_normalize(q)), chunks(l2_normalize(k)), chunks(v), chunks(g[..., None]),
        chunks(beta), scale, gate=Gate.SCALAR, with_inverse=True))
    errors = relative_errors("intra", kernel(*inputs), reference(*inputs),
                             named(exact(*inputs)))
    ms = None if interpret else {"jaxcp-mosaic": pipelined_ms(kernel, *inputs),
                                 "jaxcp-pallas": pipelined_ms(reference, *inputs)}
    return dict(form="intra", NT=NT, H=H, errors=errors, ms=ms,
                device=jax.devices()[0].device_kind, jax=jax.__version__)


def check(form: str, NT: int, H: int, interpret: bool) -> dict:
    """One case's record of one form (module docstring)."""
    import jax
    import jax.numpy as jnp
    from benchmarks.timing import pipelined_ms
    from jaxcp.gate import Gate
    from jaxcp.pallas.mosaic.common import state as mosaic
    from jaxcp.pallas.triton.common import state as triton
    from jaxcp.pallas.triton.common.products import KernelPrecision
    from jaxcp import xla

    if form == "intra":
        return check_intra(NT, H, interpret)
    terms, layout, h0 = gdn_terms(NT, H)
    if form == "state_fwd":
        kernel = jax.jit(lambda t, l, h: mosaic.state_fwd(t, l, None, h, interpret=interpret))
        reference = lambda t, l, h: mosaic.state_fwd_reference(t, l, None, h)
        exact = lambda t, l, h: xla.state_fwd(t, l, None, h)
    else:
        kernel = jax.jit(lambda t, l, h: mosaic.state_output(t, l, None, h, True,
                                                             interpret=interpret))
        reference = lambda t, l, h: mosaic.state_output_reference(t, l, None, h, True)
        exact = lambda t, l, h: xla.state_output(t, l, None, h, True)
    errors = relative_errors(form, kernel(terms, layout, h0),
                             jax.jit(reference)(terms, layout, h0),
                             jax.jit(exact)(terms, layout, h0))
    ms = None
    if not interpret:
        bf16 = KernelPrecision(dot_dtype=jnp.bfloat16, tile_dtype=jnp.bfloat16, precise=False)
        if form == "state_fwd":
            tri = lambda t, l, h: triton.state_fwd(t, l, None, h, gate=Gate.SCALAR,
                                                   precision=bf16)
        else:
            tri = lambda t, l, h: triton.state_output(t, l, None, h, True, gate=Gate.SCALAR,
                                                      precision=bf16, out_dtype=jnp.bfloat16)
        ms = {"jaxcp-mosaic": pipelined_ms(kernel, terms, layout, h0),
              "jaxcp-pallas": pipelined_ms(jax.jit(tri), terms, layout, h0)}
    return dict(form=form, NT=NT, H=H, errors=errors, ms=ms,
                device=jax.devices()[0].device_kind, jax=jax.__version__)


def within_limits(errors: dict) -> bool:
    """Every error below its limit (NaN is not)."""
    def limit(name: str) -> float:
        output, against = name.split()
        return LIMIT_REFERENCE[output] if against == "ref" else LIMIT_FLOAT32
    return all(e < limit(name) for name, e in errors.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.check.mosaic",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--NT", type=int, nargs="+", default=[128, 512], help="chunks of 64 tokens")
    ap.add_argument("--H", type=int, default=64, help="value heads")
    ap.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    ap.add_argument("--interpret", action="store_true",
                    help="Mosaic GPU's interpret mode (any device), no times")
    ap.add_argument("--json", help="write one record per case here")
    args = ap.parse_args(argv)
    if min(args.NT) < 1 or args.H < 1:
        ap.error("--NT and --H must be positive")
    records, ok = [], True
    for form, NT in ((form, NT) for form in args.forms for NT in args.NT):
        r = check(form, NT, args.H, args.interpret)
        records.append(r)
        ok &= within_limits(r["errors"])
        times = "" if r["ms"] is None else "  " + ", ".join(
            f"{impl} {ms:.3f} ms" for impl, ms in r["ms"].items())
        print(f"{form:12s} NT {NT:5d} H {args.H:3d}  " + "  ".join(
            f"{name} {e:.1e}" for name, e in r["errors"].items()) + times, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print("all within limits" if ok else "OVER LIMITS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
