"""benchmarks.profile.registers answers bad flags with one line and exit code 2 (its
measurement needs triton, which the tests do not install)."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, message", [(["--K", "0"], "--K must be positive"),
                                           (["--K", "96"], "--col-block must divide --K"),
                                           (["--gate-bound=-6"], "--gate-bound must be in [-5, 0)")])
def test_kernel_registers_script_rejects_bad_flags(argv, message):
    """One line on stderr, exit code 2."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.profile.registers", *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"python -m benchmarks.profile.registers: error: {message}"]
