"""Time jaxcp (pallas, xla) and FLA side by side on one GPU: GDN or KDA, B = 1, bf16,
L2-normalised q/k.

    python -m benchmarks.bench.kernels --json docs/benchmarks/kernels.json     # on the GPU machine
    python -m benchmarks.bench.kernels --op kda --json docs/benchmarks/kernels_kda.json
    python -m benchmarks.bench.kernels --report docs/benchmarks/kernels.json   # kernels.md, .png
    python -m benchmarks.bench.kernels --op kda --gate-in-kernel --json kda_gate.json
    python -m benchmarks.bench.kernels --packed --impls jaxcp-mosaic,fla --json packed.json

--gate-in-kernel (KDA): both sides take g as the raw gate and compute the decay in the op
(use_gate_in_kernel, safe_gate, lower_bound = -5, A_log = dt_bias = 0: ``GATE_IN_KERNEL``).
--packed: both sides take each shape's T tokens as the CP benchmark's ten packed sequences
(``benchmarks.bench.cp.layouts``, cu_seqlens scaled to T). Either flag's records carry it
(``Setting``), and belong in a file of their own.

The PyTorch implementations run in a child process of the same run on the same GPU, before
JAX takes the device: FLA (flash-linear-attention, Triton; impl "fla") and, for GDN, FlashQLA
(TileLang; "flashqla" with its in-device split of one sequence, ``auto_cp=True``, and
"flashqla-nocp" without it). FLA 0.6 would hand GDN to FlashQLA where FlashQLA is installed;
the child turns that off (FLA_FLASH_QLA=0), so "fla" is FLA's own Triton path. An
implementation that cannot be imported, or a shape it does not take (FlashQLA: K = V = 128
only), is skipped with a note.
Each is timed with q, k normalised by torch (F.normalize before the op) and by its fused
kernel (use_qk_l2norm_in_kernel=True); its record is the faster (``fla_l2norm``). Their
forward runs with autograd off (torch.no_grad), as jaxcp's jitted forward saves nothing for
a backward.
jaxcp normalises inside the op (use_qk_l2norm_in_kernel=True); both include the norm's backward.
A call is the jitted forward (returns o) or forward+backward (o, then the gradients of q, k,
v, g, beta for a random output cotangent by jax.vjp: ``benchmarks.timing.forward_backward``,
as FLA's ``o.backward(do)``). Both sides time the GPU's time per call, calls queued back to
back: FLA by triton's do_bench (median), jaxcp by ``benchmarks.timing.pipelined_ms`` (median
of --iters rounds of 4 queued calls). Each record also has the call's peak memory
(peak_bytes): jaxcp's from the compiled call's memory analysis (arguments, outputs and XLA's
temporaries), FLA's the torch allocator's peak over one call, its inputs, output cotangent
and gradients live.

``markdown`` is the records' table, the page docs/benchmarks/kernels*.md
(``benchmarks.pages``), with ``floor_ms``, the shape's floor.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.records import saver
from jaxcp.cli import OneLineParser

CONFIGS = [(8192, 64, 128), (32768, 64, 128), (32768, 16, 256)]   # (T, H, K = V)
CHUNK = 64
# measured on H100 and H200: memory bytes/s, dense bf16 FLOP/s
PEAKS = {"H100": (3.0e12, 790e12), "H200": (4.3e12, 790e12)}
IMPLS = ("jaxcp-pallas", "jaxcp-mosaic", "jaxcp-xla", "fla", "flashqla", "flashqla-nocp")
TORCH_IMPLS = ("fla", "flashqla", "flashqla-nocp")
# KDA's gate computed in the op (--gate-in-kernel), on both sides: the raw gate is the
# benchmark's g, A_log and dt_bias are zeros
GATE_IN_KERNEL = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What every call of a run shares beyond its shape: KDA's gate computed in the op
    (``GATE_IN_KERNEL``) and the tokens as ten packed sequences rather than one."""
    gate_in_kernel: bool = False
    packed: bool = False

    def cu_seqlens(self, T: int) -> list[int] | None:
        """The packed sequences' offsets in T tokens, or None (one sequence)."""
        if not self.packed:
            return None
        from benchmarks.bench import cp
        return cp.layouts(T, ["packed"])[0]

    def fields(self, T: int) -> dict:
        """What a record of this setting carries beyond a default run's fields."""
        return ({"gate_in_kernel": True} if self.gate_in_kernel else {}) | (
            {"cu_seqlens": self.cu_seqlens(T)} if self.packed else {})

    def flags(self) -> list[str]:
        """This setting's command-line flags."""
        return ((["--gate-in-kernel"] if self.gate_in_kernel else [])
                + (["--packed"] if self.packed else []))


def jaxcp_op(name: str):
    """jaxcp's ``chunk_kda`` (name "kda") or ``chunk_gated_delta_rule`` ("gdn")."""
    import jaxcp
    return jaxcp.chunk_kda if name == "kda" else jaxcp.chunk_gated_delta_rule


def jaxcp_inputs(op: str, T: int, H: int, D: int):
    """q, k, v [1, T, H, D] bf16 (normal), g float32 (log-sigmoid of normal; [1, T, H, D] for
    KDA, [1, T, H] for GDN), beta [1, T, H] bf16 (sigmoid of normal) and an output cotangent
    do [1, T, H, D] bf16; seed 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, k, v = r(1, T, H, D), r(1, T, H, D), r(1, T, H, D)
    gate_shape = (1, T, H, D) if op == "kda" else (1, T, H)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal(gate_shape), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H))
    return q, k, v, g, beta, r(1, T, H, D)


def torch_op(impl: str, op: str):
    """The PyTorch op of a torch implementation: FLA's, or FlashQLA's GDN with
    (impl "flashqla") or without ("flashqla-nocp") its in-device split."""
    if impl == "fla":
        from benchmarks import fla
        return fla.op(op)
    if op != "gdn":
        raise ValueError(f"impl {impl!r} has GDN only, not {op!r}")
    import functools
    import flash_qla
    return functools.partial(flash_qla.chunk_gated_delta_rule, auto_cp=impl == "flashqla")


def torch_version(impl: str) -> str:
    """The installed version of a torch implementation's package."""
    if impl == "fla":
        from benchmarks import fla
        return fla.version()
    import flash_qla
    return getattr(flash_qla, "__version__", "?")


def _without_grad(fwd):
    """fwd called with autograd off: a forward that keeps nothing for a backward."""
    import torch

    def call():
        with torch.no_grad():
            return fwd()
    return call


def run_torch(impls, op: str, configs, iters: int, setting: Setting = Setting()) -> list[dict]:
    """Time the torch implementations (``TORCH_IMPLS``) on each shape and pass; one that
    cannot be imported, or a shape one refuses, is reported on stderr and left out."""
    os.environ["FLA_FLASH_QLA"] = "0"     # "fla": FLA's own kernels, not its FlashQLA backend
    import torch
    import torch.nn.functional as F
    import triton
    from benchmarks import fla

    out = []
    for impl in impls:
        try:
            impl_op, version = torch_op(impl, op), torch_version(impl)
        except ImportError as e:
            print(f"{impl} not run: {e}", file=sys.stderr, flush=True)
            continue
        for T, H, D in configs:
            q, k, v, g, beta = fla.inputs(op, T, H, D)
            op_kwargs = {}
            if setting.gate_in_kernel:
                zeros = lambda n: torch.zeros(n, device="cuda")
                op_kwargs = dict(GATE_IN_KERNEL, A_log=zeros(H), dt_bias=zeros(H * D))
            if setting.packed:
                op_kwargs["cu_seqlens"] = torch.tensor(setting.cu_seqlens(T), device="cuda",
                                                       dtype=torch.long)
            # two ways to normalise q, k: torch before the op or the op's fused kernel;
            # the implementation is credited with the faster of the two
            fwds = {"torch": lambda: impl_op(F.normalize(q, p=2, dim=-1),
                                             F.normalize(k, p=2, dim=-1), v, g, beta,
                                             **op_kwargs)[0],
                    "in-kernel": lambda: impl_op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                 **op_kwargs)[0]}
            try:
                do = torch.randn_like(fwds["torch"]())
            except Exception as e:   # a shape the implementation does not take
                print(f"{impl} T={T} H={H} D={D}: not run: {type(e).__name__}: "
                      f"{str(e)[:200]}", file=sys.stderr, flush=True)
                continue
            bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=max(100, iters * 5),
                                                       return_mode="median")
            calls = {"fwd": _without_grad, "fwd+bwd": lambda fwd: lambda: fwd().backward(do)}
            for passes in ("fwd", "fwd+bwd"):
                times = {how: bench(calls[passes](fwd)) for how, fwd in fwds.items()}
                how = min(times, key=times.get)
                out.append(dict(op=op, impl=impl, T=T, H=H, K=D, V=D, **{"pass": passes},
                                ms=times[how],
                                peak_bytes=fla.peak_bytes(calls[passes](fwds[how])),
                                fla_l2norm=how, device=torch.cuda.get_device_name(),
                                **{"fla" if impl == "fla" else "flashqla": version},
                                **setting.fields(T)))
                print(f"{impl} T={T} H={H} D={D} {passes}: " + ", ".join(
                    f"l2norm {h} {t:.3f} ms" for h, t in times.items()),
                    file=sys.stderr, flush=True)
    return out


def run_jaxcp(op: str, configs, impls, iters: int, fla_version: str, done=lambda: None,
              compile_threads: int = 8, setting: Setting = Setting()) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from benchmarks.timing import forward_backward, time_side_by_side

    device = jax.devices()[0].device_kind
    out = []
    for T, H, D in configs:
        q, k, v, g, beta, do = jaxcp_inputs(op, T, H, D)
        op_fn = jaxcp_op(op)
        op_kwargs = {}
        if setting.gate_in_kernel:
            op_kwargs = dict(GATE_IN_KERNEL, A_log=jnp.zeros(H), dt_bias=jnp.zeros(H * D))
        if setting.packed:
            op_kwargs["cu_seqlens"] = jnp.asarray(setting.cu_seqlens(T), jnp.int32)
        jobs = []     # (impl, pass, jitted function)
        for impl in impls:
            backend = impl.removeprefix("jaxcp-")
            call = lambda q, k, v, g, beta, backend=backend: op_fn(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend=backend, **op_kwargs)[0]
            jobs += [(impl, "fwd", jax.jit(call)),
                     (impl, "fwd+bwd", jax.jit(forward_backward(call, range(5), do)))]
        xs = (q, k, v, g, beta)
        times = time_side_by_side([(fn, xs) for _, _, fn in jobs], iters, compile_threads)
        for (impl, passes, _), timed in zip(jobs, times):
            if isinstance(timed, Exception):   # an impl that cannot run this shape: reported
                print(f"{impl} T={T} H={H} D={D} {passes}: failed: {type(timed).__name__}: "
                      f"{str(timed)[:300]}", flush=True)
                continue
            out.append(dict(op=op, impl=impl, T=T, H=H, K=D, V=D, **{"pass": passes},
                            ms=timed.ms, peak_bytes=timed.peak_bytes, device=device,
                            jax=jax.__version__, fla=fla_version, **setting.fields(T)))
            print(f"{impl} T={T} H={H} D={D} {passes}: {timed.ms:.3f} ms", flush=True)
            done(out)
    return out


def floor_ms(op: str, T: int, H: int, D: int, passes: str, device: str) -> float:
    """Physical floor of the op on this shape: max(bytes / bandwidth, FLOPs / tensor peak).

    fwd bytes: q, k, v read, o written (bf16), beta and g (fp32; g one value per token and
    head for GDN, D for KDA). fwd FLOPs per (chunk, head), both ops:
    2 [C^2 (3K + 2V) + 3 C K V] (kk^T, w, u, qk^T; w S, k^T v; q S, attn v). fwd+bwd: about
    3x the FLOPs (recompute + 2x for the gradients) and 2.5x the bytes (inputs, do, five
    gradients)."""
    bw, peak = next((v for k, v in PEAKS.items() if k in device), PEAKS["H100"])
    C = CHUNK
    n_chunk_heads = T // C * H
    flops = 2 * (C * C * (3 * D + 2 * D) + 3 * C * D * D) * n_chunk_heads
    gate_bytes = 4 * (D if op == "kda" else 1)
    bytes_ = (4 * D * 2 + 4 + gate_bytes) * T * H
    if passes == "fwd+bwd":
        flops, bytes_ = 3 * flops, 2.5 * bytes_
    return 1e3 * max(bytes_ / bw, flops / peak)


def setting_text(records: list[dict]) -> str:
    """The records' ``Setting`` where it is not the default, for the page's setting line."""
    text = ""
    if any(r.get("gate_in_kernel") for r in records):
        text += (" KDA's gate computed in the op from the raw g (use_gate_in_kernel, "
                 "safe_gate, lower_bound = -5, A_log = dt_bias = 0).")
    if any(r.get("cu_seqlens") for r in records):
        text += (" Each shape's T tokens as ten packed sequences (cu_seqlens: the CP "
                 "benchmark's set scaled to T).")
    return text


def op_of(records: list[dict]) -> str:
    """The one op ("gdn" or "kda") that the records time."""
    ops = {r["op"] for r in records}
    if len(ops) != 1:
        raise ValueError(f"records: one op per benchmark file, got {sorted(ops)}")
    return ops.pop()


def shapes(records: list[dict]) -> list[tuple[int, int, int]]:
    """The (T, H, K) of the records, by T, then the most heads first."""
    return sorted({(r["T"], r["H"], r["K"]) for r in records}, key=lambda c: (c[0], -c[1]))


def impls_of(records: list[dict]) -> list[str]:
    """The implementations the records hold, in IMPLS order."""
    return [i for i in IMPLS if any(r["impl"] == i for r in records)]


def device_of(records: list[dict]) -> str:
    """The GPU the records ran on, as JAX names it (the torch records' name otherwise)."""
    return next((r["device"] for r in records if r["impl"] not in TORCH_IMPLS),
                records[0]["device"])


def markdown(records: list[dict]) -> str:
    """Title, setting, one row per shape and pass (ms per implementation; pallas and
    mosaic / FLA and / FlashQLA, and mosaic / pallas, where both ran; the floor), and how
    the floor is counted."""
    device = device_of(records)
    jax = next((r["jax"] for r in records if r.get("jax")), "?")
    fla = next((r["fla"] for r in records if r.get("fla")), "not run")
    flashqla = next((r["flashqla"] for r in records if r.get("flashqla")), None)
    names = impls_of(records)
    against = [a for a in ("fla", "flashqla") if a in names]
    short = {"fla": "FLA", "flashqla": "FlashQLA", "jaxcp-pallas": "pallas",
             "jaxcp-mosaic": "mosaic"}
    ours = [n for n in ("jaxcp-pallas", "jaxcp-mosaic") if n in names]
    ratios = [(n, a) for n in ours for a in against] + (
        [("jaxcp-mosaic", "jaxcp-pallas")] if len(ours) == 2 else [])
    op = op_of(records)
    ms = {(r["impl"], r["T"], r["H"], r["K"], r["pass"]): r["ms"] for r in records}
    peak = {(r["impl"], r["T"], r["H"], r["K"], r["pass"]): r.get("peak_bytes")
            for r in records}
    with_peaks = any(v is not None for v in peak.values())
    lines = [f"# {op.upper()} kernel benchmark", "",
             f"Device: {device}; jax {jax}; FLA {fla}"
             + (f"; FlashQLA {flashqla} (flashqla: its in-device split on, flashqla-nocp: off)"
                if flashqla else "") + ". B = 1, bf16, q/k L2-normalised, "
             "median ms per call" + (", and peak GiB per call (jaxcp: the compiled call's "
                                     "arguments, outputs and temporaries"
                                     + ("; " + " and ".join(short[a] for a in against)
                                        + ": the allocator's peak over one call"
                                        if against else "") + ")"
                                     if with_peaks else "")
             + "." + setting_text(records), "",
             "| T | H | K=V | pass | " + " | ".join(names) + " | "
             + "".join(f"{short[n]} / {short[a]} | " for n, a in ratios) + "floor |"
             + (" peak GiB " + " / ".join(names) + " |" if with_peaks else ""),
             "|---|---|---|---|" + "---|" * (len(names) + len(ratios)) + "---|"
             + ("---|" if with_peaks else "")]
    for T, H, D in shapes(records):
        for passes in ("fwd", "fwd+bwd"):
            vals = [ms.get((i, T, H, D, passes)) for i in names]
            at = lambda impl: ms.get((impl, T, H, D, passes))
            row = (f"| {T} | {H} | {D} | {passes} | "
                   + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + " | "
                   + "".join(f"{at(n) / at(a):.2f}x | " if at(n) and at(a) else "- | "
                             for n, a in ratios)
                   + f"{floor_ms(op, T, H, D, passes, device):.2f} |")
            if with_peaks:
                gib = [peak.get((i, T, H, D, passes)) for i in names]
                row += " " + " / ".join("-" if b is None else f"{b / 2**30:.2f}"
                                        for b in gib) + " |"
            lines.append(row)
    lines += ["", "Floor: max(bytes / bandwidth, FLOPs / bf16 tensor peak) with the measured "
              "3.0 TB/s (H100) or 4.3 TB/s (H200) and 790 TFLOP/s (`benchmarks.bench."
              "kernels.floor_ms`)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m benchmarks.bench.kernels",
                       description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("gdn", "kda"), default="gdn")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--report", help="write .md and .png from these records and exit")
    ap.add_argument("--impls", default="jaxcp-pallas,jaxcp-xla,fla",
                    help="comma list of " + ", ".join(IMPLS) + " (jaxcp-mosaic, flashqla*: "
                         "GDN only)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile-threads", type=int, default=8,
                    help="programs compiled at once (1: one at a time)")
    ap.add_argument("--configs", default=None, help="T:H:D,... (default: the three of the spec)")
    ap.add_argument("--gate-in-kernel", action="store_true",
                    help="KDA: both sides compute the gate from the raw g in the op "
                         "(use_gate_in_kernel, safe_gate, lower_bound -5)")
    ap.add_argument("--packed", action="store_true",
                    help="each shape's T tokens as ten packed sequences (cu_seqlens; the CP "
                         "benchmark's set scaled to T)")
    ap.add_argument("--torch-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_threads < 1:
        ap.error("--compile-threads must be positive")
    if args.gate_in_kernel and args.op != "kda":
        ap.error("--gate-in-kernel is for --op kda")
    if args.report:
        from benchmarks import pages
        pages.write(args.report)
        return 0
    configs = CONFIGS if not args.configs else [
        tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    impls = args.impls.split(",")
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        ap.error(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(IMPLS)}")
    torch_impls = [i for i in impls if i in TORCH_IMPLS]
    gdn_only = [i for i in impls if i.startswith("flashqla") or i == "jaxcp-mosaic"]
    if args.op != "gdn" and gdn_only:
        ap.error(f"--impls: {', '.join(gdn_only)}: GDN only (--op gdn)")
    setting = Setting(gate_in_kernel=args.gate_in_kernel, packed=args.packed)
    if args.torch_child:
        with open(args.torch_child, "w") as f:
            json.dump(run_torch(torch_impls, args.op, configs, args.iters, setting), f)
        return 0
    records = []
    fla_version = "not run"
    if torch_impls:
        # a child process, so that torch has the GPU to itself before JAX starts; its records
        # come back in a file, its stdout being free for the libraries' own messages
        with tempfile.TemporaryDirectory() as folder:
            records_path = os.path.join(folder, "torch_records.json")
            child = subprocess.run([sys.executable, "-m", __spec__.name,
                                    "--torch-child", records_path,
                                    "--op", args.op, "--iters", str(args.iters),
                                    "--impls", ",".join(torch_impls),
                                    "--configs",
                                    ",".join(":".join(map(str, c)) for c in configs)]
                                   + setting.flags())
            torch_records = None
            if child.returncode == 0:
                with open(records_path) as f:
                    torch_records = json.load(f)
        if torch_records is not None:
            records += torch_records
            fla_version = next((r["fla"] for r in torch_records if r.get("fla")), fla_version)
        else:
            print(f"PyTorch implementations not run (exit {child.returncode}); see their "
                  "messages above", flush=True)

    save = saver(args.json, records)
    save()
    records += run_jaxcp(args.op, configs, [i for i in impls if i not in TORCH_IMPLS],
                         args.iters, fla_version, save, args.compile_threads, setting)
    save()
    print(f"{'impl':13} {'T':>6} {'H':>3} {'D':>4} {'pass':8} {'ms':>9}")
    for r in records:
        print(f"{r['impl']:13} {r['T']:>6} {r['H']:>3} {r['K']:>4} {r['pass']:8} {r['ms']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
