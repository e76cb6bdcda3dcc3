"""The README's quick start runs as printed: its Python blocks before "## API", in order, in
one namespace, on 4 fake CPU devices, with finite results."""
import os
import re
import subprocess
import sys

from helpers import xla_flags_with_devices

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")

CHECK = """
import jax as _jax, numpy as _np
_arrays = {name: value for name, value in list(globals().items())
           if isinstance(value, _jax.Array) and _jax.numpy.issubdtype(value.dtype, _np.floating)}
_bad = [name for name, value in _arrays.items() if not bool(_jax.numpy.isfinite(value).all())]
assert not _bad, f"not finite: {_bad}"
assert {"o", "final", "o_z", "y", "loss"} <= set(_arrays), sorted(_arrays)
_np.testing.assert_allclose(_np.asarray(o_z, _np.float32), _np.asarray(o, _np.float32))
print("checked", len(_arrays), "arrays")
"""


def quick_start_blocks() -> list[str]:
    text = open(README).read()
    return re.findall(r"```python\n(.*?)```", text.split("\n## API")[0], re.S)


def test_readme_quick_start_runs_as_printed():
    blocks = quick_start_blocks()
    assert len(blocks) >= 4
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4),
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", "\n".join(blocks) + CHECK], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checked" in out.stdout
