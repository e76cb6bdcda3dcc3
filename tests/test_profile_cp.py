"""benchmarks.profile.cp: its kernel table from a trace's GPU plane, and its run without
GPUs."""
import os
import subprocess
import sys

import pytest

from benchmarks.profile import cp
from helpers import xla_flags_with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plane(name, lines):
    """An XPlane in text form: lines [(line name, [(kernel name, start ns, duration ns)])]."""
    names = sorted({k for _, events in lines for k, _, _ in events})
    ids = {k: i + 1 for i, k in enumerate(names)}
    text = [f'planes {{ name: "{name}"']
    for n, (line, events) in enumerate(lines):
        text.append(f'  lines {{ id: {n} name: "{line}" timestamp_ns: 0')
        text += [f"    events {{ metadata_id: {ids[k]} offset_ps: {start * 1000} "
                 f"duration_ps: {dur * 1000} }}" for k, start, dur in events]
        text.append("  }")
    text += [f'  event_metadata {{ key: {i} value {{ id: {i} name: "{k}" }} }}'
             for k, i in ids.items()]
    return "\n".join(text + ["}"])


def profile():
    """Device 0: two calls of a fusion on the compute stream and an all-gather on another
    stream, partly overlapping it; an "XLA Ops" line repeating a kernel; device 1 and the
    host beside it."""
    from jax.profiler import ProfileData
    ms = 1_000_000
    gpu0 = [("Stream #7(Compute)", [("fusion", 0, 4 * ms), ("fusion", 10 * ms, 4 * ms)]),
            ("Stream #9(Compute)", [("ncclDevKernel_AllGather_RING", 3 * ms, 3 * ms),
                                    ("ncclDevKernel_AllGather_RING", 13 * ms, 3 * ms)]),
            ("XLA Ops", [("fusion", 0, 4 * ms)])]
    gpu1 = [("Stream #7(Compute)", [("other", 0, 50 * ms)])]
    text = "\n".join([plane("/host:CPU", []), plane("/device:GPU:1", gpu1),
                      plane("/device:GPU:0", gpu0)])
    return ProfileData.from_text_proto(text)


def test_device_kernels_are_device_0s_streams():
    kernels = cp.device_kernels(profile())
    assert sorted(k.name for k in kernels) == ["fusion"] * 2 + ["ncclDevKernel_AllGather_RING"] * 2


def test_summary_and_table_per_call():
    kernels = cp.device_kernels(profile())
    s = cp.summarize(kernels, calls=2)
    # span 0..16 ms; busy [0, 6) and [10, 16); collectives [3, 6) and [13, 16)
    assert s == pytest.approx(cp.Summary(span=8.0, busy=6.0, idle=2.0, collective=3.0))
    table = cp.markdown("fwd", kernels, 2, wall_ms=9.0)
    assert "span 8.000 ms" in table and "idle 2.000 ms" in table
    assert "| `fusion` | 4.000 | 1 | 50.0% |" in table
    assert "| `ncclDevKernel_AllGather_RING` | 3.000 | 1 | 37.5% |" in table


def test_no_gpu_plane_gives_no_kernels():
    from jax.profiler import ProfileData
    assert cp.device_kernels(ProfileData.from_text_proto(plane("/host:CPU", []))) == []


def test_runs_on_cpu_devices_and_says_there_is_no_table():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags_with_devices(2))
    out = subprocess.run([sys.executable, "-m", "benchmarks.profile.cp", "--backend", "xla",
                          "--T", "256", "--H", "2", "--D", "16", "--devices", "2",
                          "--calls", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines() == [
        "no GPU kernels in the trace (JAX on cpu): the calls ran, there is no kernel table"]


@pytest.mark.parametrize("flags", [["--calls", "0"], ["--op", "gla"], ["--nseq", "3"],
                                   ["--layout", "striped"]])
def test_flag_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        cp.parse_args(flags)
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err.strip().splitlines()[-1]


def test_page_has_the_setting_and_a_section_per_pass(monkeypatch, tmp_path):
    """With kernels in the trace (here the synthetic ones), --out gets the page."""
    kernels = cp.device_kernels(profile())
    monkeypatch.setattr(cp, "device_kernels", lambda _: kernels)
    out = tmp_path / "profile.md"
    assert cp.main(["--backend", "xla", "--op", "kda", "--T", "256", "--H", "2", "--D", "16",
                    "--devices", "2", "--calls", "1", "--layout", "zigzag",
                    "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# jaxcp allgather, KDA: device 0 of 2 x ")
    assert "zigzag layout" in text and "## fwd\n" in text and "## fwd+bwd\n" in text


def test_overhead_variants_run_and_the_op_is_restored(tmp_path):
    """benchmarks.profile.cp_overhead on 2 CPU devices: a row per op and pass with the four
    times and their differences; the substitutions hold only while a variant is traced, so
    the op afterwards is the shipped one."""
    import jaxcp.core as core
    import jaxcp.cp.exchange as exchange
    from benchmarks.profile import cp_overhead

    shipped = exchange._gather_summaries, core.entry_states, core.exit_cotangents
    out = tmp_path / "overhead.md"
    assert cp_overhead.main(["--backend", "xla", "--ops", "gdn", "--passes", "fwd",
                             "--T", "128", "--H", "1", "--D", "16", "--devices", "2",
                             "--iters", "1", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| gdn |")]
    assert [row.split(" | ")[1] for row in rows] == ["fwd"]
    assert all(len(row.split("|")) == 11 for row in rows)
    assert (exchange._gather_summaries, core.entry_states, core.exit_cotangents) == shipped


def test_overhead_flag_errors(capsys):
    from benchmarks.profile import cp_overhead
    for flags in (["--ops", "gla"], ["--passes", "bwd"], ["--T", "0"]):
        with pytest.raises(SystemExit) as e:
            cp_overhead.parse_args(flags)
        assert e.value.code == 2
        assert flags[0] in capsys.readouterr().err.strip().splitlines()[-1]
