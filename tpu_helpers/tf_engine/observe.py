"""Where the time of a training job goes.

* ``TrainingLog``: TensorBoard scalars per epoch (loss, metrics, learning rate, examples/s,
  real tokens/s) from ``fit`` (a Keras callback) or from ``CustomLoop.fit``, into a local
  folder, ``gs://`` or ``ram://``; ``show_tensorboard`` opens the dashboard inline where
  the runtime has the ``%tensorboard`` magic (Colab, Kaggle) and prints the command
  otherwise.
* ``input_bound_check``: the input pipeline alone, the training step alone on cached
  batches, and the two together, with a verdict and the fix that fits it.
* ``CompileWatch``: reports each new input shape after the first steps: under XLA (a TPU,
  or ``jit_compile=True``) every new shape is a new compilation.
* ``capture_profile``: a profile of a few training steps (``tf.profiler``; on a TPU VM the
  TPU's own trace) for TensorBoard's profile tab.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping

import numpy as np

from tpu_helpers.core.errors import (
    InputError,
    InputTypeError,
    MissingFileError,
    MissingPackageError,
)
from tpu_helpers.core.messages import say
from tpu_helpers.core.pipeline import InputBoundReport
from tpu_helpers.core.validate import check_positive

__all__ = [
    "current_learning_rate",
    "TrainingLog",
    "read_scalars",
    "show_tensorboard",
    "input_bound_check",
    "CompileWatch",
    "capture_profile",
    "keras_step",
]


def _check_folder(log_dir) -> str:
    """``log_dir`` as a path string, or ``TypeError`` naming it."""
    if isinstance(log_dir, bool) or not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
        raise InputTypeError(
            f"log_dir={log_dir!r} must be a folder path (local, gs:// or ram://). Fix: for"
            " example f'{output_dir}/logs'."
        )
    return str(log_dir).rstrip("/")


# --- TensorBoard logs ----------------------------------------------------------------
def current_learning_rate(optimizer) -> float | None:
    """The optimizer's current learning rate (a schedule evaluated at its step)."""
    import tensorflow as tf

    if optimizer is None:
        return None
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None:
        rate = getattr(optimizer, "learning_rate", getattr(optimizer, "lr", None))
    if isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(optimizer.iterations)
    try:
        return float(tf.keras.backend.get_value(rate))
    except (TypeError, ValueError):
        return None


class TrainingLog:
    """Per-epoch TensorBoard scalars under ``log_dir/<run>/train`` and ``.../validation``
    (``run``: a time stamp unless given, so each run is a curve of its own in TensorBoard).

    ``examples_per_epoch`` and ``real_tokens_per_epoch`` (the examples and the non-padding
    tokens one epoch trains on, e.g. ``len(split)`` and ``sum(split["length"])``) turn the
    epoch's wall time into examples/s and real tokens/s. ``log_dir`` is any
    ``tf.io.gfile`` path. As a Keras callback: ``model.fit(..., callbacks=[log.callback()])``;
    ``CustomLoop.fit(..., training_log=log)`` writes the same scalars.
    """

    def __init__(
        self,
        log_dir: str,
        examples_per_epoch: int | None = None,
        real_tokens_per_epoch: int | None = None,
        run: str | None = None,
    ):
        import importlib.util

        import tensorflow as tf

        if importlib.util.find_spec("tensorboard") is None:
            version = ".".join(tf.__version__.split(".")[:2])
            raise MissingPackageError(
                "TensorBoard is not installed, and tf.summary needs it to write logs. Fix:"
                f" pip install 'tensorboard~={version}.0' (the install cell of the notebooks"
                " adds it on Colab and Kaggle)."
            )
        self.log_dir = _check_folder(log_dir)
        self.run = run or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        self.run_dir = f"{self.log_dir}/{self.run}"
        self.examples_per_epoch = examples_per_epoch
        self.real_tokens_per_epoch = real_tokens_per_epoch
        tf.io.gfile.makedirs(self.run_dir)
        self._writers = {
            part: tf.summary.create_file_writer(f"{self.run_dir}/{part}")
            for part in ("train", "validation")
        }

    def scalars(self, part: str = "train") -> dict[str, list[tuple[int, float]]]:
        """What this run wrote so far (``read_scalars`` of its folder)."""
        return read_scalars(self.run_dir, part)

    def write(
        self,
        epoch: int,
        logs: Mapping[str, float],
        seconds: float | None = None,
        learning_rate: float | None = None,
        share: float = 1.0,
    ) -> dict:
        """Write one epoch (0-based ``epoch``, shown as step ``epoch + 1``); return the
        scalars written, by run. ``share``: the part of the epoch that ran in ``seconds``
        (an epoch resumed from a checkpoint in its middle), so rates count only its steps
        and ``epoch_seconds`` is the whole epoch's estimate."""
        import tensorflow as tf

        scalars: dict[str, dict[str, float]] = {"train": {}, "validation": {}}
        if not isinstance(logs, Mapping):
            raise InputTypeError(f"logs must be a mapping of metric names to numbers, not {logs!r}")
        for key, value in logs.items():
            if value is None or isinstance(value, str):
                continue
            if key.startswith("val_"):
                scalars["validation"][key[4:]] = float(value)
            elif key not in ("epoch", "step"):
                scalars["train"][key] = float(value)
        if learning_rate is not None:
            scalars["train"]["learning_rate"] = float(learning_rate)
        if seconds and seconds > 0 and share > 0:
            seconds = seconds / share
            scalars["train"]["epoch_seconds"] = float(seconds)
            if self.examples_per_epoch:
                scalars["train"]["examples_per_second"] = self.examples_per_epoch / seconds
            if self.real_tokens_per_epoch:
                scalars["train"]["real_tokens_per_second"] = self.real_tokens_per_epoch / seconds
        for part, values in scalars.items():
            if not values:
                continue
            with self._writers[part].as_default(step=epoch + 1):
                for name, value in values.items():
                    tf.summary.scalar(name, value)
            self._writers[part].flush()
        return scalars

    def callback(self, steps_per_epoch: int | None = None):
        """A Keras callback that writes each epoch's logs, learning rate and rates.

        ``steps_per_epoch``: the steps of a whole epoch, for ``fit`` calls that run part of
        one (``tf_engine.trainer.fit_resumable`` resuming mid-epoch): the rates then count the
        steps the optimizer took. Without it every ``fit`` epoch counts as whole.
        """
        import tensorflow as tf

        log = self

        class _Callback(tf.keras.callbacks.Callback):
            def _step(self):
                optimizer = getattr(self.model, "optimizer", None)
                return int(optimizer.iterations.numpy()) if optimizer is not None else 0

            def on_epoch_begin(self, epoch, logs=None):
                self._start, self._first = time.perf_counter(), self._step()

            def on_epoch_end(self, epoch, logs=None):
                seconds = time.perf_counter() - self._start
                share = (self._step() - self._first) / steps_per_epoch if steps_per_epoch else 1
                rate = current_learning_rate(getattr(self.model, "optimizer", None))
                log.write(epoch, logs or {}, seconds, rate, share)

        return _Callback()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def read_scalars(run_dir: str, part: str = "train") -> dict[str, list[tuple[int, float]]]:
    """The scalars of ``run_dir/part`` as ``{name: [(step, value), ...]}`` (no TensorBoard
    needed): what the dashboard would plot."""
    import tensorflow as tf

    run_dir = _check_folder(run_dir)
    if not tf.io.gfile.isdir(run_dir):
        raise MissingFileError(
            f"There is no run folder {run_dir}. Fix: pass a run's folder (TrainingLog.run_dir,"
            " the log folder followed by the run's name)."
        )
    out: dict[str, list[tuple[int, float]]] = {}
    pattern = f"{run_dir}/{part}/events.out.tfevents.*"
    for path in sorted(tf.io.gfile.glob(pattern)):
        for raw in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(raw.numpy())
            for value in event.summary.value:
                number = (
                    float(tf.make_ndarray(value.tensor))
                    if value.HasField("tensor")
                    else value.simple_value
                )
                out.setdefault(value.tag, []).append((int(event.step), number))
    return out


def show_tensorboard(log_dir: str) -> str:
    """Open TensorBoard on ``log_dir`` inline where the runtime has the ``%tensorboard``
    magic (Colab, Kaggle); elsewhere print the command. Returns what was done."""
    hosted = "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ
    command = f"tensorboard --logdir {log_dir}"
    if hosted:
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None:
                shell.run_line_magic("load_ext", "tensorboard")
                shell.run_line_magic("tensorboard", f"--logdir {log_dir}")
                return "inline"
        except Exception as err:  # noqa: BLE001  (the magic is a convenience; say why)
            say(f"TensorBoard could not open inline ({err}); run: {command}")
            return "command"
    say(f"TensorBoard: run `{command}` and open http://localhost:6006")
    return "command"


def _distributed(model, dataset):
    return model.distribute_strategy.experimental_distribute_dataset(dataset)


def _snapshot(model):
    """Every variable of ``model`` and its optimizer (whose slots and step counter are made
    first, so that none is left out) with its value now."""
    from tpu_helpers.tf_engine.trainer import build_optimizer

    build_optimizer(model, model.optimizer)
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(
            optimizer.variables() if callable(optimizer.variables) else optimizer.variables
        )
    return [(v, v.numpy()) for v in variables]


def _timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    if out is not None:
        import tensorflow as tf

        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
    return time.perf_counter() - start


def input_bound_check(
    model, batches, *, steps: int = 30, cached_batches: int = 8
) -> InputBoundReport:
    """Measure where a compiled Keras ``model``'s training time goes on ``batches`` (a
    ``pipeline.Batches``: its first epoch's global batches, distributed here by the
    model's strategy).

    1. the input pipeline alone: ``steps`` batches pulled inside a ``tf.function``;
    2. the training step alone: ``model``'s own train function on ``cached_batches``
       batches held in memory, repeated (each shape compiled before timing);
    3. both together: the train function on the dataset, as ``fit`` runs it.

    The model's and optimizer's variables are restored afterwards: the check trains, but
    leaves no trace. Batches per second count ``steps_per_execution`` steps per call.
    """
    import tensorflow as tf

    from tpu_helpers.core.pipeline import require_batches

    check_positive(steps=steps, cached_batches=cached_batches)
    if getattr(model, "optimizer", None) is None:
        raise InputError("Compile the model first (model.compile(...)): the check runs its step.")
    dataset = require_batches(batches, "input_bound_check").dataset(0).repeat()
    per_call = getattr(model, "_steps_per_execution", None)
    per_call = int(per_call.numpy()) if per_call is not None else 1
    dist = _distributed(model, dataset)

    @tf.function
    def pull(iterator, n):
        for _ in tf.range(n):
            next(iterator)  # stateful: runs although its value is not used
        return n

    iterator = iter(dist)
    pull(iterator, tf.constant(2))  # start the pipeline and trace
    input_seconds = _timed(lambda: pull(iterator, tf.constant(steps)), 1)

    train = model.make_train_function(force=True)
    saved = _snapshot(model)
    try:
        cached_iter = iter(_distributed(model, dataset.take(cached_batches).cache().repeat()))
        for _ in range(-(-cached_batches // per_call)):  # fills the cache, compiles its shapes
            train(cached_iter)  # (each call runs per_call steps)
        calls = max(1, steps // per_call)
        step_seconds = _timed(lambda: train(cached_iter), calls)
        live = iter(dist)
        train(live)  # the first call of a fresh iterator starts its pipeline
        calls_live = max(1, steps // per_call)
        together_seconds = _timed(lambda: train(live), calls_live)
    finally:
        for variable, value in saved:
            variable.assign(value)
    return InputBoundReport(
        input_per_second=steps / input_seconds,
        step_per_second=calls * per_call / step_seconds,
        together_per_second=calls_live * per_call / together_seconds,
        steps=steps,
    )


# --- recompilation watch ---------------------------------------------------------------
class CompileWatch:
    """Report each new input shape after the first steps: under XLA each is a new program.

    ``train = watch.watch(train_dataset)`` passes every batch through unchanged (TensorFlow
    ops only: a ``scan`` keeps the shapes seen so far) and appends one line per new shape
    to ``watch.path``; ``watch.callback()`` in ``fit`` prints the lines as they come, and
    ``watch.events()`` returns them. ``expected`` shapes (the widths you chose) are
    announced as expected; any shape beyond them is the recompilation trap of notebook 05.

    One watch may watch several datasets (one per epoch, as ``fit_resumable`` makes them):
    each starts from the shapes the watch has recorded, as the compiled programs do, so a
    width is reported once per run, not once per dataset.
    """

    def __init__(self, log_dir: str, expected: int | None = None, capacity: int = 256):
        import tensorflow as tf

        self.expected = expected
        self.capacity = capacity
        tf.io.gfile.makedirs(str(log_dir))
        self.path = f"{str(log_dir).rstrip('/')}/new-shapes-{uuid.uuid4().hex[:8]}.txt"
        self._read = 0

    def watch(self, dataset):
        import tensorflow as tf

        flat_specs = tf.nest.flatten(dataset.element_spec)
        ranks = [spec.shape.rank for spec in flat_specs]
        width = sum(ranks)
        names = _leaf_names(dataset.element_spec)
        capacity = self.capacity
        recorded = self.events()  # shapes of datasets watched before: compiled already
        known = [e["key"] for e in recorded if len(e["key"]) == width][: capacity - 1]
        seen = np.full([capacity, width], -1, np.int64)
        seen[: len(known)] = np.asarray(known, np.int64).reshape(-1, width)
        initial = (
            tf.constant(0, tf.int64),
            tf.constant(seen),
            tf.constant(len(recorded), tf.int64),
        )

        def step(state, element):
            index, seen, count = state
            flat = tf.nest.flatten(element)
            key = tf.concat([tf.shape(t, out_type=tf.int64) for t in flat], axis=0)
            new = tf.logical_not(tf.reduce_any(tf.reduce_all(tf.equal(seen, key[None]), axis=1)))
            seen, count = tf.cond(
                new,
                lambda: self._record(index, key, _shapes_line(names, flat), seen, count),
                lambda: (seen, count),
            )
            return (index + 1, seen, count), element

        return dataset.scan(initial, step)

    def _record(self, index, key, shapes, seen, count):
        """Append a new shape's line to the file (``index``, how many shapes so far, the key,
        the named shapes) and add its key to ``seen``; inside the input pipeline."""
        import tensorflow as tf

        line = tf.strings.join(
            [
                tf.strings.as_string(index),
                tf.strings.as_string(count + 1),
                tf.strings.reduce_join(tf.strings.as_string(key), separator=","),
                shapes,
            ],
            "\t",
        )
        printed = tf.print(line, output_stream=f"file://{self.path}")
        with tf.control_dependencies([printed]):
            slot = tf.minimum(count, self.capacity - 1)
            return tf.tensor_scatter_nd_update(seen, [[slot]], key[None]), count + 1

    def events(self) -> list[dict]:
        """Every new shape so far: ``{"element", "shapes_so_far", "shapes", "expected",
        "key"}``; ``element`` counts the elements of the watched dataset it was found in
        from 0 (per-replica batches when it feeds a strategy's replicas, so a step is
        ``element // replicas_per_host``); ``key`` is the flat list of its dimensions."""
        import tensorflow as tf

        if not tf.io.gfile.exists(self.path):
            return []
        with tf.io.gfile.GFile(self.path) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        out = []
        for line in lines:
            element, so_far, key, shapes = line.split("\t", 3)
            n = int(so_far)
            out.append(
                {
                    "element": int(element),
                    "shapes_so_far": n,
                    "shapes": shapes,
                    "expected": self.expected is None or n <= self.expected,
                    "key": [int(d) for d in key.split(",")],
                }
            )
        return out

    def report(self, new_only: bool = True) -> list[str]:
        """Lines for the events not reported yet (all with ``new_only=False``)."""
        events = self.events()
        start = self._read if new_only else 0
        self._read = len(events)
        lines = []
        for e in events[start:]:
            what = (
                "expected"
                if e["expected"]
                else f"UNEXPECTED (more than the {self.expected} expected): XLA compiles again"
            )
            lines.append(
                f"element {e['element']}: new input shape #{e['shapes_so_far']} {e['shapes']} ({what})"
            )
        return lines

    def callback(self, log: Callable[[str], None] = say):
        import tensorflow as tf

        watch = self

        class _Callback(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                for line in watch.report():
                    log(line)

        return _Callback()


def _shapes_line(names, flat):
    """``name=[d0 d1] ...`` of an element's tensors, a string tensor."""
    import tensorflow as tf

    return tf.strings.reduce_join(
        [tf.strings.format(name + "={}", tf.shape(t)) for name, t in zip(names, flat, strict=True)],
        separator=" ",
    )


def _leaf_names(spec) -> list[str]:
    """Names of the leaves of an element spec, in ``tf.nest.flatten`` order."""
    top = ("features", "labels", "weights")

    def walk(node, name):
        if isinstance(node, Mapping):
            return [leaf for key in sorted(node) for leaf in walk(node[key], str(key))]
        if isinstance(node, (tuple, list)):
            return [
                leaf
                for i, item in enumerate(node)
                for leaf in walk(item, f"{name}[{i}]" if name else (top[i] if i < 3 else f"[{i}]"))
            ]
        return [name or "x"]

    return walk(spec, "")


# --- profile ---------------------------------------------------------------------------
def capture_profile(log_dir: str, run_step: Callable[[], object], steps: int = 5) -> list[str]:
    """Profile ``steps`` calls of ``run_step`` (one training step, or one
    ``steps_per_execution`` call) into ``log_dir`` for TensorBoard's profile tab; return the
    files written. On a TPU VM the same call records the TPU's own trace.

    Each call is marked as a step (``tf.profiler.experimental.Trace(step_num=...)``), so
    the profile's overview splits step time into input, compute and idle.
    """
    import tensorflow as tf

    log_dir = _check_folder(log_dir)
    check_positive(steps=steps)
    run_step()  # compile outside the profile: the profile shows steady steps
    before = set(tf.io.gfile.glob(f"{log_dir}/plugins/profile/*/*"))
    tf.profiler.experimental.start(log_dir)
    try:
        for step in range(steps):
            with tf.profiler.experimental.Trace("train", step_num=step, _r=1):
                out = run_step()
                tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
    finally:
        tf.profiler.experimental.stop()
    after = set(tf.io.gfile.glob(f"{log_dir}/plugins/profile/*/*"))
    return sorted(after - before)


def keras_step(model, batches) -> Callable[[], object]:
    """One call of ``model``'s own train function on ``batches`` (a ``pipeline.Batches``;
    what ``fit`` runs per ``steps_per_execution`` steps), for ``capture_profile``. It
    trains the model."""
    from tpu_helpers.core.pipeline import require_batches

    dataset = require_batches(batches, "keras_step").dataset(0)
    iterator = iter(_distributed(model, dataset.repeat()))
    train = model.make_train_function()  # fit's own, if it ran: traced already
    return lambda: train(iterator)
