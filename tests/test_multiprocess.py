"""Several JAX processes (jax.distributed on localhost, 4 CPU devices each, gloo collectives)
against one process: the CP ops with the sequence crossing the process boundary, and
scripts/train.py, resume included. Processes that fail or outlive their time are killed and
their output reported."""
import json
import os
import socket
import subprocess
import sys

import chex
import jax
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
         "--hidden", "32", "--heads", "2", "--head-dim", "16", "--eval-every", "1",
         "--ckpt-every", "2"]


def losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def checkpoint_params(run_dir, step: int):
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


def test_train_two_processes_resumed_on_the_data_axis_is_one_process(tmp_path):
    """Two processes train the run that one process with 8 devices trains in one go: two
    steps on --mesh data=1,seq=8 (the sequence crosses the processes, through a GDN and an
    attention block), then --resume to a third on --mesh data=2,seq=4 (each process holds one
    data row): loss per step and the parameters at both checkpoints. (The one-process run
    stays on data=1,seq=8: CP trains the same run on any mesh, to rounding.)"""
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    run_together(processes(TRAIN + ["--mesh", "data=1,seq=8", "--steps", "2", "--run-dir", two]))
    run_together(processes(TRAIN + ["--mesh", "data=2,seq=4", "--steps", "3", "--run-dir", two,
                                    "--resume"]))
    run_together([TRAIN + ["--mesh", "data=1,seq=8", "--steps", "3", "--run-dir", one]])
    chex.assert_trees_all_close(losses(two), losses(one), rtol=1e-5)
    for step in (2, 3):
        chex.assert_trees_all_close(checkpoint_params(two, step), checkpoint_params(one, step),
                                    rtol=1e-5, atol=1e-6)


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
def test_train_cluster_flags_errors(train_script, flags, message, capsys):
    """Bad cluster flags: one line on stderr naming the flag, exit 2, before jax.distributed
    starts (so the script's main() runs in this process: SystemExit is its exit)."""
    with pytest.raises(SystemExit) as exit_:
        train_script.main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
