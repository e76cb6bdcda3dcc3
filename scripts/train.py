"""Train a small hybrid LM with context parallelism on a (data, seq) mesh.

    python scripts/train.py                                  # MQAR, mesh data=1,seq=4 (fake CPU devices)
    python scripts/train.py --mesh data=2,seq=4 --seq-len 65536 --layers gdn,gdn,gdn,attn
    python scripts/train.py --data notes.txt                 # byte-level LM on a text file
    python scripts/train.py --run-dir runs/a --resume        # continue from the last checkpoint

On a machine without GPUs it creates as many fake CPU devices as the mesh needs. Writes into
--run-dir: config.json at the start (the command, the parsed flags, the GDN/KDA backend that
runs, devices and versions), metrics.jsonl (a record at every eval step and the last step), a
loss/accuracy plot (curves.png), orbax checkpoints and summary.json. The last line printed is
summary.json's object: step, loss, eval_accuracy (null without eval), step_ms (median wall time
of the train steps after the first, which compiles), tokens_per_s and tokens_per_s_per_device
(global tokens of a step / step_ms), peak_mem_gib (peak bytes in use, max over the mesh's
devices, GiB; null where the backend does not report it), elapsed_s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time

ENV_RECORDED = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        parts = dict(p.split("=") for p in text.split(","))
        data, seq = int(parts.pop("data", 1)), int(parts.pop("seq", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like data=1,seq=4, got {text!r}")
    if parts or data < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"--mesh takes positive data= and seq= only, got {text!r}")
    return data, seq


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr and exit code 2, no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    ap = _Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", type=parse_mesh, default=(1, 4), help="data=D,seq=S")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", default="gdn,attn", help="mixer per block: gdn, kda, attn")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=64, help="MQAR vocabulary (bytes: 256)")
    ap.add_argument("--pairs", type=int, default=4, help="MQAR key-value pairs per sequence")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype (parameters stay float32)")
    ap.add_argument("--backend", default=None, choices=["xla", "pallas", "interpret"],
                    help="GDN/KDA backend (default: the library's)")
    ap.add_argument("--attn-block", type=int, default=1024,
                    help="attention query/key block size (tokens)")
    ap.add_argument("--data", default=None, help="train a byte-level LM on this text file")
    ap.add_argument("--run-dir", default="runs/train")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--eval-every", type=int, default=50, help="0: no eval")
    ap.add_argument("--ckpt-every", type=int, default=100, help="0: no checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "hidden", "heads", "head_dim", "vocab",
                 "attn_block"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error("--lr must be a positive number")
    for name in ("eval_every", "ckpt_every", "warmup"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    data, seq = args.mesh
    if args.batch % data:
        ap.error(f"--batch {args.batch} must be divisible by the data axis {data}")
    if args.seq_len % seq:
        ap.error(f"--seq-len {args.seq_len} must be divisible by the seq axis {seq}")
    if args.data is not None:
        if not os.path.isfile(args.data):
            ap.error(f"--data {args.data}: no such file")
        if os.path.getsize(args.data) < args.seq_len + 1:
            ap.error(f"--data {args.data}: fewer than --seq-len + 1 = {args.seq_len + 1} bytes")
        args.vocab = 256
    elif not 1 <= args.pairs <= args.seq_len // 4:
        ap.error(f"--pairs must be in [1, seq_len / 4 = {args.seq_len // 4}]")
    return args, ap


def peak_memory_gib(devices) -> float | None:
    """Peak bytes in use, max over devices, in GiB; None where no device reports it."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [p for p in peaks if p is not None]
    return round(max(peaks) / 2**30, 3) if peaks else None


def speed(step_times: list[float], tokens_per_step: int, n_devices: int) -> dict:
    """step_ms (median), tokens_per_s and tokens_per_s_per_device; None without timed steps."""
    if not step_times:
        return dict(step_ms=None, tokens_per_s=None, tokens_per_s_per_device=None)
    median = statistics.median(step_times)
    return dict(step_ms=round(1e3 * median, 2), tokens_per_s=round(tokens_per_step / median, 1),
                tokens_per_s_per_device=round(tokens_per_step / median / n_devices, 1))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, ap = parse_args(argv)
    data, seq = args.mesh
    env = {k: os.environ[k] for k in ENV_RECORDED if k in os.environ}
    if shutil.which("nvidia-smi") is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={data * seq}")
    import numpy as np
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import Mesh

    from jaxcp.models import LM
    from jaxcp.stages import resolve_backend
    from jaxcp.train import (Batch, make_loss, make_optimizer, make_train_step, mqar_batch,
                             replicate, shard_batch)

    if len(jax.devices()) < data * seq:
        ap.error(f"--mesh needs {data * seq} devices, {len(jax.devices())} present")
    mesh = Mesh(np.array(jax.devices()[:data * seq]).reshape(data, seq), ("data", "seq"))
    try:
        model = LM(args.vocab, args.hidden, args.layers, args.heads, args.head_dim,
                   cp_axis="seq" if seq > 1 else None, backend=args.backend,
                   attn_block_size=args.attn_block, rngs=nnx.Rngs(args.seed))
    except ValueError as e:
        ap.error(str(e))
    graph, params = nnx.split(model)
    tx = make_optimizer(args.lr, args.warmup, args.steps)
    dtype = jnp.dtype(args.dtype)
    check_vma = args.backend != "interpret"
    step_fn = make_train_step(graph, mesh, tx, dtype, check_vma=check_vma)
    eval_fn = jax.jit(make_loss(graph, mesh, dtype, check_vma=check_vma))
    params = replicate(params, mesh)
    opt_state = replicate(tx.init(params), mesh)

    if args.data is not None:
        text = np.frombuffer(open(args.data, "rb").read(), np.uint8).astype(np.int32)

        def batch_at(key):
            starts = np.asarray(jax.random.randint(key, (args.batch,), 0,
                                                   len(text) - args.seq_len - 1))
            window = np.stack([text[s:s + args.seq_len + 1] for s in starts])
            return Batch(jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:]),
                         jnp.ones((args.batch, args.seq_len), jnp.float32))
    else:
        @jax.jit
        def batch_at(key):
            return mqar_batch(key, args.batch, args.seq_len, args.vocab, args.pairs)

    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    devices = mesh.devices.flatten().tolist()
    config = dict(command=shlex.join(["python", "scripts/train.py", *argv]), argv=argv, env=env,
                  args={k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
                  backend=resolve_backend(args.backend), n_devices=len(devices),
                  platform=devices[0].platform, device_kind=devices[0].device_kind, jax_version=jax.__version__)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)
    ckpt = None
    if args.ckpt_every > 0 or args.resume:
        ckpt = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if args.resume:
        last = ckpt.latest_step()
        if last is None:
            ap.error(f"--resume: no checkpoint in {run_dir}/checkpoints")
        state = ckpt.restore(last, args=ocp.args.StandardRestore(
            {"params": params, "opt_state": opt_state}))
        params = replicate(state["params"], mesh)
        opt_state = replicate(state["opt_state"], mesh)
        start = last
        if start >= args.steps:
            ap.error(f"--resume: the checkpoint is at step {start}, --steps {args.steps} "
                     "leaves nothing to do")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)

    base = jax.random.key(args.seed)
    eval_key = jax.random.fold_in(base, 1 << 30)
    tokens_per_step = args.batch * args.seq_len
    every = lambda n, step: (n > 0 and step % n == 0) or step == args.steps
    record = dict(step=start, loss=math.nan, eval_accuracy=None)
    all_times, recent = [], []
    t_start = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        batch = jax.block_until_ready(shard_batch(batch_at(jax.random.fold_in(base, step)), mesh))
        t0 = time.perf_counter()
        params, opt_state, loss, _ = jax.block_until_ready(step_fn(params, opt_state, batch))
        loss = float(loss)
        if not math.isfinite(loss):
            with open(metrics_path, "a") as f:
                f.write(json.dumps(dict(step=step, loss=loss, eval_accuracy=None)) + "\n")
            if ckpt is not None:
                ckpt.wait_until_finished()
            print(f"error: the loss is {loss} at step {step}", file=sys.stderr)
            return 1
        if step > start + 1:
            all_times.append(time.perf_counter() - t0)
            recent.append(all_times[-1])
        if every(args.eval_every, step):
            eval_acc = None
            if args.eval_every > 0:
                _, acc = eval_fn(params, shard_batch(batch_at(eval_key), mesh))
                eval_acc = round(float(acc), 4)
            record = dict(step=step, loss=round(loss, 5), eval_accuracy=eval_acc,
                          **speed(recent, tokens_per_step, len(devices)),
                          peak_mem_gib=peak_memory_gib(devices),
                          elapsed_s=round(time.perf_counter() - t_start, 1))
            recent = []
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            _progress(record, args.steps)
        if args.ckpt_every > 0 and every(args.ckpt_every, step):
            ckpt.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    if ckpt is not None:
        ckpt.wait_until_finished()
    _plot(metrics_path, os.path.join(run_dir, "curves.png"))
    summary = dict(record, **speed(all_times, tokens_per_step, len(devices)),
                   timed_steps=len(all_times), peak_mem_gib=peak_memory_gib(devices),
                   elapsed_s=round(time.perf_counter() - t_start, 1))
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


def _progress(record: dict, steps: int) -> None:
    """One progress line on stderr."""
    bar = "#" * int(30 * record["step"] / steps)
    acc = "-" if record["eval_accuracy"] is None else f"{record['eval_accuracy']:.3f}"
    tps = "-" if record["tokens_per_s"] is None else f"{record['tokens_per_s']:.0f}"
    print(f"[{bar:<30}] step {record['step']}/{steps} loss {record['loss']:.4f} "
          f"eval acc {acc} {tps} tok/s", file=sys.stderr, flush=True)


def _plot(metrics_path: str, out: str) -> None:
    """Loss and eval accuracy against steps, from metrics.jsonl."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [math.nan if r["eval_accuracy"] is None else r["eval_accuracy"] for r in rows],
             color="tab:orange", label="eval accuracy")
    ax2.set_ylabel("eval accuracy")
    ax2.set_ylim(0, 1)
    fig.legend(loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
