"""Tests run on the CPU with 8 fake devices (set before JAX initialises its backends).

Compilation, not execution, is most of the suite's time. So XLA compiles for the CPU at
backend optimisation level 0 (the suite takes about 30 % longer at level 1 and a third
more again at the default, 2; the float32 results the tests check stay inside their
bounds at levels 0 and 1), and the
pytest process, its xdist workers and the train.py runs the tests start share one
persistent compilation cache for the run, every program in it however quick its compile:
a program that several tests (or processes) compile is compiled once.

XLA's CPU triangular solves call LAPACK (scipy's OpenBLAS), whose worker threads wait by
spinning: with 8 devices each solving at once on 2 cores the spinning threads held the
cores, and an 8-device CP step took 4x as long as with one OpenBLAS thread per call."""
import atexit
import importlib.util
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0").strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxcp-tests-jit-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import chex  # noqa: E402
import pytest  # noqa: E402
# The first Pallas call in interpret mode imports this module, which adds a flag to JAX's
# tracing context: every jitted function traced before it would be traced and compiled again.
import jax.experimental.pallas.fuser  # noqa: E402,F401

chex.set_n_cpu_devices(8)

# The modules whose tests run scripts in subprocesses (tens of seconds each). They are queued
# first, so that the workers spend the run's end on short tests and finish together.
LONG_MODULES = ("test_multiprocess.py", "test_train.py", "test_readme.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONG_MODULES)


@pytest.fixture(scope="session")
def train_script():
    """scripts/train.py as a module, for the tests that call its functions in this process."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        "train.py")
    spec = importlib.util.spec_from_file_location("train_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script
