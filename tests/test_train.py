"""The training step: CP == no CP on a (2, 2) mesh in float32 and a (1, 4) mesh in bfloat16;
MQAR data; the train script."""
import json
import shutil
import signal
import subprocess
import sys
import time

import chex
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxcp.models import LM
from jaxcp.train import (make_loss, make_optimizer, make_train_step, mqar_batch, replicate,
                         shard_batch)
from helpers import TOL, assert_rel

VOCAB = 32


def mesh_of(data, seq):
    return Mesh(np.array(jax.devices()[:data * seq]).reshape(data, seq), ("data", "seq"))


def train_steps(data, seq, cp, steps=2, dtype=jnp.float32, cp_layout="contiguous"):
    mesh = mesh_of(data, seq)
    model = LM(VOCAB, 32, "gdn,attn", 2, 16, 64, cp_axis="seq" if cp else None,
               cp_layout=cp_layout, rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)
    tx = make_optimizer(1e-2, 1, 10)
    step = make_train_step(graph, mesh, tx, dtype)
    params = replicate(params, mesh)
    opt_state = replicate(tx.init(params), mesh)
    losses = []
    for i in range(steps):
        batch = shard_batch(mqar_batch(jax.random.key(i), 2, 32, VOCAB, 4), mesh, cp_layout)
        params, opt_state, loss, _ = step(params, opt_state, batch)
        losses.append(loss)
    return losses, params


@pytest.mark.parametrize("data,seq,dtype,cp_layout", [(1, 4, jnp.bfloat16, "contiguous"),
                                                      (2, 4, jnp.float32, "zigzag")])
def test_train_step_cp_equals_no_cp(data, seq, dtype, cp_layout):
    """Loss and updated parameters of two steps (the warmup's first learning rate is 0), CP
    vs one device; bfloat16 is the compute dtype, the master parameters stay float32. (The
    layers under CP on 4 devices meet float32 tolerances in test_models.) Zigzag: the batch
    is permuted into the layout at the input, the model and the loss take it as it comes."""
    tol = TOL[dtype]
    losses_cp, params_cp = train_steps(data, seq, cp=True, dtype=dtype, cp_layout=cp_layout)
    losses, params = train_steps(data, 1, cp=False, dtype=dtype)
    chex.assert_trees_all_close(losses_cp, losses, rtol=tol)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(params_cp),
                                 jax.tree_util.tree_leaves_with_path(params)):
        assert_rel(a, b, tol, f"updated {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("spread, stride", [(False, 2), (True, 4)])
def test_mqar_batch_layout(spread, stride):
    """4 pairs in a 32-token sequence: packed at the start of each half, or one every 16 / 4
    tokens; every query's target is its key's value."""
    b = mqar_batch(jax.random.key(0), 3, 32, VOCAB, 4, spread=spread)
    tokens, targets, mask = map(np.asarray, b)
    for row in range(3):
        keys = np.arange(4) * stride
        pairs = dict(zip(tokens[row, keys], tokens[row, keys + 1]))
        assert len(pairs) == 4 and all(1 <= k < VOCAB // 2 for k in pairs)
        assert np.count_nonzero(tokens[row, :16]) == 8
        q = np.nonzero(mask[row])[0]
        np.testing.assert_array_equal(q, 16 + keys)
        for p in q:
            assert targets[row, p] == pairs[tokens[row, p]]


TINY = ["--seq-len", "32", "--batch", "4", "--hidden", "32", "--heads", "2", "--head-dim", "16",
        "--layers", "gdn", "--mesh", "data=1,seq=2", "--pairs", "2", "--vocab", "16",
        "--eval-every", "2", "--ckpt-every", "2"]


def run_train(*args):
    out = subprocess.run([sys.executable, "scripts/train.py", *TINY, *args], capture_output=True,
                         text=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """A finished 6-step run: the train script's process and its run dir (a test that
    changes the run works on a copy)."""
    run_dir = tmp_path_factory.mktemp("straight")
    out = run_train("--steps", "6", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-2000:]
    return out, run_dir


def test_train_script_resume_continues_the_trajectory(straight_run, tmp_path, train_script,
                                                      capsys):
    straight, straight_dir = straight_run
    first = run_train("--steps", "4", "--run-dir", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run_train("--steps", "6", "--run-dir", str(tmp_path / "b"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    end = lambda r: json.loads(r.stdout.strip().splitlines()[-1])
    assert end(straight)["step"] == end(resumed)["step"] == 6
    chex.assert_trees_all_close(end(resumed)["loss"], end(straight)["loss"], rtol=1e-5)
    summary = end(straight)
    assert summary["timed_steps"] == 5 and summary["step_ms"] > 0
    chex.assert_trees_all_close(summary["tokens_per_s"], 4 * 32 / (summary["step_ms"] / 1e3),
                                rtol=1e-2)
    assert summary["peak_mem_gib"] is None                      # the CPU reports no peak
    assert json.loads((straight_dir / "summary.json").read_text()) == summary
    config = json.loads((straight_dir / "config.json").read_text())
    assert config["command"].endswith(f"--steps 6 --run-dir {straight_dir}")
    assert (tmp_path / "b" / "curves.png").exists()
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 3
    # a resume with no step left is refused before the run dir is touched
    summary_b = (tmp_path / "b" / "summary.json").read_text()
    with pytest.raises(SystemExit) as exit_:
        train_script.main([*TINY, "--steps", "6", "--run-dir", str(tmp_path / "b"), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "nothing to do" in err[0]
    assert (tmp_path / "b" / "summary.json").read_text() == summary_b


def test_train_script_stops_on_a_non_finite_loss(tmp_path):
    """A diverging run (lr 1e30 from the second step) exits 1 at the first NaN loss."""
    out = run_train("--lr", "1e30", "--warmup", "1", "--steps", "6", "--ckpt-every", "0",
                    "--run-dir", str(tmp_path))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == "error: the loss is nan at step 3"
    report = tmp_path / "train.md"
    subprocess.run([sys.executable, "-m", "benchmarks.bench.train", str(tmp_path), "--out",
                    str(report)], check=True, capture_output=True)
    assert "failed: loss nan at step 3" in report.read_text()


@pytest.mark.parametrize("args,message", [
    (["--mesh", "data=1,pipe=2"], "--mesh"),
    (["--steps", "0"], "--steps"),
    (["--lr", "nan"], "--lr"),
    (["--warmup", "-1"], "--warmup"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--backend", "triton"], "--backend"),
    (["--data", "/nonexistent/file.txt"], "--data"),
    (["--layout", "zigzag", "--seq-len", "34", "--mesh", "data=1,seq=2"], "--layout zigzag"),
    (["--mlp-block", "-1"], "--mlp-block"),
    (["--segments", "3"], "--segments"),
    (["--resume", "--overwrite"], "--resume and --overwrite"),
])
def test_train_script_bad_flags(train_script, args, message, tmp_path, capsys):
    """Flags refused as they are parsed: one line on stderr, exit 2, nothing written. The
    script's main() runs in this process (SystemExit is its exit; any other exception, a
    traceback, fails the test); the flags refused later run the script itself, below."""
    with pytest.raises(SystemExit) as exit_:
        train_script.main([*TINY, *args, "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "run").exists(), "a refused run writes nothing"


def test_train_script_refuses_a_head_dim_the_model_does_not_take(tmp_path):
    """Refused once the model is built, in the script's own process: one line on stderr, no
    traceback, exit 2, nothing written."""
    out = run_train("--head-dim", "48", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "head dim K = 48" in lines[0], out.stderr
    assert not (tmp_path / "run").exists(), "a refused run writes nothing"


def test_train_script_keeps_other_runs(straight_run, tmp_path):
    """A run dir holding another run is refused (one line, exit 2) unless --resume continues
    it or --overwrite clears it; --resume on an empty dir fails before writing anything;
    the first lines say that the step compiles and what it needs."""
    first, finished_dir = straight_run
    assert first.stderr.startswith("compiling the train step")
    assert "GiB per device" in first.stderr.splitlines()[1]
    run_dir = tmp_path / "run"
    shutil.copytree(finished_dir, run_dir)
    again = run_train("--steps", "2", "--run-dir", str(run_dir))
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1 and "--overwrite" in lines[0]
    cleared = run_train("--steps", "3", "--eval-every", "1", "--run-dir", str(run_dir),
                        "--overwrite")
    assert cleared.returncode == 0, cleared.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    empty = run_train("--resume", "--run-dir", str(tmp_path / "empty"))
    assert empty.returncode == 2 and not (tmp_path / "empty").exists()


def test_train_script_saves_on_ctrl_c_and_resumes_without_repeats(tmp_path):
    """SIGINT mid-run: a checkpoint of the last finished step, one line, exit 130; --resume
    says where it starts and metrics.jsonl holds every step once."""
    run_dir = tmp_path / "run"
    args = ["--steps", "100000", "--eval-every", "1", "--ckpt-every", "0",
            "--run-dir", str(run_dir)]
    proc = subprocess.Popen([sys.executable, "scripts/train.py", *TINY, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and "--resume" in last, err[-2000:]
    step = int(last.split()[3].rstrip(":"))
    assert f"checkpoint at step {step}" in last
    resumed = run_train("--steps", str(step + 2), "--eval-every", "1", "--ckpt-every", "0",
                        "--run-dir", str(run_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stderr.splitlines()[0] == f"resuming from step {step}"
    steps = [json.loads(line)["step"] for line in open(metrics)]
    assert steps == list(range(1, step + 3))


def remat_loss(remat: str, layers: str = "gdn,attn"):
    """The mean loss of an LM under CP on 2 devices, its parameters and a batch."""
    mesh = mesh_of(1, 2)
    model = LM(VOCAB, 32, layers, 2, 16, 64, cp_axis="seq", remat=remat, rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)
    loss = make_loss(graph, mesh)
    batch = shard_batch(mqar_batch(jax.random.key(0), 2, 32, VOCAB, 4), mesh)
    return (lambda p, b: loss(p, b)[0]), replicate(params, mesh), batch


def test_remat_keeps_loss_and_gradients():
    """Recomputing each block, or each mixer, in the backward gives the loss and gradients
    of keeping everything, under CP on 2 devices with a GDN and an attention block."""
    def value_and_grads(remat):
        loss, params, batch = remat_loss(remat)
        return jax.jit(jax.value_and_grad(loss))(params, batch)

    value_ref, grads_ref = value_and_grads("none")
    for remat in ("block", "mixer"):
        value, grads = value_and_grads(remat)
        assert_rel(value, value_ref, 1e-5, f"loss, remat={remat}")
        for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree_util.tree_leaves_with_path(grads_ref)):
            assert_rel(a, b, 1e-5, f"d{jax.tree_util.keystr(path)}, remat={remat}")


def test_block_remat_waits_for_the_cotangent():
    """Each recomputed block starts from an optimization_barrier over its saved input and the
    cotangent of its output, and releases its input's cotangent from a second one together
    with its parameters' cotangents, so that no scheduler can run the blocks' recomputations
    together or defer their weight gradients (models.remat): two barriers per block in the
    backward. Without remat the only barriers are the delta rule's, one per piece of each
    GDN layer (core: the pieces' backwards one after the other)."""
    def barriers(remat):
        loss, params, batch = remat_loss(remat, "gdn,attn,gdn")
        return str(jax.make_jaxpr(jax.grad(loss))(params, batch)).count("optimization_barrier")

    assert barriers("none") == 2
    assert barriers("block") == 2 + 2 * 3


def test_train_script_names_the_backend_of_each_linear_layer(train_script, monkeypatch):
    """config.json's backend: one name where the GDN and KDA layers run the same backend,
    else one per mixer (a Hopper GPU stood in for by the device's attributes)."""
    from jaxcp import stages
    assert train_script.linear_backends(None, "gdn,kda,attn", jnp.bfloat16) == "xla"

    class Hopper:
        compute_capability = "9.0"
    monkeypatch.setattr(stages, "gpu_present", lambda: True)
    monkeypatch.setattr(stages.jax, "devices", lambda *a: [Hopper()])
    monkeypatch.setattr(stages.jax, "__version__", "0.11.2")
    assert (train_script.linear_backends(None, "gdn,kda,attn", jnp.bfloat16)
            == "mosaic (gdn), pallas (kda)")
    assert train_script.linear_backends(None, "gdn,attn", jnp.float32) == "pallas"
    assert train_script.linear_backends("pallas", "gdn,kda", jnp.bfloat16) == "pallas"
    assert train_script.linear_backends(None, "attn", jnp.bfloat16) == "pallas"
