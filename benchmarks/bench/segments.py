"""Time the delta-rule ops with each sequence run as segments on one GPU
(``jaxcp.cp.segments``) beside the unsplit op, in one run.

    python -m benchmarks.bench.segments --json docs/benchmarks/segments.json   # on the GPU
    python -m benchmarks.pages docs/benchmarks/segments.json                   # segments.md

Inputs as ``kernels`` times them (one sequence, q, k, v bf16, q and k normalised in the op,
backend "pallas"), per --configs shape T:H:D and op: the forward and the forward+backward
(``bench.cp.jitted``: a cotangent of ones) for every count of --segments (1: the unsplit op)
and for the op's own choice ("auto", segments=None: ``choose_segments``), compiled side by
side and timed in turn (``timing.time_side_by_side``).

With --devices W > 1, the T tokens split over W GPUs instead (allgather, contiguous and
zigzag layouts), each device's pieces in segments.

Each record: op, T, H, K, V, W, layout ("-" on one device), segments (an int or "auto"),
chosen (the count the op runs per piece), pass, ms, device, jax.
"""
from __future__ import annotations

import sys

from benchmarks.bench.cp import comma_list
from benchmarks.bench.kernels import jaxcp_inputs
from benchmarks.records import saver
from jaxcp.cli import OneLineParser

CONFIGS = ((131072, 16, 128), (32768, 16, 128), (131072, 8, 128), (32768, 64, 128),
           (131072, 16, 256))
SEGMENTS = (1, 2, 4, 8)
PASSES = ("fwd", "fwd+bwd")


def chosen_segments(op: str, piece_len: int, H: int, D: int, across_devices: bool) -> int:
    """The count the op picks for a piece of this shape (segments=None) on the Pallas
    backend, on one device or under allgather CP (across_devices)."""
    from jaxcp.cp.segments import choose_segments
    from jaxcp.gate import Gate
    return choose_segments(None, backend="pallas", gate=Gate.CHANNEL if op == "kda" else
                           Gate.SCALAR, across_devices=across_devices, batch=1, heads=H,
                           k_dim=D, v_dim=D, piece_len=piece_len)


def measure(op: str, T: int, H: int, D: int, counts, iters: int, W: int = 1) -> list[dict]:
    """Records of one shape, for every count and "auto": on one device, or with W > 1 under
    CP (allgather, both layouts, T tokens over W devices)."""
    import jax
    from benchmarks.bench import cp
    from benchmarks.timing import time_side_by_side

    one = jaxcp_inputs(op, T, H, D)[:5]
    mesh = cp.seq_mesh(W) if W > 1 else None
    settings = [(1, None)] if W == 1 else [(W, layout) for layout in cp.CP_LAYOUTS]
    jobs = []         # (W, layout, segments, pass, jitted function, inputs)
    for w, layout in settings:
        xs = one if layout is None else cp.placed(one, mesh, layout)
        for segments in [*counts, "auto"]:
            call = cp.op_call(op, None, "pallas", "none" if layout is None else "allgather",
                              layout or "contiguous", mesh, use_qk_l2norm_in_kernel=True,
                              segments=None if segments == "auto" else segments)
            jobs += [(w, layout, segments, passes, cp.jitted(call, passes), xs)
                     for passes in PASSES]
    out = []
    timed = time_side_by_side([(f, xs) for *_, f, xs in jobs], iters)
    for (w, layout, segments, passes, _, _), t in zip(jobs, timed):
        label = f"{op} T={T} H={H} D={D} W={w} {layout or ''} segments={segments} {passes}"
        if isinstance(t, Exception):
            print(f"{label}: failed: {type(t).__name__}: {str(t)[:300]}", flush=True)
            continue
        chosen = chosen_segments(op, T // w // (2 if layout == "zigzag" else 1), H, D,
                                 across_devices=layout is not None)
        out.append(dict(op=op, T=T, H=H, K=D, V=D, W=w, layout=layout or "-",
                        segments=segments, chosen=chosen if segments == "auto" else segments,
                        **{"pass": passes}, ms=t.ms, device=jax.devices()[0].device_kind,
                        jax=jax.__version__))
        print(f"{label}: {t.ms:.3f} ms", flush=True)
    return out


def markdown(records: list[dict]) -> str:
    if not records:
        return "# Segments\n\nNo records.\n"
    counts = sorted({r["segments"] for r in records if r["segments"] != "auto"})
    key = lambda r: (r["op"], r["T"], r["H"], r["K"], r.get("W", 1), r.get("layout", "-"),
                     r["pass"])
    at = {(*key(r), r["segments"]): r for r in records}
    lines = ["# Segments", "",
             f"One sequence run as S segments on one GPU ({records[0]['device']}), ms per "
             "call; bf16, q and k normalised in the op. auto: the op's own choice "
             "(segments=None), the S it ran and its time's ratio to the unsplit op's. W > 1: "
             "the T tokens split over W GPUs (allgather, in the layout), S per piece.", "",
             "| op | T | H | K | W | layout | pass | " + " | ".join(f"S = {s}" for s in counts)
             + " | auto (S) | unsplit / auto |",
             "|---|---|---|---|---|---|---|" + "---|" * len(counts) + "---|---|"]
    for row in sorted({key(r) for r in records}, key=lambda x: (x[0], -x[1], x[2:])):
        op, T, H, K, W, layout, passes = row
        cells = [at.get((*row, s)) for s in counts]
        auto, unsplit = at.get((*row, "auto")), at.get((*row, 1))
        ms = lambda r: "-" if r is None else f"{r['ms']:.3f}"
        ratio = ("-" if auto is None or unsplit is None
                 else f"{unsplit['ms'] / auto['ms']:.2f}x")
        lines.append(f"| {op.upper()} | {T} | {H} | {K} | {W} | {layout} | {passes} | "
                     + " | ".join(ms(c) for c in cells)
                     + f" | {ms(auto)} ({'-' if auto is None else auto['chosen']}) | {ratio} |")
    versions = sorted({f"jax {r['jax']}" for r in records})
    lines += ["", "Versions: " + "; ".join(versions) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m benchmarks.bench.segments",
                       description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--ops", default="gdn,kda", help="comma list of gdn, kda")
    ap.add_argument("--configs", default=",".join(":".join(map(str, c)) for c in CONFIGS),
                    help="T:H:D,...")
    ap.add_argument("--segments", type=int, nargs="+", default=list(SEGMENTS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--devices", type=int, default=1,
                    help="W > 1: under CP over the first W GPUs")
    args = ap.parse_args(argv)
    ops = comma_list(ap, "--ops", args.ops, ("gdn", "kda"))
    try:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    except ValueError:
        ap.error("--configs: comma list of T:H:D")
    if any(len(c) != 3 or min(c) < 1 for c in configs):
        ap.error("--configs: comma list of T:H:D, each positive")
    if min(args.segments) < 1 or args.iters < 1 or args.devices < 1:
        ap.error("--segments, --iters and --devices must be positive")
    records: list[dict] = []
    save = saver(args.json, records)
    for op in ops:
        for T, H, D in configs:
            records += measure(op, T, H, D, [s for s in args.segments if T % s == 0],
                               args.iters, args.devices)
            save()
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
