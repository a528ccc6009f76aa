"""One training core for both engines: ``fit_resumable`` and ``predict_classes``.

Both engines train a compiled Keras model on a ``pipeline.Batches``, save the whole state
as they go and resume where they were. What they share is written here once: the checks
before any step (the data contract, epochs, save cadence, positions, batch splits), the
run record a folder of saves must match, when a save is due, the history of every epoch
(those of earlier processes too), and the explanation of a data error met while reading.
What differs is an engine's ``Trainer`` (the seam, a typed Protocol below):

===============================  =======================================================
``tf_engine.trainer.TfTrainer``  transformers' TF classes and tf-keras: each epoch one
                                 ``fit`` call on ``batches.distribute(strategy, ...)``,
                                 the state in ``tf.train`` checkpoints
                                 (``RunCheckpoints``)
``keras3.trainer.JaxTrainer``    Keras 3 on JAX: each epoch through
                                 ``keras3.steps.Steps`` (compiled once per width, steps
                                 fused), the state in ``.npz``
===============================  =======================================================

This module imports neither engine: each engine's ``fit_resumable`` and ``predict_classes``
(``keras3``, ``tf_engine.trainer``) hand its trainer to ``fit_with`` and ``predict_with``.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.errors import (
    SKIP_DAMAGED_SHARD,
    CheckpointMismatchError,
    EngineError,
    InputError,
    InputTypeError,
    TrainingDivergedError,
)
from tpu_helpers.core.pipeline import require_batches
from tpu_helpers.core.validate import check_positive

__all__ = [
    "Trainer",
    "FIT_OPTIONS",
    "fit_options",
    "fit_with",
    "predict_with",
    "is_keras3_model",
    "require_engine_model",
    "check_same_run",
    "Cadence",
    "History",
    "check_save_every",
    "check_finite",
    "optimizer_record",
    "data_errors_explained",
]


def is_keras3_model(model) -> bool:
    """Whether ``model`` is a Keras 3 model (the JAX engine's), not a tf-keras one."""
    return any(c.__module__.startswith("keras.") for c in type(model).__mro__)


#: Each engine's module: whether it trains Keras 3 models, and which models those are.
ENGINE_MODELS = {
    "keras3": (True, "Keras 3 models (keras3.classifier, KerasHub's)"),
    "checkpoints": (False, "tf-keras models (transformers' TF classes)"),
}


def require_engine_model(model, module: str, entry: str) -> None:
    """Refuse ``model`` at ``<module>.<entry>`` when it is the other engine's, naming the
    other engine's ``entry`` as the fix."""
    keras3, trains = ENGINE_MODELS[module]
    if is_keras3_model(model) != keras3:
        other = next(name for name in ENGINE_MODELS if name != module)
        kind = "not a Keras 3" if keras3 else "a Keras 3"
        raise EngineError(
            f"{type(model).__name__} is {kind} model, and {module}.{entry} runs {trains}."
            f" Fix: {other}.{entry}(model, ...), the other engine's."
        )


#: ``fit_with``'s options, which each engine's ``fit_resumable`` passes on.
FIT_OPTIONS = ("validation", "every_steps", "every_minutes", "run", "callbacks")


def fit_options(options: dict) -> tuple[dict, dict]:
    """``options`` of an engine's ``fit_resumable``, split into ``fit_with``'s and the rest."""
    ours = {k: v for k, v in options.items() if k in FIT_OPTIONS}
    return ours, {k: v for k, v in options.items() if k not in FIT_OPTIONS}


class Trainer(Protocol):
    """What an engine does for ``fit_with`` and ``predict_with``."""

    model: Any  #: the compiled model it trains
    log: Callable[[str], None]
    writer: bool  #: whether this process writes the run's files (one host of a slice)

    def steps_per_epoch(self, batches) -> int: ...

    def check(self, train, validation) -> None:
        """Refuse batches this engine cannot train on, before any step."""

    def model_config(self) -> Any:
        """The positions, classes and vocabulary the batches are checked against."""

    def source_fingerprint(self) -> str | None:
        """Of the checkpoint the model was loaded from, if any."""

    def open(self, directory: str, run: dict, epochs: int) -> tuple[int, int]:
        """Restore the newest save in ``directory`` (or save the start): (epoch, step)."""

    def train_epoch(
        self, train, validation, epoch: int, first_step: int, after_call, callbacks
    ) -> tuple[dict, int]:
        """One epoch from ``first_step``, ``after_call(step)`` after each compiled call:
        (the epoch's logs, the steps run)."""

    def loss(self) -> float | None:
        """The epoch's loss so far."""

    def save(self, epoch: int, step: int) -> None: ...

    def finish(self) -> None: ...

    def predict(self, batches, strategy=None) -> tuple:
        """(labels, predictions, weights) over one epoch of ``batches``."""

    def agree(self, flag: bool) -> bool:
        """The first process's ``flag``, in every process."""


class Cadence:
    """When a save is due: every ``every_steps`` steps or ``every_minutes`` minutes (``None``
    or 0: never by that measure), counted from the last save (``restart``)."""

    def __init__(self, every_steps: int | None, every_minutes: float | None, step: int = 0):
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.restart(step)

    def restart(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()

    def due(self, step: int) -> bool:
        by_steps = self.every_steps and step - self.last_step >= self.every_steps
        minutes = self.every_minutes
        by_time = minutes and time.monotonic() - self.last_time >= 60 * minutes
        return bool(by_steps or by_time)


def check_save_every(every_steps, every_minutes, directory: str | None = "-") -> None:
    """Refuse a save cadence or a save ``directory`` that cannot be meant, naming the fix."""
    if every_steps:  # None or 0: no saves by step count
        check_positive(every_steps=every_steps)
    minutes_ok = isinstance(every_minutes, (int, float)) and not isinstance(every_minutes, bool)
    if every_minutes is not None and not (minutes_ok and every_minutes >= 0):
        raise InputError(
            f"every_minutes={every_minutes!r} must be a number of minutes. Fix: 10 (a save"
            " costs seconds; a disconnect loses at most that much training), or 0 for saves"
            " at epoch ends only."
        )
    if not isinstance(directory, str) or not directory:
        raise InputTypeError(
            f"directory={directory!r} must be a folder path (local or gs://). Fix:"
            " f'{output_dir}/checkpoints'."
        )
    if directory != "-":
        from tpu_helpers.core.storage import check_folder

        check_folder(directory)


class History:
    """Each epoch's logs in ``directory/history.json``, so that a run resumed in another
    process returns (and plots) the epochs of the processes before it too (written by the
    process that ``write``s: one per run). An epoch
    resumed in the middle reports the metrics of the steps it ran after the resume; an
    epoch trained again (a kill between its row and its save) replaces its row."""

    def __init__(self, directory: str, write: bool = True):
        import tensorflow as tf

        self.gfile, self.write = tf.io.gfile, write
        self.path = f"{directory.rstrip('/')}/history.json"
        self.epochs: dict[str, dict] = {}
        if self.gfile.exists(self.path):
            with self.gfile.GFile(self.path) as f:
                self.epochs = json.load(f)

    def add(self, epoch: int, logs: dict) -> None:
        self.epochs[str(epoch)] = {k: [float(v)] for k, v in logs.items()}
        if not self.write:  # another process writes the file
            return
        self.gfile.makedirs(self.path.rsplit("/", 1)[0])
        with self.gfile.GFile(f"{self.path}.partial", "w") as f:  # a kill leaves the old
            json.dump(self.epochs, f, indent=1)
        self.gfile.rename(f"{self.path}.partial", self.path, True)

    def merged(self) -> dict:
        """``{metric: [value per epoch]}`` in epoch order, as ``History.history``."""
        out: dict = {}
        for epoch in sorted(self.epochs, key=int):
            for key, values in self.epochs[epoch].items():
                out.setdefault(key, []).extend(values)
        return out


def fit_with(
    trainer: Trainer,
    train,
    epochs: int,
    directory: str,
    *,
    validation=None,
    every_steps: int | None = None,
    every_minutes: float | None = 10.0,
    run: dict | None = None,
    callbacks: Iterable = (),
) -> dict:
    """Train ``trainer``'s compiled model on ``train`` (a ``pipeline.Batches``) to
    ``epochs`` epochs (each engine's ``fit_resumable`` calls this), resuming from the newest save in ``directory`` (local or
    ``gs://``).

    Each epoch reads its own shuffle of ``train`` from the step it resumes at
    (``skip_steps``), so a run stopped anywhere and run again ends with the weights of a
    run that never stopped. Saves come every ``every_steps`` steps or ``every_minutes``
    minutes (``None`` or 0: never by that measure; checked after each compiled call) and
    at each epoch's end; ``run`` adds to what the saves must match (the steps per epoch and
    the global batch always): a folder holding another run is refused, naming the
    difference (the optimizer's class and learning rate included: a run resumed with
    another rate would silently keep the saved one). Before any step, rows wider than the
    model's positions and a global batch the devices cannot split are refused; an epoch
    whose data ends before its steps is refused before its save, and a loss that is no
    longer a number stops the run before it saves (``TrainingDivergedError``), so the
    last save is the last good state. ``validation`` (a ``Batches``) is evaluated after
    each epoch; ``callbacks`` are Keras callbacks of the model's Keras. A data error met
    while reading (a corrupt shard) is raised with what ``train`` says of it (the shard,
    the fix). Returns the history
    of every epoch of the run, those of earlier processes included, as ``{name: [value
    per epoch]}`` with ``val_`` names.
    """
    train = require_batches(train, "fit_resumable")
    if validation is not None:
        validation = require_batches(validation, "fit_resumable(validation=)")
    check_positive(epochs=epochs)
    check_save_every(every_steps, every_minutes, directory)
    cadence = Cadence(every_steps, every_minutes)
    model, log = trainer.model, trainer.log
    steps = _checked_steps(trainer, train, validation)
    run = run_record(trainer, model, train, steps, run)
    epoch, first = trainer.open(directory, run, epochs)
    history = History(directory, write=trainer.writer)
    if epoch >= epochs:
        log(f"already trained: {epoch} epoch(s) of {steps} steps")
    model.stop_training = False
    while epoch < epochs and not model.stop_training:  # stop_training: EarlyStopping
        cadence.restart(first)

        def after_call(step, epoch=epoch):
            due = cadence.due(step)
            if cadence.every_minutes:  # by the clock: every process takes the first's word
                due = trainer.agree(due)
            if step < steps and due:
                check_finite(trainer.loss(), epoch, step)
                trainer.save(epoch, step)
                cadence.restart(step)

        with data_errors_explained(f"epoch {epoch + 1} after step {first}"):
            logs, done = trainer.train_epoch(train, validation, epoch, first, after_call, callbacks)
        if first + done < steps:  # the data ended first: no save of steps never run
            raise train.ran_out(first + done, f"epoch {epoch + 1} of fit_resumable")
        check_finite(trainer.loss(), epoch, steps)
        history.add(epoch, logs)  # before the save: a kill between them redoes this row
        trainer.save(epoch + 1, 0)
        epoch, first = epoch + 1, 0
    trainer.finish()
    return history.merged()


def _checked_steps(trainer: Trainer, train, validation) -> int:
    """The steps of an epoch of ``train``, once the engine and the model's positions,
    labels and ids have accepted both ``train`` and ``validation``."""
    trainer.check(train, validation)
    for batches in (train, validation):
        if batches is not None:
            batches.check_model(trainer.model_config())
    return trainer.steps_per_epoch(train)


def run_record(trainer, model, train, steps: int, given: dict | None) -> dict:
    """What a folder's saves must match to be resumed: the steps per epoch, the global
    batch, the caller's ``given`` entries, the optimizer (not the caller's to change), the
    order of batches (which batches a resumed epoch skips) and the checkpoint loaded (a
    folder of another checkpoint's run is not resumed in its place)."""
    run = {
        "steps_per_epoch": steps,
        "global_batch": train.global_batch,
        **(given or {}),
        **optimizer_record(getattr(model, "optimizer", None)),
    }
    if train.order:
        run["order"] = train.order
    source = trainer.source_fingerprint()
    if source:
        run.setdefault("checkpoint", source)
    return run


def check_same_run(directory: str, recorded: dict, now: dict) -> None:
    """Refuse the saves in ``directory`` if they are of another run: what both ``recorded``
    (when they were written) and ``now`` name (steps per epoch, global batch, model, data
    ...) must be equal. Both engines' ``fit_resumable`` check so before any step."""
    recorded, now = (json.loads(json.dumps(r, sort_keys=True)) for r in (recorded, now))
    for key in sorted(recorded.keys() & now.keys()):
        if recorded[key] != now[key] and key == "checkpoint":
            raise CheckpointMismatchError(
                f"{directory} holds the saves of a run that started from another checkpoint"
                f" ({recorded[key]} there, {now[key]} loaded now): resuming would replace the"
                " checkpoint asked for with that run's weights. Fix: load the checkpoint that"
                " run started from to resume it, or pass a new folder to start afresh (the"
                " old one is kept)."
            )
        if recorded[key] != now[key] and key in ("optimizer", "learning_rate"):
            raise CheckpointMismatchError(
                f"{directory} holds the saves of a run with another {key.replace('_', ' ')}"
                f" ({_difference(recorded[key], now[key])}): a resume would bring back the"
                " saved one. Fix: compile as that run did to resume it, or pass a new folder to"
                " train with this one (the old one is kept)."
            )
        if recorded[key] != now[key]:
            raise CheckpointMismatchError(
                f"{directory} holds the saves of another run: {key} was {recorded[key]!r}"
                f" there and is {now[key]!r} now (the data position and the schedule would"
                f" not match). Fix: run with {key}={recorded[key]!r} to resume it, or pass a"
                " new folder to start afresh (the old one is kept)."
            )


def _difference(recorded, now) -> str:
    """``was X there, is Y now``; of a schedule, only the settings that differ."""
    if isinstance(recorded, dict) and isinstance(now, dict) and "config" in recorded:
        if recorded.get("class_name") == now.get("class_name"):
            was, is_ = recorded.get("config") or {}, now.get("config") or {}
            keys = sorted(k for k in was.keys() | is_.keys() if was.get(k) != is_.get(k))
            return ", ".join(f"{k} was {was.get(k)!r} there, is {is_.get(k)!r} now" for k in keys)
        recorded, now = recorded.get("class_name"), now.get("class_name")
    return f"was {recorded!r} there, is {now!r} now"


def optimizer_record(optimizer) -> dict:
    """What a run's saves must match of its optimizer: the class and the learning rate as
    compiled (a number, to 6 digits, or a schedule's class and settings; the optimizer a
    loss scale wraps). Restoring a save restores its rate, so a run resumed with another
    would keep the old one silently. Read the first time an optimizer is trained here and
    kept on it: a rate a callback changed since is the run's own, not another run's."""
    if optimizer is None:
        return {}
    kept = getattr(optimizer, "_tpu_helpers_record", None)  # JSON: a dict would be tracked
    if kept is not None:
        return json.loads(kept)
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # mixed float16's loss scale
    record = {"optimizer": type(inner).__name__}
    try:
        rate = inner.get_config().get("learning_rate")
    except (NotImplementedError, TypeError):  # a schedule of one's own without get_config
        rate = type(getattr(inner, "_learning_rate", None)).__name__
    if isinstance(rate, dict):  # a schedule, serialized: the parts every Keras writes
        rate = {k: rate[k] for k in ("class_name", "config") if k in rate}
    elif isinstance(rate, numbers.Real):  # NumPy's too
        rate = float(f"{float(rate):.6g}")
    record["learning_rate"] = rate
    try:
        optimizer._tpu_helpers_record = json.dumps(record)
    except AttributeError:  # an optimizer that takes no new attributes: read each time
        pass
    return record


def check_finite(loss: float | None, epoch: int, step: int) -> None:
    """Refuse to go on (and so to save) once the epoch's loss is NaN or infinite."""
    import math

    if loss is None or math.isfinite(loss):
        return
    raise TrainingDivergedError(
        f"the loss is {loss} in epoch {epoch + 1} by step {step}: training diverged, and"
        " nothing was saved after the last save of a finite loss. Fix: run again into a new"
        " output folder with a lower learning rate (a tenth), float32 instead of"
        " mixed_bfloat16, or an optimizer with gradient clipping (clipnorm=1.0)."
    )


def predict_with(trainer: Trainer, batches, strategy=None):
    """One epoch of ``batches`` through ``trainer``'s model, split over its devices (the TF
    engine: ``strategy``, or the model's own): ``(labels, predictions, weights)`` as flat
    arrays, weight 0 marking the fillers of a last batch."""
    batches = require_batches(batches, "predict_classes")
    return trainer.predict(batches, strategy)


@contextlib.contextmanager
def data_errors_explained(where: str):
    """Re-raise a data error met while reading the batches with where it was met: the
    records' own check (``records.read_records``) names the shard and the fix; a corrupt
    record of one's own pipeline (TensorFlow's ``DataLossError`` names no file) gets how
    to find it."""
    import re

    import tensorflow as tf

    try:
        yield
    except tf.errors.DataLossError as err:
        explained = (
            f"A record file of the training data is corrupt ({first_line(err)});"
            " TensorFlow does not say which file. Fix: records.verify_records(<metadata"
            " or folder>) names the shard; copy it again, or read with on_corrupt='skip'."
            " The last checkpoint is intact."
        )
        raise type(err)(err.node_def, err.op, f"Read in {where}: {explained}") from err
    except tf.errors.InvalidArgumentError as err:
        ends = re.escape(SKIP_DAMAGED_SHARD)
        named = re.search(rf"assertion failed: \[(The record file .*?{ends})\]", str(err), re.S)
        if named is None:
            raise
        explained = f"Read in {where}: {named.group(1)} The last checkpoint is intact."
        raise type(err)(err.node_def, err.op, explained) from err
