"""Tests run on the CPU with 8 fake devices (set before JAX initialises its backends)."""
import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import chex  # noqa: E402

chex.set_n_cpu_devices(8)
