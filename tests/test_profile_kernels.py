"""benchmarks.profile.kernels: its per-kernel table from ncu's CSV, and its bad input."""
import subprocess
import sys

import pytest

from benchmarks.profile import kernels

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def ncu_csv(launches):
    """An ncu CSV (--print-units base) of launches [(name, ns, read, written, registers)],
    with one of ncu's own messages."""
    lines = ["==PROF== Connected to process 1", HEADER]
    for i, (name, *values) in enumerate(launches):
        for metric, value in zip(kernels.METRICS, values):
            lines.append(f'"{i}","1","python3","host","{name}","1","7","(128, 1, 1)",'
                         f'"(64, 1, 1)","0","9.0","Command line profiler metrics",'
                         f'"{metric}","unit","{value:,}"')
    return "\n".join(lines) + "\n"


def test_kernel_times_sum_the_launches_of_each_name():
    text = ncu_csv([("kda_gated_sums", 2_000_000, 3_000_000_000, 1_000_000_000, 250),
                    ("loop_add_fusion", 100_000, 1_000, 2_000, 24),
                    ("kda_gated_sums", 1_000_000, 1_000_000_000, 1_000_000_000, 255)])
    sums, add = kernels.kernel_times(text)
    assert (sums.name, sums.launches, sums.ns, sums.registers) == ("kda_gated_sums", 2,
                                                                   3_000_000, 255)
    assert (sums.bytes_read, sums.bytes_written) == (4e9, 2e9)
    assert sums.tb_per_s == pytest.approx(2.0)
    assert add.launches == 1
    table = kernels.markdown({"jaxcp": [sums, add]})
    assert "| `kda_gated_sums` | 2 | 3.000 | 4.00 | 2.00 | 2.00 | 255 |" in table
    assert "Total: 3.100 ms over 3 launches." in table


def test_times_markdown_lists_each_kernel_and_the_total():
    table = kernels.times_markdown("fla", [("chunk_kda_bwd_kernel_intra", 1, 14.959),
                                       ("l2norm_fwd_kernel", 2, 0.51)])
    assert "## fla" in table
    assert "| `chunk_kda_bwd_kernel_intra` | 1 | 14.959 |" in table
    assert "Total: 15.469 ms over 3 launches." in table


def run_script(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.profile.kernels", *args],
                          capture_output=True, text=True)


def test_table_of_csv_files(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(ncu_csv([("state_bwd", 3_000_000, 10, 20, 255)]))
    done = run_script("table", f"jaxcp={path}")
    assert done.returncode == 0, done.stderr
    assert "## jaxcp" in done.stdout and "| `state_bwd` | 1 | 3.000 |" in done.stdout


@pytest.mark.parametrize("args, message", [
    (("table", "no-label.csv"), "expected LABEL=CSV"),
    (("table", "a=/nonexistent.csv"), "/nonexistent.csv"),
    (("table", "a={csv_without_time}"), "gpu__time_duration.sum"),
    (("run", "--impl", "jaxcp", "--T", "0"), "--T must be positive"),
    (("run", "--impl", "fla", "--segments", "4"), "--segments must be positive"),
    (("run", "--impl", "jaxcp", "--segments", "0"), "--segments must be positive")])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    partial = tmp_path / "partial.csv"
    partial.write_text(ncu_csv([("k", 1, 2, 3, 4)]).replace(kernels.TIME, "sm__cycles.sum"))
    done = run_script(*(a.format(csv_without_time=partial) for a in args))
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
