"""Time each stage of the Pallas GDN pipeline alone on the current device (jitted, median ms).

    python -m benchmarks.profile.stages --T 32768 --H 64 --D 128

Stages, as ``backend="pallas"`` runs them for bf16 inputs, one sequence or the packed
sequences of --cu-seqlens (the kernels read q, k, v, g, beta and write o token-major, in
place): the unit-row copies of q and k (``common.l2norm``'s kernels; only above the Pallas
GDN implementation's normalize_max_k, else the kernels normalise), the intra-chunk terms
(writing the inverse too when the forward runs for a backward), the backward's recomputation
of w and u from it, the forward state recurrence fused with the output (what the forward
runs), the forward recurrence that stores h and v_new (what the backward recomputes), the
reverse recurrence, the input cotangents, and the two kernels context parallelism adds (the
summary (S_ext, M) and the entry cotangent, ``cp.exchange``); then the whole op. With
--variants, rows marked "variant" re-time a stage in another form (not what ships): the
chunk layout's transpose, other launch configurations (``StateBlocks``, ``ChunkBlocks``:
state columns per program, warps, pipeline stages); --variants TEXT times only the variant
rows whose name contains TEXT. --op kda times KDA's stages instead (token-major, the gate as
its chunk cumsum G); its --variants re-time the forward gated sums, the cotangent kernels
and the state recurrences under other launch configurations. With either op, --variants
also times the unit-row copies of q, k by XLA and under other ``RowBlocks``.
--interpret runs the kernels in interpret mode (a smoke test on the CPU, with small --T
and --H).
"""
from __future__ import annotations

import argparse
from functools import partial

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile.stages",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cu-seqlens", default=None,
                    help="packed sequences: comma list of offsets from 0 to T")
    ap.add_argument("--variants", nargs="?", const="", default=None, metavar="TEXT",
                    help="also the variant rows (only those whose name contains TEXT)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--op", choices=("gdn", "kda"), default="gdn",
                    help="kda: the KDA stages as the op runs them (chunk layout)")
    args = ap.parse_args(argv)
    cu = None
    if args.cu_seqlens:
        try:
            cu = [int(x) for x in args.cu_seqlens.split(",")]
        except ValueError:
            ap.error("--cu-seqlens must be a comma list of integers")
        if cu[0] != 0 or cu[-1] != args.T or any(b <= a for a, b in zip(cu, cu[1:])):
            ap.error("--cu-seqlens must increase strictly from 0 to --T")

    import jax
    import jax.numpy as jnp
    import jaxcp
    from benchmarks.timing import forward_backward
    from jaxcp.gate import Gate
    from jaxcp.l2norm import l2_normalize
    from jaxcp.layout import build_layout, num_chunks, to_chunks
    from jaxcp.pallas.triton.common import state as pstate
    from jaxcp.pallas.triton.common.l2norm import l2_normalized
    from jaxcp.pallas.triton.common.launch import ChunkBlocks, StateBlocks
    from jaxcp.pallas.triton.common.products import KernelPrecision
    from jaxcp.pallas.triton.gdn import grads as gdn_grads, intra as gdn_intra
    from jaxcp.stages import implementation

    if args.op == "kda":
        return _profile_kda(args, cu)
    T, H, D, C = args.T, args.H, args.D, 64
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    l2 = lambda x: l2_normalize(x).astype(x.dtype)
    unit_rows = lambda copy: lambda q, k: tuple(copy(x, jnp.bfloat16) for x in (q, k))
    unit_rows_grads = lambda copy: lambda q, k, dq, dk: jax.vjp(unit_rows(copy), q, k)[1](
        (dq, dk))
    q, k, v = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((1, T, H, 1)), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H).astype(jnp.float32))
    cu_seqlens = None if cu is None else jnp.asarray(cu, jnp.int32)
    layout, tmap = build_layout(1, T, C, cu_seqlens, 0, T)
    NT = num_chunks(T, C, None if cu is None else len(cu) - 1)
    scale = D ** -0.5
    bf16 = jnp.dtype(jnp.bfloat16)
    rows = []

    def timed(name, fn, *xs):
        if name.startswith("variant"):
            return _timed_variant(rows, args.iters, args.variants, name, fn, *xs)
        return _timed(rows, args.iters, name, fn, *xs)

    raw_q, raw_k = q, k
    norm_inside = implementation("pallas", Gate.SCALAR).normalizes_qk(D)
    if not norm_inside:
        kernel_copy = partial(l2_normalized, interpret=args.interpret)
        q, k = timed("unit rows of q, k (l2norm_fwd)", unit_rows(kernel_copy), q, k)
        timed("unit rows fwd+bwd (l2norm_fwd, l2norm_bwd)", unit_rows_grads(kernel_copy),
              raw_q, raw_k, q, k)
        if args.variants is not None:
            unit_rows_variants(partial(_timed_variant, rows, args.iters, args.variants),
                               unit_rows, unit_rows_grads, raw_q, raw_k, q, k, args.interpret)
    token_args = (q, k, v, g, beta)
    # bf16 products, terms and state recurrences, as the stage table picks for bf16 inputs
    precision = KernelPrecision(dot_dtype=bf16, tile_dtype=bf16, precise=False)
    pallas = dict(interpret=args.interpret, normalize_qk=norm_inside, precision=precision)
    intra = partial(gdn_intra.intra_chunk, scale=scale, layout=layout, chunk_size=C, **pallas)
    timed("intra_chunk", lambda *xs: intra(*xs), *token_args)
    terms = timed("intra_chunk keeping the inverse (forward under grad)",
                  lambda *xs: intra(*xs, with_inverse=True), *token_args)
    timed("recompute_w_u (backward)", lambda kept, *xs: gdn_intra.recompute_w_u(
        *xs, layout, C, kept, **pallas), gdn_intra.kept_for_w_u(terms),
        *token_args)
    h0 = jnp.zeros((1, H, D, D), jnp.float32)
    kw = dict(gate=Gate.SCALAR, precision=precision, interpret=args.interpret, token_major=True)
    output = lambda t, blocks=None: pstate.state_output(t, layout, None, h0, False,
                                                        blocks=blocks, **kw)[0]
    timed("state_output (fwd recurrence + output)", output, terms)
    h, vn, _ = timed("state_fwd (stores h, v_new)", lambda t: pstate.state_fwd(
        t, layout, None, h0, **kw), terms)
    do = r(1, T, H, D)
    _, _, x, dvn = timed("state_bwd", lambda t, d: pstate.state_bwd(
        t, layout, d, None, h0, **kw), terms, do)
    grads = lambda *xs, blocks=None: gdn_grads.chunk_grads(*xs[:5], scale, layout, C, *xs[5:],
                                                           blocks=blocks, **pallas)
    timed("chunk_grads", grads, *token_args, terms, h, vn, x, dvn, do)
    _cp_rows(timed, partial(pstate.cp_summary, **kw), partial(pstate.state_bwd, **kw),
             terms, layout, do, h0)

    if args.variants is not None:
        timed("variant: to_chunks (the padded chunk layout, a gather)", lambda *xs: tuple(
            to_chunks(x, tmap, NT, C) for x in xs), q, k, v, g, beta)
        # the other side of normalize_max_k: kernels normalising q, k or not
        if norm_inside:
            timed("variant: unit rows of q, k (l2norm_fwd)",
                  unit_rows(partial(l2_normalized, interpret=args.interpret)), raw_q, raw_k)
        other = dict(pallas, normalize_qk=not norm_inside)
        qk = (raw_q, raw_k) if other["normalize_qk"] else (l2(raw_q), l2(raw_k))
        flipped = qk + token_args[2:]
        how = "normalising q, k" if other["normalize_qk"] else "on q, k normalised by XLA"
        timed(f"variant: intra_chunk {how}", lambda *xs: gdn_intra.intra_chunk(
            *xs, scale, layout, C, **other), *flipped)
        timed(f"variant: chunk_grads {how}", lambda *xs: gdn_grads.chunk_grads(
            *xs[:5], scale, layout, C, *xs[5:], **other),
            *flipped, terms, h, vn, x, dvn, do)
        backward = lambda t, d, blocks: pstate.state_bwd(t, layout, d, None, h0,
                                                         blocks=blocks, **kw)
        for bv in (32, 16):
            timed(f"variant: state_output BV={bv}",
                  partial(output, blocks=StateBlocks(block_cols=bv)), terms)
            timed(f"variant: state_bwd BV={bv}",
                  partial(backward, blocks=StateBlocks(block_cols=bv)), terms, do)
        for warps, stages in ((8, 3), (4, 2)) if not args.interpret else ():
            chunk_blocks = ChunkBlocks(num_warps=warps, num_stages=stages)
            state_blocks = StateBlocks(num_warps=warps, max_stages=stages)
            timed(f"variant: intra_chunk {warps} warps, {stages} stages",
                  partial(intra, blocks=chunk_blocks), *token_args)
            timed(f"variant: state_output {warps} warps, {stages} stages",
                  partial(output, blocks=state_blocks), terms)
            timed(f"variant: state_bwd {warps} warps, {stages} stages",
                  partial(backward, blocks=StateBlocks(StateBlocks.default(D).block_cols,
                                                       warps, stages)), terms, do)
            timed(f"variant: chunk_grads {warps} warps, {stages} stages",
                  partial(grads, blocks=chunk_blocks), *token_args, terms, h, vn, x, dvn, do)

    op = partial(jaxcp.chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True,
                 cu_seqlens=cu_seqlens,
                 backend="interpret" if args.interpret else "pallas")
    xs = (raw_q, raw_k, v, g[..., 0], beta.astype(jnp.bfloat16))
    timed("op forward", lambda *a: op(*a)[0], *xs)
    wo = r(1, T, H, D)
    timed("op forward+backward", forward_backward(lambda *a: op(*a)[0], range(5), wo), *xs)

    _table(rows, T, H, D)


def _cp_rows(timed, cp_summary, state_bwd, terms, layout, do, h0):
    """The two kernels context parallelism adds to a device's share of the op (``cp.exchange``):
    the forward's summary (S_ext, M) and the backward's entry cotangent, each a pass of the
    state recurrence over the device's chunks."""
    timed("cp_summary (CP forward: S_ext, M)", lambda t: cp_summary(t, layout, None), terms)
    timed("state_bwd entry cotangent (CP backward)", lambda t, d: state_bwd(
        t, layout, d, None, h0, entry_only=True), terms, do)


def _timed(rows, iters, name, fn, *xs):
    """Jit fn, append (name, median ms over iters calls) to rows, print it, return fn(*xs)."""
    import jax
    from benchmarks.timing import median_ms
    fn = jax.jit(fn)
    ms = median_ms(fn, *xs, iters=iters, warmup=0)
    rows.append((name, ms))
    print(f"{name:44} {ms:9.3f} ms", flush=True)
    return fn(*xs)


def _timed_variant(rows, iters, matching, name, fn, *xs):
    """``_timed`` for a row marked "variant" whose name contains `matching` (None for the
    others): one that cannot compile is reported, not fatal (None)."""
    if matching not in name:
        return None
    try:
        return _timed(rows, iters, name, fn, *xs)
    except Exception as e:
        print(f"{name:44} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def _table(rows, T, H, D):
    import jax
    print(f"\ndevice={jax.devices()[0].device_kind} jax={jax.__version__} T={T} H={H} D={D}")
    print("| stage | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


def _profile_kda(args, cu):
    """The KDA stages of ``stages_for(backend, Gate.CHANNEL)`` for bf16 inputs, each alone,
    on inputs as the op passes them (token-major, the unit-row copies of q, k from the
    stages' ``unit_rows``, the gate as G from the gate kernel), then the whole op."""
    import jax
    import jax.numpy as jnp
    import jaxcp
    from benchmarks.timing import forward_backward
    from jaxcp.gate import Gate
    from jaxcp.layout import build_layout
    from jaxcp.stages import StageOptions, implementation, stages_for

    T, H, D, C = args.T, args.H, args.D, 64
    backend = "interpret" if args.interpret else "pallas"
    impl = implementation(backend, Gate.CHANNEL)
    qk_dtype, v_dtype = impl.qk_dtype("bfloat16", unit_rows=True), impl.v_dtype("bfloat16")
    st = stages_for(StageOptions(backend, Gate.CHANNEL, "bfloat16", chunk_size=C, unit_qk=True,
                                 tokens=T))
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((1, T, H, D)), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H).astype(jnp.float32)).astype(jnp.bfloat16)
    cu_seqlens = None if cu is None else jnp.asarray(cu, jnp.int32)
    layout, _ = build_layout(1, T, C, cu_seqlens, 0, T)
    scale = D ** -0.5
    rows = []
    timed = partial(_timed, rows, args.iters)
    gate_cumsum = lambda g: st.gate(g, layout)

    unit_rows = lambda copy: lambda q, k: tuple(copy(x, qk_dtype) for x in (q, k))
    unit_rows_grads = lambda copy: lambda q, k, dq, dk: jax.vjp(unit_rows(copy), q, k)[1](
        (dq, dk))
    q_n, k_n = timed("unit rows of q, k (l2norm_fwd)", unit_rows(st.unit_rows), q, k)
    timed("unit rows fwd+bwd (l2norm_fwd, l2norm_bwd)", unit_rows_grads(st.unit_rows),
          q, k, q_n, k_n)
    if args.variants is not None:
        unit_rows_variants(partial(_timed_variant, rows, args.iters, args.variants),
                           unit_rows, unit_rows_grads, q, k, q_n, k_n, args.interpret)
    v_n, beta_n = v.astype(v_dtype), beta.astype(jnp.float32)
    G = timed("gate cumsum (kda_gate_cumsum)", gate_cumsum, g)
    xs = (q_n, k_n, v_n, G, beta_n)
    timed("intra", lambda *a: st.intra(*a, scale, layout), *xs)
    terms = timed("intra keeping the inverse (forward under grad)",
                  lambda *a: st.intra(*a, scale, layout, with_inverse=True), *xs)
    kept = st.keep(terms)
    terms = timed("intra_again (backward)",
                  lambda kept, *a: st.intra_again(*a, scale, layout, kept), kept, *xs)
    h0 = jnp.zeros((1, H, D, D), jnp.float32)
    timed("state_output (fwd recurrence + output)",
          lambda t: st.state_output(t, layout, None, h0, False)[0], terms)
    h, vn, _ = timed("state_fwd (stores h, v_new)",
                     lambda t: st.state_fwd(t, layout, None, h0), terms)
    do = r(1, T, H, D)
    _, _, x, dvn = timed("state_bwd", lambda t, d: st.state_bwd(t, layout, d, None, h0),
                         terms, do)
    timed("chunk_grads", lambda *a: st.chunk_grads(*a[:5], scale, layout, *a[5:]),
          *xs, terms, h, vn, x, dvn, do)
    _cp_rows(timed, st.cp_summary, st.state_bwd, terms, layout, do, h0)
    if args.variants is not None:
        bounded = gate_cumsum(jnp.maximum(g, -5.0))
        _kda_variants(partial(_timed_variant, rows, args.iters, args.variants), xs,
                      (q, k, v), bounded, terms, h, vn, x, dvn, do, layout, h0, scale,
                      args.interpret)
    op = partial(jaxcp.chunk_kda, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                 backend=backend)
    timed("op forward", lambda *a: op(*a)[0], q, k, v, g, beta)
    wo = r(1, T, H, D)
    timed("op forward+backward", forward_backward(lambda *a: op(*a)[0], range(5), wo),
          q, k, v, g, beta)
    _table(rows, T, H, D)


def unit_rows_variants(timed_variant, unit_rows, unit_rows_grads, q, k, q_n, k_n,
                       interpret):
    """Rows "variant: unit rows ..." of the unit-row copies of q, k: by XLA
    (``l2norm.normalized_copy``), and the kernels under other ``RowBlocks``; forward, and
    forward+backward with the copies as cotangents."""
    from jaxcp.l2norm import normalized_copy
    from jaxcp.pallas.triton.common.l2norm import l2_normalized
    from jaxcp.pallas.triton.common.launch import RowBlocks

    copies = [("by XLA", normalized_copy)] + [
        (f"{rows} rows, {warps} warps", partial(l2_normalized, interpret=interpret,
                                                 blocks=RowBlocks(rows, warps)))
        for rows, warps in ((16, 4), (64, 4), (64, 8), (128, 8), (32, 2))]
    for how, copy in copies:
        timed_variant(f"variant: unit rows {how}", unit_rows(copy), q, k)
        timed_variant(f"variant: unit rows fwd+bwd {how}", unit_rows_grads(copy),
                      q, k, q_n, k_n)


def _kda_variants(timed_variant, xs, raw, bounded, terms, h, vn, x, dvn, do, layout, h0, scale,
                  interpret):
    """Other launch configurations of the KDA kernels (rows marked "variant"): the forward
    gated sums (their two kernels apart) and the cotangent kernels (the per-chunk pair, the
    kernel across sub-chunks, the diagonal one apart) under ``ChunkBlocks`` (columns per
    block, warps, pipeline stages, the sub-chunk kernels' launch order, every kernel with
    the chunk first in its grid),
    with 3xTF32 or 3xBF16 products in place of the shipped TF32, and with safe_gate's gate
    bound; the state recurrences under ``StateBlocks``, at 3xTF32 or 3xBF16, with TF32
    products where scaled float16 ones ship (and the other way for state_fwd), and reading
    float32 tiles (``state_output``'s tile_dtype); and the stages that read q, k with the
    norm in the kernels (normalize_qk) from the raw bf16 q, k, v (raw) in place of the
    XLA-normalised float32 copies. bounded: G of the gates clipped to -5. A variant that
    cannot compile is reported, not fatal."""
    from dataclasses import replace

    import jax.numpy as jnp
    from jaxcp.gate import Gate
    from jaxcp.pallas.triton.common import state as pstate
    from jaxcp.pallas.triton.common.launch import ChunkBlocks, StateBlocks
    from jaxcp.pallas.triton.common.products import Fp32Products, KernelPrecision
    from jaxcp.pallas.triton.kda import grads as kda_grads, intra as kda_intra
    from jaxcp.stages import state_kernel_precision

    def variant(name, fn, *a):
        timed_variant("variant: " + name, fn, *a)

    q, k, v, G, beta = xs
    # the intra kernels' products for bf16 inputs (bf16 and TF32)
    fast = KernelPrecision(precise=False)
    chunk_blocks = lambda col, warps, stages: (f"{col} columns, {warps} warps, {stages} stages",
                                               ChunkBlocks(col, warps, stages))

    def other_launch_order(shipped):
        """(row name, blocks) of the shipped blocks with the other sub-chunk grid order."""
        name = "chunks first" if shipped.sub_chunks_first else "sub-chunks first"
        return (f"{name} in the grid",
                replace(shipped, sub_chunks_first=not shipped.sub_chunks_first))

    sums = lambda blocks=None, diagonal_blocks=None: lambda *a: kda_intra.gated_sums(
        *a, scale, layout, precision=fast, blocks=blocks, diagonal_blocks=diagonal_blocks,
        interpret=interpret)
    variant("gated sums as shipped", sums(), q, k, G, beta)
    # every per-chunk kernel with the chunk first in its grid (the heads of a chunk apart)
    chunk_first = lambda blocks: replace(blocks, heads_first=False)
    variant("gated sums chunk first", sums(blocks=chunk_first(ChunkBlocks.across_sub_chunks()),
                                           diagonal_blocks=chunk_first(ChunkBlocks.sub_chunk())),
            q, k, G, beta)
    wy_chunk_first = chunk_first(ChunkBlocks.wy_terms(q.shape[-1]))
    variant("intra, wy_terms chunk first", lambda *a: kda_intra.intra_chunk(
        *a, scale, layout, blocks=wy_chunk_first,
        precision=replace(fast, tile_dtype=terms.w.dtype), interpret=interpret), *xs)
    variant("intra_again chunk first", lambda *a: kda_intra.recompute_terms(
        *a, scale, layout, kda_intra.kept_for_terms(terms), blocks=wy_chunk_first,
        precision=replace(fast, tile_dtype=terms.w.dtype), interpret=interpret), *xs)
    for how, b in [chunk_blocks(*c) for c in ((16, 1, 1), (16, 1, 3), (16, 2, 2), (32, 1, 1),
                                               (32, 1, 2), (32, 2, 2), (32, 4, 2), (64, 1, 2),
                                               (64, 2, 2), (128, 1, 1))]:
        variant(f"gated sums across sub-chunks {how}", sums(blocks=b), q, k, G, beta)
    shipped = ChunkBlocks.sub_chunk()
    for how, b in [chunk_blocks(*c) for c in ((64, 8, 1), (32, 4, 1), (32, 2, 1), (128, 8, 1),
                                               (64, 4, 2))] + [other_launch_order(shipped)]:
        variant(f"gated sums diagonal {how}", sums(diagonal_blocks=b), q, k, G, beta)
    for how, b in [chunk_blocks(*c) for c in ((64, 4, 3), (64, 8, 1), (64, 8, 2), (64, 4, 1),
                                               (32, 4, 2), (32, 8, 1))]:
        variant(f"intra, wy_terms {how}", lambda *a, b=b: kda_intra.intra_chunk(
            *a, scale, layout, blocks=b, precision=replace(fast, tile_dtype=terms.w.dtype),
            interpret=interpret), *xs)
    # the gate bound of safe_gate (lower_bound -5), on the gates clipped to it
    variant("gated sums with gate bound -5", lambda *a: kda_intra.gated_sums(
        *a, scale, layout, gate_bound=-5.0, precision=fast, interpret=interpret),
        q, k, bounded, beta)
    # the products the stage table picks for bf16 inputs, unless a row says otherwise
    products = Fp32Products.for_inputs(jnp.bfloat16)
    as_shipped = dict(precision=KernelPrecision(products=products), interpret=interpret)
    names = {Fp32Products.TF32X3: "3xTF32", Fp32Products.BF16X3: "3xBF16"}
    other_products = [(f"with {name} products", p) for p, name in names.items()
                      if p is not products]
    variant("chunk_grads with gate bound -5", lambda *a: kda_grads.chunk_grads(
        *a[:5], scale, layout, *a[5:], gate_bound=-5.0, **as_shipped),
        q, k, v, bounded, beta, terms, h, vn, x, dvn, do)
    grads = lambda blocks=None, across_blocks=None, diagonal_blocks=None, p=products: (
        lambda *a: kda_grads.chunk_grads(*a[:5], scale, layout, *a[5:], blocks=blocks,
                                         across_blocks=across_blocks,
                                         diagonal_blocks=diagonal_blocks,
                                         precision=KernelPrecision(products=p),
                                         interpret=interpret))
    grads_inputs = (*xs, terms, h, vn, x, dvn, do)
    for how, b in [chunk_blocks(*c) for c in ((16, 1, 2), (16, 2, 2), (32, 1, 2), (32, 2, 2),
                                               (32, 4, 2), (64, 4, 1), (64, 4, 2), (64, 8, 2),
                                               (128, 4, 2), (128, 8, 1))]:
        variant(f"chunk_grads across sub-chunks {how}", grads(across_blocks=b), *grads_inputs)
    for how, b in [chunk_blocks(*c) for c in ((64, 4, 1), (32, 4, 2), (64, 8, 2))]:
        variant(f"chunk_grads inter, wy {how}", grads(blocks=b), *grads_inputs)
    shipped = ChunkBlocks.grads_sub_chunk(q.shape[-1])
    diagonal = [(name, replace(b, sub_chunks_first=True))
                for name, b in [chunk_blocks(*c) for c in ((16, 1, 2), (32, 2, 2), (64, 2, 2),
                                                           (64, 4, 2))]]
    for how, b in diagonal + [other_launch_order(shipped)]:
        variant(f"chunk_grads diagonal {how}", grads(diagonal_blocks=b), *grads_inputs)
    for how, p in other_products:
        variant(f"chunk_grads {how}", grads(p=p), *grads_inputs)
    variant("chunk_grads chunk first", grads(
        blocks=chunk_first(ChunkBlocks.kda_grads()),
        across_blocks=chunk_first(ChunkBlocks.grads_across_sub_chunks()),
        diagonal_blocks=chunk_first(ChunkBlocks.grads_sub_chunk(q.shape[-1]))), *grads_inputs)
    # the norm in the kernels: raw bf16 q, k, v, q, k normalised as read
    normed_kw = dict(normalize_qk=True, interpret=interpret)
    raw_xs = (*raw, *xs[3:])
    variant("intra with the norm in the kernels (raw bf16 q, k, v)", lambda *a: (
        kda_intra.intra_chunk(*a, scale, layout, precision=fast, **normed_kw)), *raw_xs)
    variant("intra_again with the norm in the kernels", lambda *a: (
        kda_intra.recompute_terms(*a, scale, layout, kda_intra.kept_for_terms(terms),
                                  precision=fast, **normed_kw)), *raw_xs)
    variant("chunk_grads with the norm in the kernels (its vjp by XLA)", lambda *a: (
        kda_grads.chunk_grads(*a[:5], scale, layout, *a[5:],
                              **dict(normed_kw, **as_shipped))),
        *raw_xs, terms, h, vn, x, dvn, do)
    # as the stage table runs them: scaled float16 products on float16 tiles
    state_precision = KernelPrecision(tile_dtype=terms.w.dtype, products=products,
                                      scaled_float16=terms.w.dtype == jnp.float16)
    kw = dict(gate=Gate.CHANNEL, token_major=True, precision=state_precision,
              interpret=interpret)

    def state_variants(how, stage_terms, stages, flip_scaled=False, **options):
        """Rows "<stage> <how>" of the named state recurrences with options over kw, each
        at its stage-table precision (``state_kernel_precision``); flip_scaled: scaled
        float16 products where the stage table runs TF32 ones, and the other way."""
        def stage_kw(stage):
            kernel_kw = dict(kw, **options)
            p = state_kernel_precision(stage, kernel_kw["precision"])
            if flip_scaled:
                p = replace(p, scaled_float16=not p.scaled_float16)
            return dict(kernel_kw, precision=p)
        runs = {"state_output": lambda t: pstate.state_output(
                    t, layout, None, h0, False, tokens=do.shape[1],
                    **stage_kw("state_output"))[0],
                "state_fwd": lambda t: pstate.state_fwd(t, layout, None, h0,
                                                        **stage_kw("state_fwd")),
                "state_bwd": lambda t, d: pstate.state_bwd(t, layout, d, None, h0,
                                                           **stage_kw("state_bwd"))}
        for stage in stages:
            args = (stage_terms, do) if stage == "state_bwd" else (stage_terms,)
            variant(f"{stage} {how}", runs[stage], *args)

    all_three = ("state_output", "state_fwd", "state_bwd")
    if state_precision.scaled_float16:
        state_variants("with TF32 products (state_fwd: scaled float16)", terms, all_three,
                       flip_scaled=True)
    for how, p in other_products:
        state_variants(how, terms, ("state_output", "state_bwd"),
                       precision=replace(state_precision, products=p))
    # float32 tiles of w, kd, qg, attn (cast before the timed calls)
    full = terms._replace(**{name: getattr(terms, name).astype(jnp.float32)
                             for name in ("w", "kd", "qg", "attn")})
    state_variants("with float32 tiles", full, all_three,
                   precision=replace(state_precision, tile_dtype=jnp.float32))
    for bv, warps in ((64, 4), (64, 8), (32, 4), (32, 8), (16, 4), (16, 2)):
        state_variants(f"BV={bv}, {warps} warps", terms, all_three,
                       blocks=StateBlocks(block_cols=bv, num_warps=warps))


if __name__ == "__main__":
    main()
