"""Devices and processes for the Keras 3 engine: the devices a batch is split over (simulated CPU
devices too), ``keras.distribution.DataParallel`` over them, and what several JAX processes
(a pod slice's hosts) agree on.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from tpu_helpers.core.errors import (
    EngineError,
)
from tpu_helpers.core.messages import say

__all__ = [
    "devices",
    "simulation_env",
    "connect",
    "replicas",
]


def _keras():
    """Keras on the JAX backend (set before Keras is first imported)."""
    loaded = sys.modules.get("keras")
    if loaded is None:
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if keras.backend.backend() != "jax":
        raise EngineError(
            f"Keras was imported with the {keras.backend.backend()!r} backend; this engine"
            " runs on JAX. Fix: restart the session and import tpu_helpers.keras3 (or set"
            " os.environ['KERAS_BACKEND'] = 'jax') before anything imports keras."
        )
    return keras


def devices(simulated_replicas: int = 0) -> list:
    """The devices to split batches over: every chip JAX finds on a TPU (one on Colab's free
    v5e-1, eight on Kaggle's v5e-8), or ``simulated_replicas`` CPU devices off a TPU.

    CPU devices exist only if ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` was set
    before JAX's backend started (its first ``jax.devices()``, not ``import jax``); this
    sets ``simulation_env``, which a started backend no longer reads, and sets Keras'
    backend to JAX when Keras has not been imported yet. On a pod slice (several hosts),
    call ``jax.distributed.initialize()`` on every host first: the devices are then every
    host's (``simulated_replicas``, off a TPU, counts each process's own).
    """
    if simulated_replicas:  # read when JAX's backend starts: at the first jax.devices()
        for name, value in simulation_env(simulated_replicas, os.environ).items():
            os.environ[name] = value
    _keras()
    import jax

    found = jax.devices()  # of every process: a pod slice's hosts each feed their own
    if simulated_replicas and found[0].platform == "cpu" and jax.process_count() == 1:
        if len(found) < simulated_replicas:
            raise EngineError(
                f"simulated_replicas={simulated_replicas}, but JAX started with"
                f" {len(found)} CPU device(s). Fix: restart the session and set"
                f" XLA_FLAGS=--xla_force_host_platform_device_count={simulated_replicas}"
                " before JAX is imported (keras3.devices does it when it runs first)."
            )
        found = found[:simulated_replicas]
    say(f"[keras3] {len(found)} {found[0].platform.upper()} device(s), JAX {jax.__version__}")
    return found


def simulation_env(devices: int, environ=None) -> dict[str, str]:
    """The environment variables to set (on top of ``environ``, the process's own unless
    given) for ``devices`` simulated CPU devices, read when JAX's backend starts:
    ``XLA_FLAGS`` with the device count, and ``PJRT_NPROC``, the threads of the pool that
    runs each device's share of a program, two per device.

    With the default pool (one thread per device where the machine has fewer cores), a
    loop that dispatches steps with an all-reduce faster than they run can leave some
    devices without a thread to reach it, and the others wait for them for good: XLA ends
    the process 10 s (jaxlib 0.7.2) or 40 s (0.10.2) later ("Termination timeout for `all
    reduce RendezvousKey...`"). On 2 cores at 8 devices a loop of small steps did so on
    both within seconds, and a notebook's kernel died or hung in CI; with two threads per
    device, none did. A TPU does not run this code.

    >>> simulation_env(8, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})["XLA_FLAGS"]
    '--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8'
    >>> simulation_env(8, {})["PJRT_NPROC"]
    '16'
    """
    environ = os.environ if environ is None else environ
    flags, count = environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count"
    if count not in flags:
        flags = f"{flags} {count}={devices}".strip()
    threads = max(2 * devices, int(environ.get("PJRT_NPROC") or 0))
    return {"XLA_FLAGS": flags, "PJRT_NPROC": str(threads)}


def connect(simulated_replicas: int = 0):
    """Split every batch over ``devices(simulated_replicas)``: returns the
    ``keras.distribution.DataParallel`` it made the global distribution (weights copied to
    every device, each global batch split along its first axis, one slice per device)."""
    found = devices(simulated_replicas)
    keras = _keras()
    distribution = keras.distribution.DataParallel(devices=found)
    keras.distribution.set_distribution(distribution)
    return distribution


def replicas(distribution) -> int:
    """How many devices ``distribution`` splits a batch over."""
    return int(np.asarray(distribution.device_mesh.devices).size)


def is_writer() -> bool:
    """Whether this process writes a run's files: the only one, or the first of several
    JAX processes (a pod slice's hosts, started with ``jax.distributed.initialize()``)."""
    import jax

    return jax.process_index() == 0


def first_process_says(flag: bool) -> bool:
    """The first JAX process's ``flag``, in every process (a clock or a write that only the
    first one has); ``flag`` itself with one process."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    return flag if hosts is None else bool(hosts.broadcast_one_to_all(np.asarray(flag)))


def summed_over_processes(values) -> list[int]:
    """Whole numbers (this process's counts) summed over every JAX process: the counts of
    the global batches when each host reads its own rows; ``values`` with one process."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    if hosts is None:
        return [int(v) for v in values]
    found = np.asarray(hosts.process_allgather(np.asarray(values, np.int64)))
    return [int(v) for v in found.reshape(-1, len(values)).sum(axis=0)]


def same_on_every_process(value, what: str) -> None:
    """Refuse, in every JAX process, a ``value`` (numbers) that differs between them."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    if hosts is None:
        return
    found = np.asarray(hosts.process_allgather(np.asarray(value)))
    if not (found == found[0]).all():
        raise EngineError(
            f"the hosts disagree on {what}: {found.tolist()} (one row per host). Fix: a save"
            " folder every host reads alike (gs://), and the same code and data on each."
        )


def all_processes_reach(name: str) -> None:
    """Wait here until every JAX process has reached the point ``name`` (nothing with one
    process): a host reads a save only after the one that writes it has."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    if hosts is not None:
        hosts.sync_global_devices(name)
