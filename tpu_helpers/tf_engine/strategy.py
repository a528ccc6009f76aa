"""Pick and build the right ``tf.distribute`` strategy for this machine.

``connect()`` is the one call notebooks make:

* a TPU (TPU VM, named TPU or pod slice, or the legacy Colab address) -> ``TPUStrategy``;
* several GPUs -> ``MirroredStrategy``; one GPU -> ``OneDeviceStrategy``;
* a CPU -> the default strategy, or with ``simulated_replicas=N`` a ``MirroredStrategy``
  over N logical CPU devices, so the multi-replica code path of an 8-core TPU runs on a
  laptop and in CI.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.errors import (
    EngineError,
    InputError,
    InputTypeError,
    TimedOutError,
    TpuHelpersError,
)
from tpu_helpers.core.messages import say
from tpu_helpers.runtime import MAIN_TRACK, RuntimeFacts, detect_runtime
from tpu_helpers.runtime.env import distribution_version

__all__ = [
    "TPUConnectionError",
    "tpu_candidates",
    "connect",
    "describe",
    "replica_sum",
    "connection_failed",
]

# The TPU system may be initialised once per process; TensorFlow forces this global on us.
_TPU_STRATEGIES: dict[str, object] = {}


class TPUConnectionError(TpuHelpersError, RuntimeError):
    """No TPU could be resolved from any of the names that were tried."""


def tpu_candidates(
    tpu: str | None, facts: RuntimeFacts, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The TPU names to try, in order: the argument, ``TPU_NAME``, the legacy address, local.

    >>> tpu_candidates(None, RuntimeFacts(platform="tpu-vm", accelerator="tpu"), {})
    ['local']
    >>> tpu_candidates("my-pod", RuntimeFacts(), {"COLAB_TPU_ADDR": "10.0.0.2:8470"})
    ['my-pod', 'grpc://10.0.0.2:8470']
    """
    env = os.environ if environ is None else environ
    names = []
    if tpu:
        names.append(tpu)
    if env.get("TPU_NAME"):
        names.append(env["TPU_NAME"])
    if env.get("COLAB_TPU_ADDR"):
        names.append("grpc://" + env["COLAB_TPU_ADDR"])
    if facts.accelerator == "tpu" and not names:
        names.append("local")
    return list(dict.fromkeys(names))


def _unreachable(address: str, timeout: float = 5.0) -> str | None:
    """Why ``grpc://host:port`` cannot be reached, or ``None`` if a TCP connection opens.

    TensorFlow waits forever on an address nobody answers; this check fails in seconds.
    """
    import socket

    host, _, port = address.removeprefix("grpc://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except (OSError, ValueError) as err:
        return f"unreachable within {timeout:.0f} s ({type(err).__name__}: {err})"


def _within(seconds: float, what: str, work: Callable[[], object]):
    """Run ``work`` with a deadline: its result, or ``TimeoutError`` naming ``what``.

    TensorFlow's TPU set-up has no timeout of its own: an address that accepts a TCP
    connection but never answers blocks it forever. The work runs in a daemon thread,
    which is left behind if it never returns (the process can still exit).
    """
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = work()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"tpu_helpers: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimedOutError(f"{what} did not finish within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _connect_tpu(names: list[str], timeout: float = 600.0):
    import tensorflow as tf

    for name in names:
        if name in _TPU_STRATEGIES:
            return _TPU_STRATEGIES[name]
    errors = []
    for name in names:
        if name.startswith("grpc://"):
            unreachable = _unreachable(name)
            if unreachable:
                errors.append(f"  {name!r}: {unreachable}")
                continue

        def set_up(name=name):
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=name)
            if name != "local":
                tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
            return resolver

        try:
            resolver = _within(timeout, f"connecting to TPU {name!r} and initialising it", set_up)
        except TimeoutError as err:
            errors.append(
                f"  {name!r}: {err} (the address answers TCP but not as a TPU, or the TPU is"
                " busy or restarting; connect(timeout=...) waits longer)"
            )
            continue
        except Exception as err:  # noqa: BLE001 - every failure is reported below
            errors.append(f"  {name!r}: {type(err).__name__}: {first_line(err)}")
            continue
        strategy = tf.distribute.TPUStrategy(resolver)
        _TPU_STRATEGIES[name] = strategy
        return strategy
    raise TPUConnectionError(connection_failed(errors))


#: What TensorFlow says on a TPU it has no kernels for: Colab's v5e and v6e runtimes with
#: tensorflow-tpu 2.19 or 2.20 (tensorflow/tensorflow#96203), Kaggle's with its libtpu.
TF_CANNOT_DRIVE_THIS_TPU = ("ConfigureDistributedTPU", "No OpKernel was registered")


def connection_failed(errors: list[str]) -> str:
    """What ``connect`` says when no TPU name worked: each name's error, then the fix; when
    TensorFlow has no kernels for this TPU (Colab's and Kaggle's v5e/v6e), the main track."""
    tried = "Could not connect to a TPU. Tried:\n" + "\n".join(errors)
    if any(sign in line for line in errors for sign in TF_CANNOT_DRIVE_THIS_TPU):
        return (
            f"{tried}\nThis TensorFlow cannot drive this TPU: no public tensorflow-tpu build"
            " finds a v5e or v6e chip, and Colab's and Kaggle's TPU runtimes now run JAX. Fix:"
            f" open {MAIN_TRACK}; this notebook (the seeds' track) runs on a Cloud TPU VM with"
            " a TensorFlow image, a GPU or a CPU."
        )
    return (
        f"{tried}\nFix: on a TPU VM pass tpu='local'; for a named TPU or pod slice pass its"
        " name (or set TPU_NAME) and run in the same zone and project; on Colab/Kaggle pick"
        " Runtime -> Change runtime type -> TPU. If TensorFlow is a CPU-only build, run"
        f" `python -m tpu_helpers doctor`. On Colab's and Kaggle's TPUs, open {MAIN_TRACK}."
    )


def _simulated_cpu_strategy(replicas: int):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    configured = tf.config.get_logical_device_configuration(cpus[0])
    if configured is None or len(configured) != replicas:
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas
            )
        except RuntimeError as err:
            have = len(tf.config.list_logical_devices("CPU"))
            raise EngineError(
                f"Cannot split the CPU into simulated_replicas={replicas} devices: TensorFlow"
                f" has already initialised its devices ({have} logical CPU device(s)). Fix:"
                " restart the runtime (Runtime -> Restart session, or a new Python process)"
                " and call tpu_helpers.connect(simulated_replicas=...) before any other"
                " TensorFlow operation."
            ) from err
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
    # Gradients are summed by copies to one device, not by collective ops. TensorFlow's
    # collective ops record each instance's shape once per function call (the instance
    # record is keyed by step id and instance key), and every step of Keras'
    # ``steps_per_execution`` loop runs in one call: the all-gather of an embedding's
    # sparse gradient (rows x width tokens) then fails on the first step whose width
    # differs from an earlier one ("Shape mismatch in the collective instance").
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def connect(
    tpu: str | None = None,
    simulated_replicas: int = 0,
    facts: RuntimeFacts | None = None,
    verbose: bool = True,
    timeout: float = 600.0,
):
    """Return the best ``tf.distribute.Strategy`` here and print a one-line summary.

    Args:
        tpu: a TPU name, pod-slice name, ``"local"`` or ``"grpc://host:port"``. ``None``
            detects one (TPU VM, ``TPU_NAME``, ``COLAB_TPU_ADDR``).
        simulated_replicas: on a CPU only: split it into this many logical devices and
            mirror over them (2 or 8 mimic a TPU's replicas). 0 or 1 means the default
            strategy. Must be called before TensorFlow runs any operation.
        facts: runtime facts (``detect_runtime()`` when omitted).
        verbose: print the summary line.
        timeout: seconds to wait for a TPU to connect and initialise (a pod slice can take
            minutes); past it, ``TPUConnectionError`` says what it waited for.

    Calling it twice is safe: the TPU system is initialised once per process.

    >>> strategy = connect(simulated_replicas=2)        # doctest: +SKIP
    CPU (2 simulated replicas) | replicas 2 | TF 2.21.0 | tf-keras 2.21.0 | ...
    """
    if tpu is not None and not isinstance(tpu, str):
        raise InputTypeError(
            f"tpu={tpu!r} ({type(tpu).__name__}) must name a TPU. Fix: a name such as"
            " 'local' or 'my-tpu-v4-32', 'grpc://host:8470', or None to find the runtime's own."
        )
    if not isinstance(simulated_replicas, int) or simulated_replicas < 0:
        raise InputError(
            f"simulated_replicas={simulated_replicas!r} is not a replica count. Fix: pass an"
            " integer >= 1 (8 mimics a v2-8/v3-8 TPU), or 0 for the default strategy."
        )
    facts = facts or detect_runtime()
    import tensorflow as tf

    names = tpu_candidates(tpu, facts)
    if names:
        strategy = _connect_tpu(names, timeout)
        kind = f"TPU {facts.tpu_type or ''}".strip()
    else:
        gpus = tf.config.list_physical_devices("GPU")
        if len(gpus) > 1:
            strategy, kind = tf.distribute.MirroredStrategy(), f"{len(gpus)} GPUs"
        elif gpus:
            strategy, kind = tf.distribute.OneDeviceStrategy("/gpu:0"), "1 GPU"
        elif simulated_replicas > 1:
            strategy = _simulated_cpu_strategy(simulated_replicas)
            kind = f"CPU ({simulated_replicas} simulated replicas)"
        else:
            strategy, kind = tf.distribute.get_strategy(), "CPU"
    if verbose:
        say(describe(strategy, kind, facts))
    return strategy


def describe(strategy, kind: str = "", facts: RuntimeFacts | None = None) -> str:
    """One line: hardware, replicas, platform and the versions that matter."""
    facts = facts or detect_runtime()
    tf_build = facts.tensorflow_build or "tensorflow"
    parts = [
        kind or type(strategy).__name__,
        f"replicas {strategy.num_replicas_in_sync}",
        f"{facts.platform}",
        f"TF {distribution_version(tf_build)} ({tf_build})",
        f"tf-keras {distribution_version('tf-keras')}",
        f"transformers {distribution_version('transformers')}",
    ]
    return " | ".join(parts)


def replica_sum(strategy) -> float:
    """Prove every replica computes: replica ``i`` returns ``i + 1``, the results are summed.

    Runs ``strategy.run`` inside a ``tf.function`` (a TPU refuses it in eager mode) and
    reduces with ``strategy.reduce``. With N replicas the answer is ``N * (N + 1) / 2``.

    >>> import tensorflow as tf
    >>> replica_sum(tf.distribute.get_strategy())
    1.0
    """
    import tensorflow as tf

    @tf.function
    def step():
        def per_replica():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            value = tf.cast(replica + 1, tf.float32)
            # A small matrix product, so the replica does real work on its device.
            ones = tf.ones([8, 8]) * value
            return tf.reduce_mean(tf.linalg.matmul(ones, tf.eye(8)))

        per_replica_values = strategy.run(per_replica)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_values, axis=None)

    return float(step())
