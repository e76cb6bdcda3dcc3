"""Train a small hybrid LM with context parallelism on a (data, seq) mesh.

    python scripts/train.py                                  # MQAR, mesh data=1,seq=4 (fake CPU devices)
    python scripts/train.py --mesh data=2,seq=4 --seq-len 65536 --layers gdn,gdn,gdn,attn
    python scripts/train.py --data notes.txt                 # byte-level LM on a text file
    python scripts/train.py --run-dir runs/a --resume        # continue from the last checkpoint
    python scripts/train.py --mesh data=2,seq=8 --coordinator host0:1234 --num-processes 2 --process-id I

Several processes (hosts) train one run with jax.distributed: start the same command on each,
with its --process-id (or, under SLURM / Open MPI, without the three flags: the cluster is read
from the environment). The mesh spans every process's devices; each process places only its
shards of a batch, built from the same per-step seed, so N processes train exactly the run one
process with all the devices would. Process 0 alone prints and writes the files below;
checkpoints are written and restored by all.

On a machine without GPUs it creates as many fake CPU devices as the mesh needs. It says when
it compiles the step and what the compiled step needs per device. A --run-dir that holds
another run is refused (exit 2) unless --resume continues it or --overwrite clears it;
Ctrl-C saves a checkpoint of the last finished step and exits with 130. Writes into
--run-dir: config.json at the start (the command, the parsed flags, the GDN/KDA backend that
runs, devices and versions), metrics.jsonl (a record at every eval step and the last step), a
loss/accuracy plot (curves.png), orbax checkpoints and summary.json. The last line printed is
summary.json's object: step, loss, eval_accuracy (null without eval), step_ms (median wall time
of the train steps after the first, which compiles), tokens_per_s and tokens_per_s_per_device
(global tokens of a step / step_ms), mfu (model FLOPs utilisation against the device's
dense bf16 peak, ``jaxcp.train.flops``; null on CPUs), flops_per_token (the step's model
FLOPs per token), peak_mem_gib (peak bytes in use, max over the mesh's devices, GiB; null
where the backend does not report it), elapsed_s.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import sys
import time

from jaxcp.cli import OneLineParser

ENV_RECORDED = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE",
                "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        parts = dict(p.split("=") for p in text.split(","))
        data, seq = int(parts.pop("data", 1)), int(parts.pop("seq", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like data=1,seq=4, got {text!r}")
    if parts or data < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"--mesh takes positive data= and seq= only, got {text!r}")
    return data, seq


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.split("\n")[0])
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
    ap.add_argument("--spread-pairs", action="store_true",
                    help="MQAR pairs evenly spaced over each half (else packed at its start)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype (parameters stay float32)")
    ap.add_argument("--backend", default=None, choices=["xla", "pallas", "interpret"],
                    help="GDN/KDA backend (default: the library's)")
    ap.add_argument("--remat", default="none", choices=["none", "block", "mixer"],
                    help="recompute in the backward, one at a time: each block or each mixer")
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"],
                    help="how the sequence is split over the seq axis: contiguous, or zigzag "
                         "(2 x seq pieces, device r holds pieces r and 2 seq - 1 - r: causal "
                         "attention balanced)")
    ap.add_argument("--attn-kv", default="allgather", choices=["allgather", "ring"],
                    help="how attention passes keys and values over the seq axis: all at once, "
                         "or one device's block at a time around a ring (less memory)")
    ap.add_argument("--segments", type=int, default=None,
                    help="GDN/KDA: run each device's piece of the sequence as this many "
                         "segments side by side (default: chosen by shape; 1: never)")
    ap.add_argument("--mlp-block", type=int, default=32768,
                    help="tokens per MLP block: the MLPs run block by block, each recomputed in "
                         "the backward (0: all tokens at once)")
    ap.add_argument("--attn-block", type=int, default=1024,
                    help="attention query/key block size (tokens)")
    ap.add_argument("--data", default=None, help="train a byte-level LM on this text file")
    ap.add_argument("--run-dir", default="runs/train")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --run-dir from its last checkpoint")
    ap.add_argument("--overwrite", action="store_true",
                    help="clear an earlier run's checkpoints and metrics from --run-dir first")
    ap.add_argument("--eval-every", type=int, default=50, help="0: no eval")
    ap.add_argument("--ckpt-every", type=int, default=100, help="0: no checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coordinator", default=None,
                    help="HOST:PORT of process 0's coordination service (several processes)")
    ap.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    ap.add_argument("--process-id", type=int, default=None, help="this process's index")
    ap.add_argument("--init-timeout", type=int, default=60,
                    help="seconds to wait for the coordinator and the other processes")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "hidden", "heads", "head_dim", "vocab",
                 "attn_block"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error("--lr must be a positive number")
    for name in ("eval_every", "ckpt_every", "warmup", "mlp_block"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    data, seq = args.mesh
    _check_cluster_flags(ap, args, data * seq)
    _check_run_dir(ap, args)
    if args.batch % data:
        ap.error(f"--batch {args.batch} must be divisible by the data axis {data}")
    if args.seq_len % seq:
        ap.error(f"--seq-len {args.seq_len} must be divisible by the seq axis {seq}")
    if args.layout == "zigzag" and seq > 1 and args.seq_len % (2 * seq):
        ap.error(f"--layout zigzag: --seq-len {args.seq_len} must be divisible by 2 x the seq "
                 f"axis = {2 * seq}")
    if args.segments is not None:
        piece = args.seq_len // seq // (2 if args.layout == "zigzag" and seq > 1 else 1)
        if args.segments <= 0 or piece % args.segments:
            ap.error(f"--segments must be positive and divide each device's piece of the "
                     f"sequence ({piece} tokens), got {args.segments}")
    if args.data is not None:
        if not os.path.isfile(args.data):
            ap.error(f"--data {args.data}: no such file")
        if os.path.getsize(args.data) < args.seq_len + 1:
            ap.error(f"--data {args.data}: fewer than --seq-len + 1 = {args.seq_len + 1} bytes")
        args.vocab = 256
    elif not 1 <= args.pairs <= args.seq_len // 4:
        ap.error(f"--pairs must be in [1, seq_len / 4 = {args.seq_len // 4}]")
    return args, ap


def checkpoint_steps(run_dir: str) -> list[int]:
    """The steps of the checkpoints in run_dir/checkpoints (orbax names each by its step)."""
    path = os.path.join(run_dir, "checkpoints")
    names = os.listdir(path) if os.path.isdir(path) else []
    return sorted(int(n) for n in names if n.isdigit())


def _check_run_dir(ap, args) -> None:
    """A run dir holding another run is continued (--resume) or cleared (--overwrite), never
    mixed with a new run; --resume needs a checkpoint. Runs before anything is written."""
    run_dir = os.path.abspath(args.run_dir)
    steps = checkpoint_steps(run_dir)
    if args.resume and args.overwrite:
        ap.error("--resume and --overwrite exclude each other")
    if args.resume and not steps:
        ap.error(f"--resume: no checkpoint in {run_dir}/checkpoints")
    if args.resume and steps[-1] >= args.steps:
        ap.error(f"--resume: the checkpoint is at step {steps[-1]}, --steps {args.steps} "
                 "leaves nothing to do")
    earlier = [f for f in ("metrics.jsonl", "summary.json") if os.path.exists(
        os.path.join(run_dir, f))]
    if not args.resume and (steps or earlier) and not args.overwrite:
        what = f"checkpoints up to step {steps[-1]}" if steps else " and ".join(earlier)
        ap.error(f"--run-dir {run_dir} holds another run ({what}): --resume continues it, "
                 "--overwrite clears it")


def _clear_run_dir(run_dir: str) -> None:
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    for name in ("metrics.jsonl", "summary.json", "curves.png"):
        if os.path.exists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))


def _check_cluster_flags(ap, args, n_devices: int) -> None:
    given = [f for f in ("coordinator", "num_processes", "process_id")
             if getattr(args, f) is not None]
    if args.init_timeout <= 0:
        ap.error("--init-timeout must be positive")
    if not given:
        return
    if len(given) != 3:
        ap.error("--coordinator, --num-processes and --process-id go together")
    if args.num_processes < 1:
        ap.error("--num-processes must be positive")
    if not 0 <= args.process_id < args.num_processes:
        ap.error(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        ap.error(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if n_devices % args.num_processes:
        ap.error(f"--mesh has {n_devices} devices, not a multiple of --num-processes "
                 f"{args.num_processes}")


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



def linear_backends(backend: str | None, layers: str, dtype) -> str:
    """The backend the GDN and KDA layers of --layers run on this machine ("mosaic (gdn),
    pallas (kda)" where they differ)."""
    from jaxcp.gate import Gate
    from jaxcp.stages import resolve_backend
    gates = {"gdn": Gate.SCALAR, "kda": Gate.CHANNEL}
    chosen = {m: resolve_backend(backend, gates[m], dtype)
              for m in dict.fromkeys(layers.split(",")) if m in gates}
    if len(set(chosen.values())) <= 1:
        return next(iter(chosen.values()), resolve_backend(backend))
    return ", ".join(f"{b} ({m})" for m, b in chosen.items())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, ap = parse_args(argv)
    data, seq = args.mesh
    env = {k: os.environ[k] for k in ENV_RECORDED if k in os.environ}
    from jaxcp.train import cluster as cl
    cluster = cl.Cluster.from_environment(args.coordinator, args.num_processes,
                                          args.process_id, args.init_timeout)
    on_cpu = shutil.which("nvidia-smi") is None
    if (cluster.coordinator is not None and cluster.process_id != 0
            and not cl.coordinator_reachable(cluster.coordinator, args.init_timeout)):
        ap.error(f"--coordinator {cluster.coordinator}: not reachable within "
                 f"{args.init_timeout} s (--init-timeout)")
    try:
        cl.start(cluster, data * seq // cluster.num_processes if on_cpu else None)
    except Exception as e:      # the runtime's own errors: one line, exit 2
        ap.error(f"jax.distributed did not start: {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        return _train(args, ap, argv, env, cluster)
    except KeyboardInterrupt:       # before the first step (the loop saves its own)
        print("interrupted before the first step", file=sys.stderr)
        return 130
    finally:
        cl.stop(cluster)


def _train(args, ap, argv, env, cluster) -> int:
    data, seq = args.mesh
    import numpy as np
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.sharding import Mesh

    from jaxcp.models import LM
    from jaxcp.train import (Batch, make_loss, make_optimizer, make_train_step, mqar_batch,
                             replicate, shard_batch)
    from jaxcp.train.cluster import local_value
    from jaxcp.train.flops import peak_flops, token_flops

    main_process = jax.process_index() == 0

    def say(line: str) -> None:
        if main_process:
            print(line, file=sys.stderr, flush=True)

    if len(jax.devices()) < data * seq:
        ap.error(f"--mesh needs {data * seq} devices, {len(jax.devices())} present")
    if cluster.distributed and jax.device_count() != data * seq:
        ap.error(f"--mesh has {data * seq} devices; the {jax.process_count()} processes have "
                 f"{jax.device_count()} together")
    mesh = Mesh(np.array(jax.devices()[:data * seq]).reshape(data, seq), ("data", "seq"))
    place_batch = lambda batch: shard_batch(batch, mesh, args.layout)
    try:
        model = LM(args.vocab, args.hidden, args.layers, args.heads, args.head_dim,
                   cp_axis="seq" if seq > 1 else None, backend=args.backend,
                   attn_block_size=args.attn_block, remat=args.remat,
                   mlp_block_tokens=args.mlp_block or None, cp_layout=args.layout,
                   cp_kv=args.attn_kv, segments=args.segments, rngs=nnx.Rngs(args.seed))
    except ValueError as e:
        ap.error(str(e))
    flops = token_flops(model, args.seq_len)
    graph, params = nnx.split(model)
    tx = make_optimizer(args.lr, args.warmup, args.steps)
    dtype = jnp.dtype(args.dtype)
    check_vma = args.backend != "interpret"
    step_fn = make_train_step(graph, mesh, tx, dtype, check_vma=check_vma)
    loss_fn = make_loss(graph, mesh, dtype, check_vma=check_vma)
    eval_fn = jax.jit(loss_fn)
    batch_shape = Batch(*(jax.ShapeDtypeStruct((args.batch, args.seq_len), d)
                          for d in (jnp.int32, jnp.int32, jnp.float32)))
    try:        # the ops' argument checks (head sizes, say), before anything is written
        jax.eval_shape(loss_fn, params, batch_shape)
    except (ValueError, TypeError) as e:
        ap.error(f"the model does not take these flags: {str(e).splitlines()[0]}")
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
            return mqar_batch(key, args.batch, args.seq_len, args.vocab, args.pairs,
                              spread=args.spread_pairs)

    run_dir = os.path.abspath(args.run_dir)
    if main_process and args.overwrite:
        _clear_run_dir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    devices = mesh.devices.flatten().tolist()
    local_devices = [d for d in devices if d.process_index == jax.process_index()]
    peak = peak_flops(devices[0])
    config = dict(command=shlex.join(["python", "scripts/train.py", *argv]), argv=argv, env=env,
                  args={k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
                  backend=linear_backends(args.backend, args.layers, dtype),
                  n_devices=len(devices),
                  platform=devices[0].platform, device_kind=devices[0].device_kind,
                  jax_version=jax.__version__, process_count=jax.process_count(),
                  flops_per_token=round(flops.step), peak_flops_per_device=peak)
    summary_path = os.path.join(run_dir, "summary.json")
    if main_process:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        if os.path.exists(summary_path):
            os.remove(summary_path)
    ckpt = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if args.resume:
        start = ckpt.latest_step()
        state = ckpt.restore(start, args=ocp.args.StandardRestore(
            {"params": params, "opt_state": opt_state}))
        params = replicate(state["params"], mesh)
        opt_state = replicate(state["opt_state"], mesh)
        say(f"resuming from step {start}")
        if main_process:
            _drop_records_after(metrics_path, start)

    base = jax.random.key(args.seed)
    eval_key = jax.random.fold_in(base, 1 << 30)
    tokens_per_step = args.batch * args.seq_len
    every = lambda n, step: (n > 0 and step % n == 0) or step == args.steps
    rates = lambda times: _with_mfu(speed(times, tokens_per_step, len(devices)), flops, peak)
    record = dict(step=start, loss=math.nan, eval_accuracy=None)
    all_times, recent = [], []
    t_start = time.perf_counter()
    done, state_at_done = start, None
    say(f"compiling the train step ({len(devices)} {devices[0].platform} devices, "
        f"{tokens_per_step:,} tokens a step)...")
    batch = place_batch(batch_at(jax.random.fold_in(base, start + 1)))
    compiled = step_fn.lower(params, opt_state, batch).compile()
    say(f"compiled in {time.perf_counter() - t_start:.0f} s; it needs "
        f"{_compiled_gib(compiled)} GiB per device")
    with _sigint_between_steps() as interrupted:
        try:
            for step in range(start + 1, args.steps + 1):
                if interrupted["requested"]:
                    raise KeyboardInterrupt
                if step > start + 1:
                    batch = place_batch(batch_at(jax.random.fold_in(base, step)))
                batch = jax.block_until_ready(batch)
                t0 = time.perf_counter()
                params, opt_state, loss, _ = jax.block_until_ready(
                    compiled(params, opt_state, batch))
                loss = float(local_value(loss))
                if not math.isfinite(loss):
                    if main_process:
                        with open(metrics_path, "a") as f:
                            f.write(json.dumps(dict(step=step, loss=loss,
                                                    eval_accuracy=None)) + "\n")
                    ckpt.wait_until_finished()
                    print(f"error: the loss is {loss} at step {step}", file=sys.stderr)
                    return 1
                if step > start + 1:
                    all_times.append(time.perf_counter() - t0)
                    recent.append(all_times[-1])
                if every(args.eval_every, step):
                    eval_acc = None
                    if args.eval_every > 0:
                        _, acc = eval_fn(params, place_batch(batch_at(eval_key)))
                        eval_acc = round(float(local_value(acc)), 4)
                    record = dict(step=step, loss=round(loss, 5), eval_accuracy=eval_acc,
                                  **rates(recent), peak_mem_gib=peak_memory_gib(local_devices),
                                  elapsed_s=round(time.perf_counter() - t_start, 1))
                    recent = []
                    if main_process:
                        with open(metrics_path, "a") as f:
                            f.write(json.dumps(record) + "\n")
                        _progress(record, args.steps)
                if args.ckpt_every > 0 and every(args.ckpt_every, step):
                    ckpt.save(step, args=ocp.args.StandardSave({"params": params,
                                                                "opt_state": opt_state}))
                done, state_at_done = step, {"params": params, "opt_state": opt_state}
        except KeyboardInterrupt:
            # the last step whose records are written; a later one is run again on --resume
            if done > start and ckpt.latest_step() != done:
                ckpt.save(done, args=ocp.args.StandardSave(state_at_done), force=True)
            ckpt.wait_until_finished()
            last = ckpt.latest_step()
            saved = (f"checkpoint at step {last} in {run_dir}/checkpoints (--resume continues)"
                     if last is not None else "no checkpoint")
            print(f"interrupted at step {done}: {saved}", file=sys.stderr)
            return 130
    ckpt.wait_until_finished()
    if not main_process:
        return 0
    _plot(metrics_path, os.path.join(run_dir, "curves.png"))
    summary = dict(record, **rates(all_times), timed_steps=len(all_times),
                   flops_per_token=round(flops.step), peak_mem_gib=peak_memory_gib(local_devices),
                   elapsed_s=round(time.perf_counter() - t_start, 1))
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


@contextlib.contextmanager
def _sigint_between_steps():
    """Ctrl-C during the training loop asks it to stop after the step in flight (the flag
    the loop reads before each step): a KeyboardInterrupt raised while the main thread waits
    in JAX's C++ code can be lost. A second Ctrl-C interrupts at once."""
    interrupted = {"requested": False}

    def handler(signum, frame):
        if interrupted["requested"]:
            raise KeyboardInterrupt
        interrupted["requested"] = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _with_mfu(rates: dict, flops, peak: float | None) -> dict:
    """speed()'s dict with mfu: the model FLOP/s per device over the device's bf16 peak."""
    from jaxcp.train.flops import mfu
    value = mfu(flops.step, rates["tokens_per_s_per_device"], peak)
    return dict(rates, mfu=None if value is None else round(value, 4))


def _compiled_gib(compiled) -> str:
    """The compiled step's device memory (XLA's temporaries, arguments and outputs), GiB."""
    m = compiled.memory_analysis()
    if m is None:
        return "?"
    total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    return f"{total / 2**30:.2f}"


def _drop_records_after(metrics_path: str, step: int) -> None:
    """Keep the records of metrics.jsonl up to step: a resumed run writes the later ones
    again (its checkpoint may be older than the last record)."""
    if not os.path.exists(metrics_path):
        return
    rows = [line for line in open(metrics_path) if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= step]
    with open(metrics_path, "w") as f:
        f.writelines(kept)


def _progress(record: dict, steps: int) -> None:
    """One progress line on stderr."""
    bar = "#" * int(30 * record["step"] / steps)
    acc = "-" if record["eval_accuracy"] is None else f"{record['eval_accuracy']:.3f}"
    tps = "-" if record["tokens_per_s"] is None else f"{record['tokens_per_s']:.0f}"
    mfu = "" if record.get("mfu") is None else f" MFU {100 * record['mfu']:.1f}%"
    print(f"[{bar:<30}] step {record['step']}/{steps} loss {record['loss']:.4f} "
          f"eval acc {acc} {tps} tok/s{mfu}", file=sys.stderr, flush=True)


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
