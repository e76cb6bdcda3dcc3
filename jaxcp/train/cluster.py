"""Training over several processes (hosts) with JAX's multi-controller runtime.

Every process runs the same program. ``start`` initialises ``jax.distributed`` before any
device is touched; after it, ``jax.devices()`` lists the devices of every process and a mesh
over them spans the hosts. Each process then places only its own shards of a batch
(``global_batch``) and reads replicated results from its own devices (``local_value``).
On a machine without GPUs each process creates its share of CPU devices, and their
collectives go through gloo.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

SLURM_OR_MPI = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class Cluster:
    """coordinator: "host:port" of process 0's coordination service (None: one process, or
    let ``jax.distributed`` read the cluster from SLURM / Open MPI, ``auto``);
    num_processes, process_id: this run's processes (under auto, the environment's task
    count) and this one's index; timeout_s: how long a process waits for the others to
    join."""
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    timeout_s: int = 60
    auto: bool = False

    @property
    def distributed(self) -> bool:
        return self.auto or self.num_processes > 1

    @classmethod
    def from_environment(cls, coordinator, num_processes, process_id, timeout_s) -> "Cluster":
        """The cluster the flags describe; with none given, SLURM or Open MPI with more
        than one task is detected by ``jax.distributed`` itself (auto)."""
        if coordinator is None and num_processes is None and process_id is None:
            tasks = max(int(os.environ.get(v, "1") or 1) for v in SLURM_OR_MPI)
            return cls(num_processes=tasks, timeout_s=timeout_s, auto=tasks > 1)
        return cls(coordinator, num_processes or 1, process_id or 0, timeout_s)


def coordinator_reachable(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to host:port opens within timeout_s (retrying: process 0
    may start its service after the others start)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def start(cluster: Cluster, devices_per_process: int | None) -> None:
    """Set up this process's devices and, for several processes, initialise
    jax.distributed. devices_per_process: on CPU-only machines, the CPU devices this process
    creates (None: the machine has GPUs). Must run before any JAX call that touches a
    device. The fake CPU devices run their steps side by side, each calling LAPACK for its
    triangular solves: one OpenBLAS thread per call (unless OPENBLAS_NUM_THREADS says
    otherwise), as its idle threads spin and would hold the cores the other devices need."""
    import jax
    if devices_per_process is not None:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices_per_process)
        if cluster.distributed:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not cluster.distributed:
        return
    if cluster.auto:
        jax.distributed.initialize(initialization_timeout=cluster.timeout_s)
        return
    jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                               initialization_timeout=cluster.timeout_s)


def stop(cluster: Cluster) -> None:
    import jax
    if cluster.distributed:
        jax.distributed.shutdown()


def global_batch(host_batch, mesh, spec):
    """A batch pytree of host (numpy) arrays, the same on every process, as global arrays
    sharded by spec over mesh; each process transfers only the shards its devices hold."""
    import jax
    from jax.sharding import NamedSharding
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding,
                                                               lambda idx: x[idx]), host_batch)


def local_value(x):
    """A replicated global array's value, read from this process's first shard."""
    import numpy as np
    return np.asarray(x.addressable_data(0))
