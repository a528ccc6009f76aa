"""The Keras 3 engine's compiled steps on JAX: each batch shape compiled once, steps fused.

``keras3.fit_resumable``, ``keras3.evaluate`` and ``keras3.predict_classes`` run a model
through its ``Steps`` (one per model and ``compile``, kept on the model): the model's own
pure ``train_step``, ``test_step`` and ``predict_step`` (the loss, optimizer and metrics
given to ``model.compile``) inside functions jitted once here, so that

* each batch shape (a padding width) compiles once per model, whatever the number of
  calls, epochs and resumes in the session (Keras 3.13-3.15's ``fit`` compiles its step
  again at every call under a one-device ``DataParallel``: its metrics lose their
  sharding when reset);
* ``steps_per_execution`` steps run inside one compiled call, a ``jax.lax.scan`` over a
  stack of batches of one shape (Keras' ``fit`` on JAX loops over one-step calls in
  Python). A run of fewer consecutive batches of one shape is completed with steps that
  change nothing (``lax.cond``): one compilation serves every run of that shape, and the
  steps are the epoch's, in its order (``text.text_batches(..., group_widths=)`` orders an
  epoch in runs of one width, so that most calls are full);
* the steps of every width a pipeline names (``Batches.widths``) are compiled before the
  first step, the width of the epoch's first batch first (``precompile``: each traced
  here and compiled on a pool while the next is traced; the steps start as soon as their
  width is ready), instead of as each width first comes; ``COMPILER_OPTIONS`` holds the
  XLA options by platform;
* a thread stacks the next batches and puts them on the devices, split along the batch
  axis, while the step runs;
* the state (weights, optimizer, dropout seeds, metrics) stays on the devices between
  calls, and goes back to the model's variables at an epoch's end;
* ``compiles`` counts the compilations by kind and shape, a number to read after an epoch;
* with several JAX processes (a pod slice's hosts, after ``jax.distributed.initialize()``)
  the devices are every process's: the datasets given hold this process's rows of each
  global batch (``Batches.host_dataset``: its own shards where the pipeline reads per
  host), which go to its own devices (``put_rows``); predictions gather every host's rows.

>>> steps = Steps.of(model)                                          # doctest: +SKIP
>>> steps.compiles                      # {('train', 'input_ids[32,64] ...'): 1, ...}
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import InputError

__all__ = [
    "Steps",
    "EpochReport",
    "shape_key",
    "one_width_runs",
    "variable_values",
    "fingerprints",
    "put_rows",
    "hosts",
    "COMPILER_OPTIONS",
]

# XLA options for the steps compiled here, by platform. On a CPU, LLVM's optimization level
# 1 instead of 2 compiled a tiny DistilBERT's fused train step in about 30% less time with
# the same steps/s (benchmarks/engines.py, 2026-12-04: first epoch 15.3 s -> 10.8 s, later
# epochs 1.16 s -> 1.15 s); level 0 compiled faster still but ran 3.4x slower. A TPU's
# compiler does not read it.
COMPILER_OPTIONS = {"cpu": {"xla_backend_optimization_level": 1}}


def shape_key(batch) -> str:
    """A batch's shapes, as a compilation sees them: ``[0]['input_ids'][32, 64] ...``."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    return " ".join(f"{jax.tree_util.keystr(p)}{list(np.shape(a))}" for p, a in leaves)


@dataclass
class EpochReport:
    """What one epoch of ``Steps.train`` did: steps, calls, seconds, the examples (rows of
    weight > 0) and real tokens (their attention mask's ones) it trained on; and the
    compilations of the epoch (the caller's count: some come before the first step)."""

    steps: int = 0
    calls: int = 0
    seconds: float = 0.0
    examples: int = 0
    real_tokens: int = 0
    new_compiles: int = 0

    def rate(self) -> str:
        if not self.seconds:
            return ""
        per = self.real_tokens or self.examples
        return f"{per / self.seconds:,.0f} {'real tokens' if self.real_tokens else 'examples'}/s"


class Steps:
    """A compiled model's steps on the devices of Keras' distribution (see the module doc).

    ``Steps.of(model)`` gives the model's own (made again after a new ``compile``). The
    state passed around is ``(trainable, non_trainable, optimizer, metrics)``: lists of
    arrays in the order of the model's and optimizer's variables.
    """

    def __init__(self, model):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tpu_helpers.keras3.internals import compiled_with

        self.model, self.optimizer = model, getattr(model, "optimizer", None)
        self.compiled_with = compiled_with(model)
        self.per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        self.mesh, batch_axis = _mesh()
        self.devices = int(self.mesh.shape[batch_axis])  # what a batch's rows split over
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(batch_axis))
        self.stacked = NamedSharding(self.mesh, P(None, batch_axis))
        self.compiles: Counter = Counter()
        # a TPU or GPU reuses the state's memory for the new state; the CPU cannot
        self.donate = self.mesh.devices.flat[0].platform != "cpu"
        self._jitted = {  # the train step's is made per state layout (_lower)
            "evaluate": jax.jit(self._test_step, out_shardings=self.replicated),
            "predict": jax.jit(self._predict_step),
        }
        self._executables: dict = {}  # (kind, the arguments' shapes) -> compiled, or Future
        self._options = COMPILER_OPTIONS.get(self.mesh.devices.flat[0].platform, {})
        self._copy = jax.jit(lambda s: jax.tree.map(lambda a: a.copy(), s))

    @classmethod
    def of(cls, model) -> Steps:
        """The model's ``Steps``, made again after each ``compile`` (its optimizer, loss,
        metrics and ``steps_per_execution``)."""
        from tpu_helpers.keras3.internals import compiled_with

        steps = getattr(model, "_tpu_helpers_steps", None)
        now = compiled_with(model)
        per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        same = steps is not None and all(
            a is b for a, b in zip(steps.compiled_with, now, strict=True)
        )
        if not same or steps.per_call != per_call:
            steps = cls(model)
            model._tpu_helpers_steps = steps
        return steps

    # --- the compiled functions -----------------------------------------------------
    def _count(self, kind: str, batch) -> None:
        # runs while JAX traces, that is once per new shape: a compilation
        self.compiles[(kind, shape_key(batch))] += 1

    # The compiled functions are named *_step(s), as Keras names its own: what a
    # jax.monitoring listener of traces sees (notebook 05 counts them so).
    def _train_steps(self, state, stack, active):
        import jax

        self._count("train", jax.tree.map(lambda a: a[0], stack))

        def one(state, item):
            batch, on = item

            def step(state):
                _, new = self.model.train_step(state, batch)
                return jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)

            return jax.lax.cond(on, step, lambda state: state, state), None

        state, _ = jax.lax.scan(one, state, (stack, active))
        return state

    def _test_step(self, state, batch):
        self._count("evaluate", batch)
        _, (_, _, metrics) = self.model.test_step(state, batch)
        return metrics

    def _predict_step(self, weights, x):
        self._count("predict", x)
        outputs, _ = self.model.predict_step(weights, (x,))
        return outputs

    def _run(self, kind: str, *args):
        """``kind``'s step on ``args``, compiled once per shape of the arguments."""
        key = (kind, _avals(args))
        executable = self._executables.get(key)
        if executable is None:
            executable = self._executables[key] = self._compile(kind, args)
        elif isinstance(executable, Future):
            executable = self._executables[key] = executable.result()
        return executable(*args)

    def _compile(self, kind: str, args):
        return self._lower(kind, args).compile(self._options)

    def _lower(self, kind: str, args):
        import jax

        specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=_sharding(a)), args
        )
        jitted = self._jitted.get(kind)
        if kind == "train":  # the new state leaves with the layout the state came in with
            jitted = jax.jit(
                self._train_steps,
                donate_argnums=(0,) if self.donate else (),
                out_shardings=jax.tree.map(_sharding, args[0]),
            )
        return jitted.trace(*specs).lower()

    def precompile(self, kind: str, state, batch, widths) -> None:
        """Compile ``kind``'s step (``train``, ``evaluate``) for batches like ``batch``
        (arrays, on the host) at each of ``widths`` (the token axis: axis 1 of the features
        as wide as ``batch``'s), ``batch``'s own width first (give the epoch's first batch,
        and its steps can start while the other widths compile). Each width is traced here
        and compiled on a pool of the host's cores while the next is traced; steps of those
        shapes later wait for theirs."""
        import jax

        own = np.shape(batch[0]["input_ids"])[1] if "input_ids" in batch[0] else None
        widths = sorted(widths, key=lambda w: w != own)
        pool = ThreadPoolExecutor(compile_workers(len(widths)))
        for width in widths:
            wide = _at_width(batch, width)
            if kind == "train":
                stack = jax.tree.map(lambda a: np.broadcast_to(a, (self.per_call, *a.shape)), wide)
                stack = put(stack, self.stacked)
                args = (state, stack, put(np.ones(self.per_call, bool), self.replicated))
            else:
                args = ((*state[:2], state[3]), put(wide, self.split))
            key = (kind, _avals(args))
            if key not in self._executables:
                lowered = self._lower(kind, args)
                self._executables[key] = pool.submit(lowered.compile, self._options)
        pool.shutdown(wait=False)

    # --- the state ------------------------------------------------------------------
    def build(self, batch) -> None:
        """Build what ``compile`` left unbuilt (metrics, loss, optimizer slots) for batches
        like ``batch`` (``(features, labels, weights)``, arrays); an uncompiled model (to
        predict with) only needs its weights."""
        if self.optimizer is None:
            if not self.model.built:
                self.model(batch[0])
            return
        from tpu_helpers.keras3.internals import build_for_training

        build_for_training(self.model, batch)
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def state(self) -> tuple:
        """The model's variables as a new state on the devices (copies: a state is
        consumed by the step on a TPU), the metrics reset."""

        metrics = [np.zeros(v.shape, v.dtype) for v in self.model.metrics_variables]
        values = (*variable_values(self.model, self.optimizer), metrics)
        return put(values, self.layouts(values), may_alias=False)

    def weights(self) -> tuple:
        """The model's trainable and non-trainable variables on the devices, for
        ``evaluate`` and ``predict``."""

        values = (
            [v.value for v in self.model.trainable_variables],
            [v.value for v in self.model.non_trainable_variables],
        )
        return put(values, self.layouts(values))

    def layouts(self, values):
        """The sharding of each array of ``values`` on the steps' mesh: the one a
        ``ModelParallel`` layout map gave it, or whole on every device."""
        import jax
        from jax.sharding import NamedSharding

        def one(array):
            sharding = getattr(array, "sharding", None)
            if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
                return sharding
            return self.replicated

        return jax.tree.map(one, values)

    def saved_values(self, state, skip=()) -> list[np.ndarray | None]:
        """The state's weights, non-trainable variables and optimizer, on the host, in the
        order of ``keras3``'s saves; ``None`` at the indices in ``skip`` (not copied)."""
        import jax

        flat = [*state[0], *state[1], *state[2]]
        kept = [i for i in range(len(flat)) if i not in skip]
        values: list = [None] * len(flat)
        for i, array in zip(kept, jax.device_get([flat[i] for i in kept]), strict=True):
            values[i] = np.asarray(array)
        return values

    def unchanged(self, state, as_built: dict) -> dict:
        """Of ``as_built`` (``{index in the saves' order: fingerprint}``), the variables
        the state still holds as they were built, with their fingerprints."""
        flat = [*state[0], *state[1], *state[2]]
        indices = sorted(as_built)
        now = fingerprints([flat[i] for i in indices])
        return {i: f for i, f in zip(indices, now, strict=True) if f == as_built[i]}

    def write_back(self, state) -> tuple:
        """Put the state into the model's variables (what ``model(...)``, ``save`` and the
        callbacks read); returns the state to go on with."""
        variables = (
            self.model.trainable_variables,
            self.model.non_trainable_variables,
            self.optimizer.variables,
            self.model.metrics_variables,
        )
        into = self._copy(state) if self.donate else state  # the next step consumes state
        for group, values in zip(variables, into, strict=True):
            for variable, value in zip(group, values, strict=True):
                variable.assign(value)
        return state

    def results(self, metrics) -> dict:
        """The metrics' results (``loss``, ``accuracy`` ...) of these metric values."""
        from keras import StatelessScope

        mapping = list(zip(self.model.metrics_variables, metrics, strict=True))
        with StatelessScope(state_mapping=mapping):
            return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    # --- runs -----------------------------------------------------------------------
    def train(
        self,
        state,
        dataset,
        steps: int,
        after_call: Callable[[tuple, int], None] | None = None,
        before_call: Callable[[int], None] | None = None,
    ) -> tuple[tuple, EpochReport]:
        """``steps`` steps on the batches of ``dataset`` (a ``tf.data.Dataset``), from the
        ``state`` given; ``before_call(steps done)`` before each compiled call and
        ``after_call(state, steps done)`` after it. Returns the new state and the epoch's
        report."""
        import jax

        report, start = EpochReport(), time.perf_counter()
        for stack, active, count in _Feed(self, dataset.take(steps), self.per_call):
            if before_call is not None:
                before_call(report.steps)
            state = self._run("train", state, stack, active)
            report.steps += count.steps
            report.calls += 1
            report.examples += count.examples
            report.real_tokens += count.real_tokens
            if after_call is not None:
                after_call(state, report.steps)
        jax.block_until_ready(state)
        report.seconds = time.perf_counter() - start
        return state, report

    def evaluate(self, weights, dataset, steps: int) -> dict:
        """The metrics over ``steps`` batches of ``dataset``, with ``weights`` (trainable and
        non-trainable values: a state's first two)."""
        import jax

        metrics = put(
            [np.zeros(v.shape, v.dtype) for v in self.model.metrics_variables], self.replicated
        )
        for batch, _, _ in _Feed(self, dataset.take(steps), None):
            metrics = self._run("evaluate", (*weights, metrics), batch)
        return self.results(jax.device_get(metrics))

    def predict(self, weights, dataset, steps: int) -> tuple:
        """The model's outputs for ``steps`` batches of ``dataset`` (``(features, labels,
        weights)``), with ``weights`` (as in ``evaluate``): ``(outputs, labels, weights)``
        concatenated on the host, from one reading of the dataset, and the number of batches
        read (fewer than ``steps`` where the data ended first)."""
        found = [
            (self._run("predict", weights, batch[0]), *batch[1:])
            for batch, _, _ in _Feed(self, dataset.take(steps), None)
        ]
        if not found:
            return None, None, None, 0
        parts = _to_host(list(zip(*found, strict=True)))
        return (*(np.concatenate(part) for part in parts), len(found))

    def rates(self, dataset, steps: int, cached: int) -> tuple[float, float, float]:
        """Training steps per second of ``dataset`` (batches as ``train`` takes them, at
        least ``steps + cached`` of them): the input alone (read, stacked and put on the
        devices as ``train`` feeds them, without a step), the step alone (the compiled call
        on the first ``cached`` batches kept on the devices, repeated) and the two together
        (``train``). Each waits for the devices (``jax.block_until_ready``: a jitted call
        returns before it has run). The model's variables are left as they were: the steps
        run on states of their own."""
        import jax

        for _ in _Feed(self, dataset.take(self.per_call), self.per_call):
            pass  # the pipeline's start (its first reads, its threads), not timed
        start, done, last = time.perf_counter(), 0, None
        for last in _Feed(self, dataset.take(steps), self.per_call):
            done += last[2].steps
        if last is None:
            raise InputError("the dataset gave no batch to time. Fix: check the data it reads.")
        jax.block_until_ready(last[:2])
        alone = done / (time.perf_counter() - start)
        items = list(_Feed(self, dataset.take(cached), self.per_call))
        state = self.state()
        for stack, active, _ in items:  # each shape compiled (or its compilation awaited)
            state = self._run("train", state, stack, active)
        jax.block_until_ready(state)
        start, done, calls = time.perf_counter(), 0, 0
        while done < steps:
            stack, active, count = items[calls % len(items)]
            state = self._run("train", state, stack, active)
            done, calls = done + count.steps, calls + 1
        jax.block_until_ready(state)
        step = done / (time.perf_counter() - start)
        _, report = self.train(self.state(), dataset, steps)
        return alone, step, report.steps / report.seconds


def variable_values(model, optimizer=None) -> tuple:
    """``(trainable, non_trainable, optimizer)``: the values of a model's variables and of
    its optimizer's (``model.optimizer`` unless given), in their order: the state a JAX
    training step takes and returns (with the metrics' values after them in Keras')."""
    optimizer = optimizer if optimizer is not None else model.optimizer
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )


def fingerprints(arrays) -> list[tuple[int, int]]:
    """Two 32-bit sums of a hash of each element's bits and place, computed where the
    arrays are (one program over the devices holding them; with several JAX processes
    every one calls it): a change of any elements, a sign flipped or two swapped, leaves
    them as they were about once in 2**64. What a save records of a large variable the run
    has left as it was built, in place of its values."""
    import jax

    if not arrays:
        return []
    sums = jax.device_get(_bit_sums()(tuple(arrays)))
    return [(int(a), int(b)) for a, b in np.asarray(sums).reshape(-1, 2)]


@functools.cache
def _bit_sums():
    """The jitted ``[arrays] -> [n, 2] uint32`` of ``fingerprints``: two wrapping sums of a
    32-bit hash of each element's bits and place, computed in the array's own shape (a
    sharded array stays where it lies: partial sums, then a sum of scalars)."""
    import jax
    import jax.numpy as jnp

    def mix(x):  # a 32-bit integer hash: each bit of x moves about half the result's bits
        x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
        x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
        return x ^ (x >> 16)

    def words(array):  # each element's bits as one uint32
        if array.dtype == jnp.bool_:
            array = array.astype(jnp.uint8)
        size = array.dtype.itemsize
        if size < 4:
            unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
            return jax.lax.bitcast_convert_type(array, unsigned).astype(jnp.uint32)
        bits = jax.lax.bitcast_convert_type(array, jnp.uint32)  # 8 bytes: a last axis of 2
        return bits if size == 4 else bits[..., 0] ^ mix(bits[..., 1])

    def place(shape):  # each element's index in the flattened array (mod 2**32)
        index, stride = jnp.zeros(shape, jnp.uint32), 1
        for axis in reversed(range(len(shape))):
            step = jnp.uint32(stride % 2**32)
            index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * step
            stride *= shape[axis]
        return index

    def sums(arrays):
        out = []
        for array in arrays:
            hashed = mix(words(array) ^ mix(place(array.shape) + jnp.uint32(0x9E3779B9)))
            second = mix(hashed + jnp.uint32(0x632BE5AB))
            out.append(jnp.stack([jnp.sum(h, dtype=jnp.uint32) for h in (hashed, second)]))
        return jnp.stack(out)

    return jax.jit(sums)


def compile_workers(programs: int) -> int:
    """How many programs to compile at once: one per four of the host's cores. XLA already
    spreads one compilation over several cores; on 2 cores, two at once made the first
    epoch of ``benchmarks/engines.py`` slower (10.5 s) than one after the other (7.8 s), whose
    first width is ready sooner, to train on while the next compiles."""
    return max(1, min(programs, (os.cpu_count() or 1) // 4))


def _avals(args) -> tuple:
    import jax

    return tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves(args))


def put(tree, sharding, may_alias=None):
    """``jax.device_put(tree, sharding)`` (one sharding, or a tree of them like ``tree``). With several JAX processes each host array of
    ``tree`` is the global value (the same in every process), cut here into this process's
    shards: ``jax.device_put`` would first compare it across the processes, a collective
    that the thread feeding the steps must not run beside the steps' own."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(tree, sharding, may_alias=may_alias)

    def one(leaf, sharding):
        if isinstance(leaf, jax.Array):
            return jax.device_put(leaf, sharding, may_alias=may_alias)
        value = np.asarray(leaf)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    if isinstance(sharding, jax.sharding.Sharding):  # one for every array
        return jax.tree.map(lambda leaf: one(leaf, sharding), tree)
    return jax.tree.map(one, tree, sharding)


def put_rows(tree, sharding):
    """Batches on the devices, split along their batch axis (``sharding``: the steps'
    ``split`` or ``stacked``). With several JAX processes each array of ``tree`` holds this
    process's rows only (``Batches.host_dataset``), which go to its own devices
    (``jax.make_array_from_process_local_data``: no step between the processes)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), tree
    )


def hosts() -> tuple[int, int]:
    """``(processes, this one's index)``: JAX's hosts, as ``Batches.host_dataset`` takes them."""
    import jax

    return jax.process_count(), jax.process_index()


def multihost():
    """``jax.experimental.multihost_utils`` when several JAX processes run (a pod slice's
    hosts), ``None`` with one: what every step between processes starts from."""
    import jax

    if jax.process_count() == 1:
        return None
    from jax.experimental import multihost_utils

    return multihost_utils


def _to_host(tree):
    """Arrays split over the devices, whole on the host: of every process's devices when
    there are several (each host of a pod slice gets every row)."""
    import jax

    hosts = multihost()
    if hosts is None:
        return jax.device_get(tree)
    return jax.tree.map(lambda a: np.asarray(hosts.process_allgather(a, tiled=True)), tree)


def _sharding(array):
    return getattr(array, "sharding", None)


def _at_width(batch, width: int):
    """``batch`` (features, labels, weights) with its token features ``width`` wide: the
    features of two or more axes whose axis 1 is as wide as ``input_ids``' (zeros)."""
    features, *rest = batch
    tokens = np.shape(features["input_ids"])[1] if "input_ids" in features else None
    resized = {
        name: (
            np.zeros((a.shape[0], width, *a.shape[2:]), a.dtype)
            if tokens is not None and a.ndim >= 2 and a.shape[1] == tokens
            else a
        )
        for name, a in features.items()
    }
    return (resized, *rest)


def _mesh():
    """``(mesh, batch axis)``: the mesh of Keras' distribution (``keras3.connect``'s one
    axis, ``batch``; a ``ModelParallel``'s axes, batches split over its ``batch_dim_name``),
    or a one-axis ``batch`` mesh of JAX's first device when none is set."""
    import jax
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None and jax.process_count() > 1:
        from tpu_helpers.core.errors import EngineError

        raise EngineError(
            f"{jax.process_count()} JAX processes and no devices chosen. Fix:"
            " keras3.connect() on every host, after jax.distributed.initialize()."
        )
    if distribution is None:
        return jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",)), "batch"
    if isinstance(distribution, keras.distribution.ModelParallel):
        if jax.process_count() > 1:
            from tpu_helpers.core.errors import EngineError

            raise EngineError(
                f"ModelParallel over {jax.process_count()} JAX processes: the engine's saves"
                " read every weight whole on the first host, which a weight split over"
                " several hosts is not. Fix: one host's chips (a v5e-8, a TPU VM), or"
                " keras.distribution.DataParallel over the slice."
            )
        return distribution.device_mesh.backend_mesh, distribution.batch_dim_name
    found = np.asarray(distribution.device_mesh.devices).reshape(-1)
    return jax.sharding.Mesh(found, ("batch",)), "batch"


@dataclass
class _Count:
    steps: int
    examples: int
    real_tokens: int


_END = object()


class _Feed:
    """The batches of ``dataset`` on the devices, made by a thread two calls ahead.

    With ``per_call`` (an int), each item is ``(stack, active, count)``: up to
    ``per_call`` consecutive batches of one shape stacked on a new first axis, completed
    to ``per_call`` with copies of the last that ``active`` marks off. With ``None``,
    each item is one batch. Each is split along its batch axis over the devices. An error
    met while reading is raised where the items are taken.
    """

    def __init__(self, steps: Steps, dataset, per_call: int | None, depth: int = 2):
        self.steps, self.per_call = steps, per_call
        self.items: queue.Queue = queue.Queue(depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(dataset,), daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stopped.is_set():
            try:
                self.items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, dataset) -> None:
        try:
            if self.per_call is None:
                items = map(self._place, dataset.as_numpy_iterator())
            else:
                items = map(self._stack, one_width_runs(dataset, self.per_call))
            for item in items:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as error:  # raised again in the consumer's thread
            self._put(error)

    def _place(self, batch):

        count = _count([batch])
        return put_rows(tuple(batch), self.steps.split), None, count

    def _stack(self, group: list):
        import jax

        count = _count(group)
        filled = group + [group[-1]] * (self.per_call - len(group))
        stack = jax.tree.map(lambda *rows: np.stack(rows), *[tuple(b) for b in filled])
        active = np.arange(self.per_call) < len(group)
        return (
            put_rows(stack, self.steps.stacked),
            put(active, self.steps.replicated),
            count,
        )

    def __iter__(self) -> Iterator:
        try:
            while True:
                item = self.items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stopped.set()


def one_width_runs(dataset, per_call: int) -> Iterator[list]:
    """The batches of ``dataset`` (a ``tf.data`` dataset of batches, such as
    ``Batches.dataset(epoch)``), as NumPy, in their order, in runs of up to ``per_call``
    consecutive batches of one shape: what one compiled call of ``per_call`` fused steps
    takes (``np.stack`` a run into one array per leaf).

    >>> [len(run) for run in one_width_runs(batches.dataset(0), 4)]   # doctest: +SKIP
    [4, 4, 1, 4, 2]
    """
    group: list = []
    for batch in dataset.as_numpy_iterator():
        if group and (len(group) == per_call or _shapes(batch) != _shapes(group[0])):
            yield group
            group = []
        group.append(batch)
    if group:
        yield group


def _shapes(batch) -> list:
    import jax

    return [np.shape(leaf) for leaf in jax.tree.leaves(batch)]


def _count(group: list) -> _Count:
    """The steps, the examples and the real tokens of ``group``: rows of some weight and
    their attention mask's ones; packed rows' examples (slots of some weight, or the
    segments of a row weighted per token) and tokens (``segment_ids`` above 0); or rows
    weighted per token, as masked-LM blocks are, and their every position."""
    examples = tokens = 0
    for features, _, weights in group:
        weights = np.asarray(weights)
        kept = weights.reshape(len(weights), -1).max(axis=1) > 0
        features = features if isinstance(features, dict) else {}
        if "segment_ids" in features:  # packed rows: a weight per example (slot) ...
            segments = np.asarray(features["segment_ids"])
            if "starts" in features:  # a classifier's: each example's first token
                examples += int((weights > 0).sum())
            else:  # a weight per token (a decoder's): the segments 1, 2 ... of each row
                examples += int(segments[kept].max(axis=1, initial=0).sum())
            tokens += int((segments[kept] > 0).sum())
            continue
        examples += int(kept.sum())
        mask = features.get("attention_mask")
        if mask is not None:
            tokens += int(np.asarray(mask)[kept].sum())
        elif weights.ndim > 1:  # a weight per token: blocks whose every position is a token
            tokens += int(kept.sum()) * weights.shape[1]
    return _Count(len(group), examples, tokens)
