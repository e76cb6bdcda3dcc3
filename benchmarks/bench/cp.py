"""Context-parallel GDN on W devices: no CP vs allgather / all_to_all / relay, and FLA's KCP
and head all-to-all.

    python -m benchmarks.bench.cp --json docs/benchmarks/cp_w2.json    # on the multi-GPU machine
    python -m benchmarks.bench.cp --report docs/benchmarks/cp_w2.json  # cp_w2.md, .png

bf16, B = 1, q/k L2-normalised before the timed calls (jaxcp and FLA alike, as FLA's CP
benchmark does; the norm is not part of the times); one sequence and a packed set of 10.
fwd+bwd computes o and then the gradients for a cotangent of ones, as FLA's
``o.backward(torch.ones_like(o))`` (``benchmarks.timing.forward_backward``).
"none" runs the whole sequence on one device; the CP strategies split it over all W.
rate = (t_none / W) / t (1.0 is a perfect split). FLA (torch) runs first, as W processes
under torchrun, so that JAX has the GPUs afterwards. Each time is per call, for calls queued
back to back (GPU time): the median of --iters rounds of 4 calls, by CUDA events for FLA and
``benchmarks.timing.pipelined_ms`` for jaxcp. ``markdown`` is the records' tables, the page
docs/benchmarks/cp*.md (``benchmarks.pages``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from benchmarks.records import saver


VARLEN = [0, 2960, 5212, 9513, 13567, 17443, 20634, 23521, 26281, 31785, 32768]


LAYOUTS = ("single", "packed")


def layouts(T: int, names=LAYOUTS) -> list[list[int]]:
    """cu_seqlens of the named layouts: "single" (one sequence), "packed" (the set of 10,
    scaled to T)."""
    cus = {"single": [0, T], "packed": [round(c * T / VARLEN[-1]) for c in VARLEN]}
    return [cus[n] for n in names]


def fla_worker(T: int, H: int, D: int, iters: int, names=LAYOUTS) -> None:
    """One torchrun rank: FLA's no-CP time, its KCP, and a head all-to-all around FLA's
    single-device op (q, k, v, g, beta exchanged from [1, T/W, H] to [1, T, H/W] shards, the
    output and, with the backward, the cotangent and the gradients exchanged back: the
    communication is timed with the op); rank 0 prints JSON records."""
    import statistics
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from fla.ops.cp import build_cp_context
    from benchmarks import fla

    chunk_gated_delta_rule = fla.op("gdn")

    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)

    def timeit(fn, calls=4):
        # CUDA events around `calls` queued calls, per call: as benchmarks.timing.pipelined_ms
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            dist.barrier()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(calls):
                fn()
            end.record(); torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        t = torch.tensor([statistics.median(times)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def seq_to_heads(x):
        """[1, T/W, H, ...] on each rank -> [1, T, H/W, ...]: every rank's tokens of my heads."""
        out = [torch.empty_like(p) for p in x.chunk(W, dim=2)]
        dist.all_to_all(out, [p.contiguous() for p in x.chunk(W, dim=2)])
        return torch.cat(out, dim=1)

    def heads_to_seq(x):
        """[1, T, H/W, ...] -> [1, T/W, H, ...]: my tokens of every rank's heads."""
        out = [torch.empty_like(p) for p in x.chunk(W, dim=1)]
        dist.all_to_all(out, [p.contiguous() for p in x.chunk(W, dim=1)])
        return torch.cat(out, dim=2)

    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)
    q, k, v = (F.normalize(mk(1, T, H, D), p=2, dim=-1) if i < 2 else mk(1, T, H, D)
               for i in range(3))
    g = F.logsigmoid(torch.randn(1, T, H, device=dev))
    beta = mk(1, T, H).sigmoid()
    records = []
    for cu_list in layouts(T, names):
        cu = torch.tensor(cu_list, device=dev, dtype=torch.long)
        TL = T // W
        local = [x[:, rank * TL:(rank + 1) * TL] for x in (q, k, v, g, beta)]
        ctx = build_cp_context(cu, group=dist.group.WORLD)
        for backward in (False, True):
            def call(xs, **kw):
                ts = [x.detach().requires_grad_(backward) for x in xs]
                o = chunk_gated_delta_rule(*ts, **kw)[0]
                if backward:
                    o.backward(torch.ones_like(o))

            def head_all_to_all():
                hs = [seq_to_heads(x).detach().requires_grad_(backward) for x in local]
                o = chunk_gated_delta_rule(*hs, cu_seqlens=cu)[0]
                o_local = heads_to_seq(o.detach())
                if backward:
                    o.backward(seq_to_heads(torch.ones_like(o_local)))
                    for x in hs:
                        heads_to_seq(x.grad)

            t_none = timeit(lambda: call((q, k, v, g, beta), cu_seqlens=cu))
            t_kcp = timeit(lambda: call(local, cp_context=ctx))
            t_a2a = timeit(head_all_to_all) if H % W == 0 else None
            for strategy, ms, w in (("none", t_none, 1), ("fla-kcp", t_kcp, W),
                                    ("fla-all_to_all", t_a2a, W)):
                if ms is None:
                    continue
                records.append(dict(op="gdn", strategy=strategy, W=w, T=T, H=H, K=D, V=D,
                                    nseq=len(cu_list) - 1,
                                    **{"pass": "fwd+bwd" if backward else "fwd"}, ms=ms,
                                    device=torch.cuda.get_device_name(), impl="fla"))
    if rank == 0:
        print(json.dumps(records), flush=True)
    dist.destroy_process_group()


def run_jaxcp(T: int, H: int, D: int, W: int, iters: int, strategies, backend,
              done=lambda records: None, names=LAYOUTS, compile_threads: int = 8) -> list[dict]:
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxcp
    from benchmarks.timing import forward_backward, time_side_by_side
    from jaxcp.l2norm import l2_normalize

    devices = jax.devices()[:W]
    mesh = Mesh(np.array(devices), ("seq",))
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    # q, k normalised before the timed calls, as FLA's are (its ranks get normalised shards)
    unit = lambda x: l2_normalize(x).astype(x.dtype)
    q, k, v = unit(r(1, T, H, D)), unit(r(1, T, H, D)), r(1, T, H, D)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32))
    beta = jax.nn.sigmoid(r(1, T, H))
    on_one = (q, k, v, g, beta)
    # CP inputs start sharded over the devices, as they are inside a sharded training step:
    # otherwise every call would first scatter them from device 0.
    seq = P(None, "seq")
    on_all = tuple(jax.device_put(x, NamedSharding(mesh, seq)) for x in on_one)

    records = []
    for cu_list in layouts(T, names):
        cu = jnp.asarray(cu_list, jnp.int32)
        kw = dict(cu_seqlens=cu, backend=backend)
        jobs = []     # (strategy, pass, jitted function, its inputs)
        for strategy in ["none"] + list(strategies):
            if strategy == "none":
                call = lambda *a: jaxcp.chunk_gated_delta_rule(*a, **kw)[0]
                xs = on_one
            else:
                xs = on_all
                body = lambda *a, s=strategy: jaxcp.chunk_gated_delta_rule(
                    *a, cp_axis="seq", cp_strategy=s, **kw)[0]
                call = jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq,
                                     check_vma=backend != "interpret")
            jobs += [(strategy, "fwd", jax.jit(call), xs),
                     (strategy, "fwd+bwd", jax.jit(forward_backward(call, range(5))), xs)]
        times = time_side_by_side([(fn, xs) for _, _, fn, xs in jobs], iters, compile_threads)
        for (strategy, passes, _, _), timed in zip(jobs, times):
            if isinstance(timed, Exception):   # reported, not fatal: the other rows still run
                print(f"{strategy:10} nseq={len(cu_list) - 1:2} {passes:8} failed: "
                      f"{type(timed).__name__}: {str(timed)[:300]}", flush=True)
                continue
            ms = timed.ms
            records.append(dict(op="gdn", strategy=strategy, W=1 if strategy == "none" else W,
                                T=T, H=H, K=D, V=D, nseq=len(cu_list) - 1,
                                **{"pass": passes}, ms=ms, device=devices[0].device_kind,
                                impl=f"jaxcp-{backend}"))
            print(f"{strategy:10} nseq={len(cu_list) - 1:2} {passes:8} {ms:9.3f} ms", flush=True)
            done(records)
    return records


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(records: list[dict]) -> str:
    """Every record with its rate and overhead against the run without CP, then the target's
    two ratios per layout and pass."""
    W = max(r["W"] for r in records)
    first = records[0]
    none = {(r["impl"], r["nseq"], r["pass"]): r["ms"] for r in records if r["strategy"] == "none"}
    lines = ["# Context-parallel GDN benchmark", "",
             f"Device: {W} x {first['device']}; T = {first['T']}, H = {first['H']}, "
             f"K = V = {first['K']}, bf16, B = 1, median ms per call.", "",
             "rate = (t_none / W) / t (1.0 is a perfect split); overhead = t - t_none / W: what "
             "CP adds to this device's share of the work (summary, collectives, merge).", "",
             "| impl | strategy | sequences | pass | ms | rate | overhead ms |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        t_none = none.get((r["impl"], r["nseq"], r["pass"]))
        cp = r["strategy"] != "none" and t_none
        rate = f"{t_none / W / r['ms']:.0%}" if cp else "-"
        overhead = f"{r['ms'] - t_none / W:.2f}" if cp else "-"
        lines.append(f"| {r['impl']} | {r['strategy']} | {r['nseq']} | {r['pass']} | "
                     f"{r['ms']:.2f} | {rate} | {overhead} |")
    lines += ["", "Target: allgather faster than FLA's KCP, and >= 1.3x faster than all_to_all.",
              "", "| sequences | pass | allgather ms | FLA KCP ms | allgather / KCP (< 1: met) "
              "| all_to_all / allgather (>= 1.3: met) |", "|---|---|---|---|---|---|"]
    ms = {(r["strategy"], r["nseq"], r["pass"]): r["ms"] for r in records}
    for nseq, passes in sorted({(r["nseq"], r["pass"]) for r in records}):
        ag = ms.get(("allgather", nseq, passes))
        kcp, a2a = ms.get(("fla-kcp", nseq, passes)), ms.get(("all_to_all", nseq, passes))
        lines.append(f"| {nseq} | {passes} | {_ms(ag)} | {_ms(kcp)} | {_ratio(ag, kcp)} | "
                     f"{_ratio(a2a, ag)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench.cp",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--report", help="write .md and .png from these records and exit")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--devices", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--strategies", default="allgather,all_to_all,relay")
    ap.add_argument("--backend", default="pallas", choices=["pallas", "xla", "interpret"])
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="comma list of single (one sequence), packed (10 sequences)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--compile-threads", type=int, default=8,
                    help="programs compiled at once (1: one at a time)")
    ap.add_argument("--fla-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_threads < 1:
        ap.error("--compile-threads must be positive")
    names = tuple(args.layouts.split(","))
    if not set(names) <= set(LAYOUTS):
        ap.error("--layouts: comma list of " + ", ".join(LAYOUTS))
    if args.report:
        from benchmarks import pages
        pages.write(args.report)
        return 0
    if args.fla_worker:
        fla_worker(args.T, args.H, args.D, args.iters, names)
        return 0
    records = []
    gpus = shutil.which("nvidia-smi") is not None
    W = args.devices
    if not gpus:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={W or 4}")
    elif not args.no_fla:
        n = W or int(subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                    text=True).stdout.count("GPU "))
        child = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                                f"--nproc_per_node={n}", "-m", __spec__.name, "--fla-worker",
                                "--T", str(args.T), "--H", str(args.H), "--D", str(args.D),
                                "--iters", str(args.iters), "--layouts", args.layouts],
                               stdout=subprocess.PIPE, text=True)
        if child.returncode == 0:
            records += json.loads(child.stdout.strip().splitlines()[-1])
        else:
            print(f"FLA not run (exit {child.returncode})", flush=True)
    import jax

    save = saver(args.json, records)
    save()
    records += run_jaxcp(args.T, args.H, args.D, W or len(jax.devices()), args.iters,
                         args.strategies.split(","), args.backend, save, names,
                         args.compile_threads)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
