"""Train a small hybrid LM with context parallelism on a (data, seq) mesh.

    python scripts/train.py                                  # MQAR, mesh data=1,seq=4 (fake CPU devices)
    python scripts/train.py --mesh data=2,seq=4 --seq-len 65536 --layers gdn,gdn,gdn,attn
    python scripts/train.py --data notes.txt                 # byte-level LM on a text file
    python scripts/train.py --run-dir runs/a --resume        # continue from the last checkpoint

On a machine without GPUs it creates as many fake CPU devices as the mesh needs. Writes
metrics.jsonl, a loss/accuracy plot (curves.png) and orbax checkpoints into --run-dir; the
last line printed is one JSON object with step, loss, eval_accuracy and tokens_per_s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time


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
    ap.add_argument("--steps", type=int, default=300)
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
    ap.add_argument("--data", default=None, help="train a byte-level LM on this text file")
    ap.add_argument("--run-dir", default="runs/train")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "hidden", "heads", "head_dim", "vocab",
                 "eval_every", "ckpt_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
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


def main(argv=None) -> int:
    args, ap = parse_args(argv)
    data, seq = args.mesh
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
    from jaxcp.train import (Batch, make_loss, make_optimizer, make_train_step, mqar_batch,
                             replicate, shard_batch)

    if len(jax.devices()) < data * seq:
        ap.error(f"--mesh needs {data * seq} devices, {len(jax.devices())} present")
    mesh = Mesh(np.array(jax.devices()[:data * seq]).reshape(data, seq), ("data", "seq"))
    try:
        model = LM(args.vocab, args.hidden, args.layers, args.heads, args.head_dim,
                   cp_axis="seq" if seq > 1 else None, rngs=nnx.Rngs(args.seed))
    except ValueError as e:
        ap.error(str(e))
    graph, params = nnx.split(model)
    tx = make_optimizer(args.lr, args.warmup, args.steps)
    dtype = jnp.dtype(args.dtype)
    step_fn = make_train_step(graph, mesh, tx, dtype)
    eval_fn = jax.jit(make_loss(graph, mesh, dtype))
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
        def batch_at(key):
            return mqar_batch(key, args.batch, args.seq_len, args.vocab, args.pairs)

    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(run_dir, exist_ok=True)
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
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)

    base = jax.random.key(args.seed)
    eval_key = jax.random.fold_in(base, 1 << 30)
    tokens_per_step = args.batch * args.seq_len
    record = {}
    t_start, t_last, tokens_seen = time.perf_counter(), time.perf_counter(), 0
    for step in range(start + 1, args.steps + 1):
        batch = shard_batch(batch_at(jax.random.fold_in(base, step)), mesh)
        params, opt_state, loss, acc = step_fn(params, opt_state, batch)
        tokens_seen += tokens_per_step
        if step % args.eval_every == 0 or step == args.steps:
            loss = float(loss)
            _, eval_acc = eval_fn(params, shard_batch(batch_at(eval_key), mesh))
            now = time.perf_counter()
            record = dict(step=step, loss=round(loss, 5), eval_accuracy=round(float(eval_acc), 4),
                          tokens_per_s=round(tokens_seen / (now - t_last), 1),
                          elapsed_s=round(now - t_start, 1))
            t_last, tokens_seen = now, 0
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar = "#" * int(30 * step / args.steps)
            print(f"\r[{bar:<30}] step {step}/{args.steps} loss {loss:.4f} "
                  f"eval acc {record['eval_accuracy']:.3f} {record['tokens_per_s']:.0f} tok/s",
                  end="\n", file=sys.stderr, flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            ckpt.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    ckpt.wait_until_finished()
    _plot(metrics_path, os.path.join(run_dir, "curves.png"))
    if not record:
        record = dict(step=start, loss=math.nan, eval_accuracy=math.nan, tokens_per_s=0.0)
    print(json.dumps(record))
    return 0


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
    ax2.plot(steps, [r["eval_accuracy"] for r in rows], color="tab:orange", label="eval accuracy")
    ax2.set_ylabel("eval accuracy")
    ax2.set_ylim(0, 1)
    fig.legend(loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
