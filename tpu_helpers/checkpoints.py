"""Checkpoints a long run resumes from exactly, wherever it was stopped.

A Colab session disconnects, a Kaggle session reaches its limit, a preemptible TPU VM is
taken back: the run must go on from its last checkpoint with nothing lost or done twice.

* ``RunCheckpoints``: model and optimizer in a ``tf.train.CheckpointManager`` on any
  ``tf.io.gfile`` path (local, ``gs://``, ``ram://``). The optimizer's step counter is the
  data position: a run of ``steps_per_epoch`` steps an epoch resumes in epoch
  ``step // steps_per_epoch``, ``step % steps_per_epoch`` steps in, and a learning-rate
  schedule of that counter goes on where it was. Restores are verified (a variable the
  checkpoint does not hold raises ``CheckpointMismatchError``); a latest checkpoint that
  cannot be read falls back to the one before, saying so; ``run.json`` beside the
  checkpoints records what they belong to (steps per epoch, batch, data set ...) and another
  run is refused, with the difference named, before any step.
* ``fit_resumable``: Keras ``fit`` one epoch per call, each from a ``pipeline.Batches``
  (``batches.distribute(strategy, epoch, skip_steps=...)``), with a checkpoint every ``every_steps`` steps and/or
  ``every_minutes`` minutes (at the end of the ``steps_per_execution`` call that reaches
  them) and at each epoch's end. It saves step 0 before training, so running it again in
  the same kernel after an interrupt restores the last checkpoint instead of training on
  from weights the interrupted call had moved. ``initial_epoch`` keeps callbacks (TensorBoard
  logs) counting on.

>>> # fit_resumable(model, text.text_batches(train, global_batch=128, boundaries=[32, 64]),
>>> #               3, "gs://b/run/ckpt", every_minutes=10, callbacks=[log.callback()])
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable

from tpu_helpers.checks import first_line
from tpu_helpers.errors import CheckpointMismatchError
from tpu_helpers.validate import check_positive

__all__ = [
    "CheckpointMismatchError",
    "RunCheckpoints",
    "check_same_run",
    "fit_resumable",
    "model_config",
    "data_errors_explained",
]


class RunCheckpoints:
    """Save and restore ``model`` and ``optimizer`` in ``directory`` (see the module doc).

    ``run`` holds what the checkpoints belong to (JSON values); it is written to
    ``directory/run.json`` at the first save and compared at every restore.
    """

    def __init__(
        self,
        directory: str,
        model,
        optimizer,
        run: dict | None = None,
        max_to_keep: int = 3,
        log: Callable[[str], None] = print,
    ):
        import tensorflow as tf

        self.directory, self.model, self.optimizer, self.log = directory, model, optimizer, log
        self.run = json.loads(json.dumps(run or {}, sort_keys=True))  # tuples as lists
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep)
        self._pending = None

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored with the checkpoint)."""
        return int(self.optimizer.iterations.numpy())

    @property
    def run_file(self) -> str:
        return f"{self.directory.rstrip('/')}/run.json"

    def check_run(self) -> None:
        """Refuse checkpoints of another run (see ``run``), naming what differs."""
        import tensorflow as tf

        if not self.run or not tf.io.gfile.exists(self.run_file):
            return
        with tf.io.gfile.GFile(self.run_file) as f:
            check_same_run(self.directory, json.load(f), self.run)

    def restore(self) -> int:
        """Load the newest readable checkpoint, if any; return the step it resumes at.

        Variables that exist already are checked at once; those created later (a model
        built by its first batch, optimizer slots) by ``verify`` after the first step.
        """
        import tensorflow as tf

        self.check_run()
        self._pending = None
        tried = []
        for path in reversed(self.manager.checkpoints):
            try:
                status = self.checkpoint.restore(path)
            except ValueError as err:  # read, but a variable has another shape
                raise CheckpointMismatchError(
                    f"Checkpoint {path} is of another model: {first_line(err)} Fix: resume"
                    " with the model configuration that wrote it (same sizes), or start in an"
                    " empty checkpoint folder."
                ) from err
            except (tf.errors.OpError, IndexError) as err:  # missing or damaged files
                # (a truncated data file: IndexError "Read less bytes than requested")
                tried.append(f"{path} ({first_line(err)})")
                self.log(f"checkpoint {path} cannot be read; trying the one before it")
                continue
            self._pending = (status, path)
            if self.model.variables:
                self.verify()
            self.log(f"restored {path} at step {self.step}")
            return self.step
        if tried:
            raise CheckpointMismatchError(
                f"No checkpoint in {self.directory} can be read: {'; '.join(tried)[:800]}."
                " Fix: copy the folder again if it was copied, or start in an empty folder."
            )
        return self.step

    def verify(self) -> None:
        """Check that the last restore found every variable that exists now."""
        if self._pending is None:
            return
        status, path = self._pending
        self._pending = None
        try:
            status.assert_existing_objects_matched()
        except AssertionError as err:
            names = re.findall(r"<tf\.Variable '([^']+)'", str(err))
            found = f"{len(names)} not found, such as {names[:4]}" if names else first_line(err)
            raise CheckpointMismatchError(
                f"Checkpoint {path} does not hold every variable of this model and"
                f" optimizer ({found[:600]}). The weights would stay fresh while the step"
                " count resumes. Fix: resume with the model (layer names included) and"
                " optimizer that wrote it, or start in an empty checkpoint folder."
            ) from err

    def resume_point(self, steps_per_epoch: int) -> tuple[int, int]:
        """Restore the newest checkpoint (the optimizer's slots built first, so that they
        are checked too) and return ``(epoch, skip_steps)``: where the run goes on, the
        optimizer's step counter being the data position."""
        check_positive(steps_per_epoch=steps_per_epoch)
        build_optimizer(self.model, self.optimizer)
        return divmod(self.restore(), steps_per_epoch)

    def callback(self, every_steps: int | None = None, every_minutes: float | None = None):
        """A Keras callback for ``fit``: a checkpoint at step 0 if the folder has none,
        after ``every_steps`` steps or ``every_minutes`` minutes (checked at the end of
        each ``steps_per_execution`` call; ``None`` or 0: never by that measure) and at
        every epoch's end, whose logs it adds to ``history()``."""
        _check_save_every(every_steps, every_minutes, self.directory)
        return _saver(self, every_steps, every_minutes)

    def history(self) -> dict:
        """``{metric: [value per epoch]}`` of every epoch of the run, those trained by
        earlier processes included (``history.json``), as ``History.history``."""
        return _History(self.directory).merged()

    def save(self) -> str:
        """Write a checkpoint numbered by the step (and ``run.json`` the first time)."""
        import tensorflow as tf

        if self.run and not tf.io.gfile.exists(self.run_file):
            tf.io.gfile.makedirs(self.directory)
            with tf.io.gfile.GFile(self.run_file, "w") as f:
                json.dump(self.run, f, indent=1, sort_keys=True)
        return self.manager.save(checkpoint_number=self.step)


def check_same_run(directory: str, recorded: dict, now: dict) -> None:
    """Refuse the saves in ``directory`` if they are of another run: what both ``recorded``
    (when they were written) and ``now`` name (steps per epoch, global batch, model, data
    ...) must be equal. Both engines' ``fit_resumable`` check so before any step."""
    recorded, now = (json.loads(json.dumps(r, sort_keys=True)) for r in (recorded, now))
    for key in sorted(recorded.keys() & now.keys()):
        if recorded[key] != now[key]:
            raise CheckpointMismatchError(
                f"{directory} holds the saves of another run: {key} was {recorded[key]!r}"
                f" there and is {now[key]!r} now (the data position and the schedule would"
                f" not match). Fix: run with {key}={recorded[key]!r} to resume it, or pass a"
                " new folder to start afresh (the old one is kept)."
            )


def _saver(checkpoints: RunCheckpoints, every_steps: int | None, every_minutes: float | None):
    """The Keras callback of ``RunCheckpoints.callback``."""
    import tensorflow as tf

    class Saver(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.last_step, self.last_time = checkpoints.step, time.monotonic()
            self.history = _History(checkpoints.directory)

        def on_train_begin(self, logs=None):
            if not checkpoints.manager.latest_checkpoint:
                self._save()  # step 0: what a re-run after an early interrupt starts from
            self.last_step, self.last_time = checkpoints.step, time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            due = every_steps and checkpoints.step - self.last_step >= every_steps
            due = due or (every_minutes and time.monotonic() - self.last_time >= 60 * every_minutes)
            if due:
                self._save()

        def on_epoch_end(self, epoch, logs=None):
            # the row before the save: a kill between the two redoes the epoch's end,
            # whose row it replaces
            self.history.add(epoch, {k: [v] for k, v in (logs or {}).items()})
            if checkpoints.step != self.last_step:
                self._save()

        def _save(self):
            checkpoints.log(f"checkpoint step {checkpoints.step}: {checkpoints.save()}")
            self.last_step, self.last_time = checkpoints.step, time.monotonic()

    return Saver()


def build_optimizer(model, optimizer) -> None:
    """Create the optimizer's slots now, so that a restore checks them at once."""
    if not model.built or not model.variables:
        raise ValueError(
            "The model has no weights yet, so a checkpoint cannot be checked against it. Fix:"
            " build it first (a transformers model from from_pretrained is built; otherwise"
            " call it once on a batch, or model.build_in_name_scope())."
        )
    import contextlib

    strategy = getattr(model, "distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        # Keras' optimizers build their slots with build(); the legacy ones (transformers'
        # AdamWeightDecay) make them, and their step counter, on first use otherwise
        if hasattr(optimizer, "add_variable_from_reference"):
            if not getattr(optimizer, "_built", False):
                optimizer.build(model.trainable_variables)
        elif hasattr(optimizer, "_create_all_weights"):
            optimizer._create_all_weights(model.trainable_variables)


def fit_resumable(
    model,
    train,
    epochs: int,
    checkpoint_dir: str,
    *,
    validation=None,
    every_steps: int | None = None,
    every_minutes: float | None = None,
    run: dict | None = None,
    callbacks=(),
    max_to_keep: int = 2,
    log: Callable[[str], None] = print,
    **fit_kwargs,
) -> dict:
    """Train a compiled Keras ``model`` on ``train`` (a ``pipeline.Batches``) to ``epochs``
    epochs, resuming from the newest checkpoint in ``checkpoint_dir`` (see the module doc).

    Each epoch is ``train.distribute(model.distribute_strategy, epoch, skip_steps=...)``:
    the same batches in every process, so a resumed epoch goes on where the checkpoint
    was. ``validation`` (a ``Batches`` too) is evaluated at each epoch's end. Before any
    step, rows wider than the model's positions are refused. ``run`` adds to what the
    checkpoints must match (the steps per epoch and the global batch always).
    ``fit_kwargs`` go to every ``fit`` call (``verbose`` ...). Saves come at every epoch's
    end, and after ``every_steps`` steps or ``every_minutes`` minutes (``None`` or 0: never
    by that measure). A data error met while reading (a corrupt shard) is raised with what
    ``train`` can say of it (the shard, the fix). Returns the ``History`` dict of every
    epoch of the run, those of earlier processes included (``history.json``).
    """
    from tpu_helpers.pipeline import require_batches

    train = require_batches(train, "fit_resumable")
    check_positive(epochs=epochs)
    _check_save_every(every_steps, every_minutes, checkpoint_dir)
    strategy = model.distribute_strategy
    steps_per_epoch = train.steps_on(strategy)
    train.check_positions(model_config(model))
    if validation is not None:
        validation = require_batches(validation, "fit_resumable(validation=)")
        fit_kwargs["validation_data"] = validation.distribute(strategy)
        fit_kwargs["validation_steps"] = validation.steps_on(strategy)
    run = {"steps_per_epoch": steps_per_epoch, "global_batch": train.global_batch, **(run or {})}
    checkpoints = RunCheckpoints(checkpoint_dir, model, model.optimizer, run, max_to_keep, log)
    saver = checkpoints.callback(every_steps, every_minutes)
    epoch, skip = checkpoints.resume_point(steps_per_epoch)
    if epoch >= epochs:
        log(f"already trained: step {checkpoints.step} of {steps_per_epoch * epochs}")
    while epoch < epochs:
        with data_errors_explained(train, f"epoch {epoch + 1} after step {checkpoints.step}"):
            model.fit(
                train.distribute(strategy, epoch, skip_steps=skip),
                initial_epoch=epoch,
                epochs=epoch + 1,
                steps_per_epoch=steps_per_epoch - skip,
                callbacks=[*callbacks, saver],
                **fit_kwargs,
            )
        epoch, skip = epoch + 1, 0
    return checkpoints.history()


def _check_save_every(every_steps, every_minutes, checkpoint_dir) -> None:
    if every_steps:  # None or 0: no saves by step count
        check_positive(every_steps=every_steps)
    minutes_ok = isinstance(every_minutes, (int, float)) and not isinstance(every_minutes, bool)
    if every_minutes is not None and not (minutes_ok and every_minutes >= 0):
        raise ValueError(
            f"every_minutes={every_minutes!r} must be a number of minutes. Fix: 10 (a save"
            " costs seconds; a disconnect loses at most that much training), or 0 for saves"
            " at epoch ends only."
        )
    if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
        raise TypeError(
            f"checkpoint_dir={checkpoint_dir!r} must be a folder path (local or gs://). Fix:"
            " f'{output_dir}/checkpoints'."
        )


def model_config(model):
    """The transformers config of ``model`` (or of the model a wrapper holds), or None."""
    for candidate in (model, getattr(model, "inner", None)):
        config = getattr(candidate, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    return None


@contextlib.contextmanager
def data_errors_explained(batches, where: str):
    """Re-raise a data error met while reading ``batches`` (a corrupt record, a broken
    image) with what the pipeline can say of it: the file, and the fix."""
    import tensorflow as tf

    try:
        yield
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as err:
        explained = batches.explain_error(err)
        if isinstance(err, tf.errors.DataLossError) and explained is None:
            explained = (
                f"A record file of the training data is corrupt ({first_line(err)});"
                " TensorFlow does not say which file. Fix: records.verify_records(<metadata"
                " or folder>) names the shard; copy it again, or read with"
                " on_corrupt='skip'. The last checkpoint is intact."
            )
        if explained is None:
            raise
        raise type(err)(err.node_def, err.op, f"Read in {where}: {explained}") from err


class _History:
    """``fit``'s history per epoch in ``directory/history.json``, so that a run resumed in
    another process returns (and plots) the epochs of the processes before it too. An
    epoch resumed in the middle reports the metrics of the steps it ran after the resume."""

    def __init__(self, directory: str):
        import tensorflow as tf

        self.path = f"{directory.rstrip('/')}/history.json"
        self.epochs: dict[str, dict] = {}
        if tf.io.gfile.exists(self.path):
            with tf.io.gfile.GFile(self.path) as f:
                self.epochs = json.load(f)

    def add(self, epoch: int, logs: dict) -> None:
        import tensorflow as tf

        self.epochs[str(epoch)] = {k: [float(v) for v in vs] for k, vs in logs.items()}
        with tf.io.gfile.GFile(self.path, "w") as f:
            json.dump(self.epochs, f, indent=1)

    def merged(self) -> dict:
        """``{metric: [value per epoch]}`` in epoch order, as ``History.history``."""
        out: dict = {}
        for epoch in sorted(self.epochs, key=int):
            for key, values in self.epochs[epoch].items():
                out.setdefault(key, []).extend(values)
        return out
