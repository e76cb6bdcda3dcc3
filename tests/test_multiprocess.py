"""Several JAX processes (jax.distributed on localhost, 4 CPU devices each, gloo collectives)
against one process: the CP ops with the sequence crossing the process boundary, and
scripts/train.py, resume included. Processes that fail or outlive their time are killed and
their output reported."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands: list[list[str]]) -> list[str]:
    """Start the commands at once and wait for all; any failure or timeout kills the rest and
    fails the test with every process's output."""
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in commands]
    outputs, failed = [], False
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += f"\n[killed after {TIMEOUT_S} s]"
                failed = True
            outputs.append(out)
            failed = failed or p.returncode != 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        pytest.fail("\n".join(f"--- process {i} (exit {p.returncode}):\n{out[-3000:]}"
                              for i, (p, out) in enumerate(zip(procs, outputs))))
    return outputs


def processes(argv: list[str], n: int = 2) -> list[list[str]]:
    """argv for n processes of one jax.distributed run on localhost."""
    port = free_port()
    return [argv + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
                    "--process-id", str(i)] for i in range(n)]


def test_cp_ops_across_processes():
    """GDN and KDA, packed sequences, one of them crossing from process 0's devices to
    process 1's: o, final states and every gradient equal the single-device op (1e-5)."""
    port = free_port()
    outs = run_together([[sys.executable, "tests/multiprocess_ops.py", f"127.0.0.1:{port}",
                          "2", str(i)] for i in range(2)])
    assert all("gdn process" in o and "kda process" in o for o in outs)


TRAIN = [sys.executable, "scripts/train.py", "--batch", "4", "--seq-len", "64", "--pairs", "4",
         "--hidden", "32", "--heads", "2", "--head-dim", "16", "--eval-every", "1"]


def losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def final_params(run_dir, step: int):
    """The parameters of the checkpoint at step, on this process's first device."""
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding
    path = os.path.join(run_dir, "checkpoints", str(step), "default")
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    here = SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), meta)
    return checkpointer.restore(path, target)["params"]


def assert_same_run(two, one, step: int):
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(final_params(two, step)),
                    jax.tree.leaves(final_params(one, step))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_train_two_processes_is_one_process(tmp_path):
    """--mesh data=1,seq=8 over two processes (the sequence crosses them) trains the run one
    process with 8 devices trains: loss per step and final parameters."""
    flags = ["--mesh", "data=1,seq=8", "--steps", "2", "--ckpt-every", "2"]
    run_together(processes(TRAIN + flags + ["--run-dir", str(tmp_path / "two")]))
    run_together([TRAIN + flags + ["--run-dir", str(tmp_path / "one")]])
    assert_same_run(tmp_path / "two", tmp_path / "one", 2)


def test_train_data_axis_across_processes_resumes(tmp_path):
    """--mesh data=2,seq=4: each process holds one data row. Two steps, then --resume to three
    in two processes again: the trajectory of one process running three steps (one GDN
    block: the attention blocks across processes are the test above's)."""
    flags = ["--mesh", "data=2,seq=4", "--ckpt-every", "2", "--layers", "gdn"]
    two = ["--run-dir", str(tmp_path / "two")]
    run_together(processes(TRAIN + flags + two + ["--steps", "2"]))
    run_together(processes(TRAIN + flags + two + ["--steps", "3", "--resume"]))
    run_together([TRAIN + flags + ["--run-dir", str(tmp_path / "one"), "--steps", "3"]])
    assert_same_run(tmp_path / "two", tmp_path / "one", 3)


@pytest.mark.parametrize("flags,message", [
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1",
      "--init-timeout", "1"], "not reachable within 1 s"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2"], "go together"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["--mesh", "data=1,seq=3", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
      "--process-id", "0"], "not a multiple of --num-processes"),
])
def test_train_cluster_flags_errors(flags, message):
    """Bad cluster flags: one line on stderr naming the flag, exit 2."""
    r = subprocess.run([sys.executable, "scripts/train.py", *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
