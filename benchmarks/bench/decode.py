"""Time one decoding step (one token per sequence from a float32 state) of jaxcp's recurrent ops
beside FLA's fused recurrent kernels, on one GPU in one run.

    python -m benchmarks.bench.decode --json docs/benchmarks/decode.json    # on the GPU machine
    python -m benchmarks.pages docs/benchmarks/decode.json                  # decode.md

Shapes: B = 1, 8, 64, 256 sequences, H = HV = 16 heads, K = V = 128, q, k, v, beta bf16, g
float32 (log-sigmoid of normal; [B, 1, H] for GDN, [B, 1, H, K] for KDA), q and k normalised
in the op, states [B, H, K, V] float32. A step is what a decoding loop runs per token: the
state of the previous step goes in, the new one comes out (jaxcp: a jitted call with the state
donated, so the kernel updates it in place; FLA: ``fused_recurrent_gated_delta_rule`` /
``fused_recurrent_kda`` under torch.no_grad, initial_state -> final state). Both sides time
--steps steps queued back to back and waited for once: the median over --rounds rounds, per
step. jaxcp runs its fused kernel (backend "pallas") and the XLA recurrence ("xla").

Before timing, each op's fused kernel is checked on the same device against the token
recurrence (``check_kernel``: float32, B = 8, T = 2, a 12-row table read through
``state_indices``, one of them -1); the run stops with exit code 1 where an error is over
``LIMIT`` and the errors go into the op's jaxcp-pallas records.

FLA runs in a child process of the same run on the same GPU, before JAX takes the device; it is
skipped (with a note) when it cannot be imported.

Each record: op, impl, B, H, K, V, step_us, floor_us (the state read and written once at the
GPU's memory rate, ``kernels.PEAKS``), device and versions. ``markdown`` is the page's table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.bench.cp import comma_list
from benchmarks.bench.kernels import PEAKS
from benchmarks.records import saver
from jaxcp.cli import OneLineParser

BATCHES = (1, 8, 64, 256)
H, D = 16, 128
IMPLS = ("jaxcp-pallas", "jaxcp-xla", "fla")
LIMIT = 1e-4               # float32, relative to the token recurrence


def floor_us(B: int, device: str) -> float | None:
    """The state's bytes read and written once ([B, H, D, D] float32, twice) at the memory rate
    of the device's kind (None for a kind ``PEAKS`` does not know)."""
    rate = next((bw for name, (bw, _) in PEAKS.items() if name in device), None)
    return None if rate is None else 1e6 * 2 * B * H * D * D * 4 / rate


def check_kernel(op: str, backend: str = "pallas") -> dict:
    """Relative errors of o and the table from the fused kernel (backend) against the token
    recurrence (backend "xla"), float32 (module docstring)."""
    import jax
    import jax.numpy as jnp
    import jaxcp
    from jaxcp.metrics import rel_error

    B, T, rows = 8, 2, 12
    keys = iter(jax.random.split(jax.random.key(1), 8))
    normal = lambda *s: jax.random.normal(next(keys), s, jnp.float32)
    gate_shape = (B, T, H, D) if op == "kda" else (B, T, H)
    q, k, v = normal(B, T, H, D), normal(B, T, H, D), normal(B, T, H, D)
    g = jax.nn.log_sigmoid(normal(*gate_shape))
    beta = jax.nn.sigmoid(normal(B, T, H))
    table = normal(rows, H, D, D)
    indices = jnp.array([3, 0, -1, 11, 5, 7, 1, 9], jnp.int32)
    recurrent = jaxcp.recurrent_kda if op == "kda" else jaxcp.recurrent_gated_delta_rule
    o, new, o_ref, new_ref = (
        x for b in (backend, "xla")
        for x in recurrent(q, k, v, g, beta, initial_state=table, state_indices=indices,
                           use_qk_l2norm_in_kernel=True, backend=b))
    return {"o": rel_error(o, o_ref), "table": rel_error(new, new_ref)}


def time_jaxcp(op: str, B: int, backend: str, steps: int, rounds: int) -> float:
    """Microseconds per decoding step of jaxcp's recurrent op (module docstring)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import jaxcp

    keys = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *s: jax.random.normal(next(keys), s, jnp.bfloat16)
    gate_shape = (B, 1, H, D) if op == "kda" else (B, 1, H)
    q, k, v = normal(B, 1, H, D), normal(B, 1, H, D), normal(B, 1, H, D)
    g = jax.nn.log_sigmoid(jax.random.normal(next(keys), gate_shape, jnp.float32))
    beta = jax.nn.sigmoid(normal(B, 1, H))
    recurrent = jaxcp.recurrent_kda if op == "kda" else jaxcp.recurrent_gated_delta_rule

    def step(state, q, k, v, g, beta):
        return recurrent(q, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True,
                         backend=backend)

    step = jax.jit(step, donate_argnums=0)
    state = jax.random.normal(next(keys), (B, H, D, D), jnp.float32)
    for _ in range(3):
        _, state = step(state, q, k, v, g, beta)
    jax.block_until_ready(state)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            _, state = step(state, q, k, v, g, beta)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / steps)
    return 1e6 * float(np.median(times))


def time_fla(op: str, B: int, steps: int, rounds: int) -> float:
    """Microseconds per decoding step of FLA's fused recurrent kernel (module docstring)."""
    import torch
    import torch.nn.functional as F

    if op == "kda":
        from fla.ops.kda import fused_recurrent_kda as recurrent
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    torch.manual_seed(0)
    normal = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    gate_shape = (B, 1, H, D) if op == "kda" else (B, 1, H)
    q, k, v = normal(B, 1, H, D), normal(B, 1, H, D), normal(B, 1, H, D)
    g = F.logsigmoid(torch.randn(*gate_shape, device="cuda"))
    beta = torch.sigmoid(normal(B, 1, H))
    state = torch.randn(B, H, D, D, device="cuda")

    def one(state):
        return recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)[1]

    times = []
    with torch.no_grad():
        for _ in range(3):
            state = one(state)
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                state = one(state)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / steps)
    times.sort()
    return 1e3 * times[len(times) // 2]


def fla_records(ops, batches, steps, rounds) -> list[dict]:
    """FLA's records, from a child process (``--child``); [] with a note where FLA is missing."""
    child = subprocess.run([sys.executable, "-m", __spec__.name, "--child", "--ops",
                            ",".join(ops), "--batches", *map(str, batches),
                            "--steps", str(steps), "--rounds", str(rounds)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if child.returncode != 0:
        print("FLA skipped: " + (child.stderr.strip().splitlines() or ["?"])[-1],
              file=sys.stderr)
        return []
    return [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]


def fla_child(ops, batches, steps, rounds) -> int:
    import torch
    from benchmarks import fla

    device = torch.cuda.get_device_name()
    version = f"fla {fla.version()}, torch {torch.__version__}"
    for op in ops:
        for B in batches:
            us = time_fla(op, B, steps, rounds)
            print(json.dumps(dict(op=op, impl="fla", B=B, H=H, K=D, V=D, step_us=us,
                                  floor_us=floor_us(B, device), device=device,
                                  version=version)), flush=True)
    return 0


def markdown(records: list[dict]) -> str:
    if not records:
        return "# Decode\n\nNo records.\n"
    device = records[0]["device"]
    at = {(r["op"], r["B"], r["impl"]): r for r in records}
    lines = ["# Decode", "",
             f"One decoding step ({device}): one token per sequence, H = {H}, K = V = {D}, "
             "bf16, q and k normalised in the op, float32 states updated in place. "
             "Microseconds per step, steps queued back to back; the ratio is jaxcp's fused "
             "kernel over FLA's fused recurrent kernel; the floor is the states read and "
             "written once at the memory rate.", "",
             "| op | B | jaxcp pallas us | jaxcp xla us | FLA us | pallas / FLA | floor us |",
             "|---|---|---|---|---|---|---|"]
    cell = lambda r: "-" if r is None else f"{r['step_us']:.1f}"
    for op in ("gdn", "kda"):
        for B in sorted({r["B"] for r in records if r["op"] == op}):
            pallas, xla, fla = (at.get((op, B, impl)) for impl in IMPLS)
            ratio = ("-" if pallas is None or fla is None
                     else f"{pallas['step_us'] / fla['step_us']:.2f}")
            floor = next((r["floor_us"] for r in (pallas, xla, fla)
                          if r is not None and r.get("floor_us") is not None), None)
            lines.append(f"| {op.upper()} | {B} | {cell(pallas)} | {cell(xla)} | {cell(fla)} "
                         f"| {ratio} | {'-' if floor is None else f'{floor:.1f}'} |")
    versions = sorted({r["version"] for r in records})
    lines += ["", "Versions: " + "; ".join(versions) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m benchmarks.bench.decode",
                       description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--ops", default="gdn,kda", help="comma list of gdn, kda")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    ap.add_argument("--steps", type=int, default=100, help="steps queued per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ops = comma_list(ap, "--ops", args.ops, ("gdn", "kda"))
    impls = comma_list(ap, "--impls", args.impls, IMPLS)
    if min(args.batches) < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--batches, --steps and --rounds must be positive")
    if args.child:
        return fla_child(ops, args.batches, args.steps, args.rounds)

    records: list[dict] = []
    save = saver(args.json, records)
    if "fla" in impls:
        records += fla_records(ops, args.batches, args.steps, args.rounds)
        save()
    import jax
    device = jax.devices()[0].device_kind
    for op in ops:
        errors = check_kernel(op) if "jaxcp-pallas" in impls else {}
        if errors:
            print(f"{op}: fused kernel against the token recurrence: " + ", ".join(
                f"{name} {err:.1e}" for name, err in errors.items()), flush=True)
        if any(err > LIMIT for err in errors.values()):
            return 1
        for B in args.batches:
            for impl in ("jaxcp-pallas", "jaxcp-xla"):
                if impl in impls:
                    us = time_jaxcp(op, B, impl.split("-")[1], args.steps, args.rounds)
                    records.append(dict(op=op, impl=impl, B=B, H=H, K=D, V=D, step_us=us,
                                        floor_us=floor_us(B, device), device=device,
                                        version=f"jax {jax.__version__}",
                                        **({"errors": errors} if impl == "jaxcp-pallas"
                                           else {})))
                    save()
                    print(json.dumps(records[-1]), flush=True)
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
