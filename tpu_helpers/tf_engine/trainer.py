"""Checkpoints a long run on the TF engine resumes from exactly, wherever it was stopped.

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
  run is refused, with the difference named, before any step. ``callback()`` makes the
  checkpoints of a plain ``fit`` loop (notebook 01 writes that loop out).
* ``fit_resumable`` and ``predict_classes``: the one training loop of both engines
  (``engine.fit_with``) and its prediction, with ``TfTrainer``, this engine's side: each epoch one Keras ``fit`` call on
  ``batches.distribute(strategy, epoch, skip_steps=...)``, the state in ``RunCheckpoints``,
  a checkpoint at step 0 before training, so that running it again in the same kernel
  after an interrupt restores the last checkpoint instead of training on from weights the
  interrupted call had moved. ``initial_epoch`` keeps callbacks (TensorBoard logs)
  counting on.

>>> # fit_resumable(model, text.text_batches(train, global_batch=128, boundaries=[32, 64]),
>>> #               3, "gs://b/run/ckpt", every_minutes=10, callbacks=[log.callback()])
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.engine import (
    Cadence,
    History,
    check_same_run,
    check_save_every,
    data_errors_explained,
    fit_options,
    fit_with,
    predict_with,
    require_engine_model,
)
from tpu_helpers.core.errors import CheckpointMismatchError, InputError
from tpu_helpers.core.messages import say
from tpu_helpers.core.validate import check_positive

__all__ = [
    "CheckpointMismatchError",
    "RunCheckpoints",
    "TfTrainer",
    "fit_resumable",
    "predict_classes",
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
        log: Callable[[str], None] = say,
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
        check_save_every(every_steps, every_minutes, self.directory)
        return _saver(self, every_steps, every_minutes)

    def history(self) -> dict:
        """``{metric: [value per epoch]}`` of every epoch of the run, those trained by
        earlier processes included (``history.json``), as ``History.history``."""
        return History(self.directory).merged()

    def save(self) -> str:
        """Write a checkpoint numbered by the step (and ``run.json`` the first time)."""
        import tensorflow as tf

        if self.run and not tf.io.gfile.exists(self.run_file):
            tf.io.gfile.makedirs(self.directory)
            with tf.io.gfile.GFile(self.run_file, "w") as f:
                json.dump(self.run, f, indent=1, sort_keys=True)
        return self.manager.save(checkpoint_number=self.step)


def _saver(checkpoints: RunCheckpoints, every_steps: int | None, every_minutes: float | None):
    """The Keras callback of ``RunCheckpoints.callback``."""
    import tensorflow as tf

    class Saver(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.cadence = Cadence(every_steps, every_minutes, checkpoints.step)
            self.history = History(checkpoints.directory)

        def on_train_begin(self, logs=None):
            if not checkpoints.manager.latest_checkpoint:
                self._save()  # step 0: what a re-run after an early interrupt starts from
            self.cadence.restart(checkpoints.step)

        def on_train_batch_end(self, batch, logs=None):
            if self.cadence.due(checkpoints.step):
                self._save()

        def on_epoch_end(self, epoch, logs=None):
            # the row before the save: a kill between the two redoes the epoch's end,
            # whose row it replaces
            self.history.add(epoch, logs or {})
            if checkpoints.step != self.cadence.last_step:
                self._save()

        def _save(self):
            checkpoints.log(f"checkpoint step {checkpoints.step}: {checkpoints.save()}")
            self.cadence.restart(checkpoints.step)

    return Saver()


def build_optimizer(model, optimizer) -> None:
    """Create the optimizer's slots now, so that a restore checks them at once."""
    if not model.built or not model.variables:
        raise InputError(
            "The model has no weights yet, so a checkpoint cannot be checked against it. Fix:"
            " build it first (a transformers model from from_pretrained is built; otherwise"
            " call it once on a batch, or model.build_in_name_scope())."
        )

    strategy = getattr(model, "distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        # Keras' optimizers build their slots with build(); the legacy ones (transformers'
        # AdamWeightDecay) make them, and their step counter, on first use otherwise
        if hasattr(optimizer, "add_variable_from_reference"):
            if not getattr(optimizer, "_built", False):
                optimizer.build(model.trainable_variables)
        elif hasattr(optimizer, "_create_all_weights"):
            optimizer._create_all_weights(model.trainable_variables)


class TfTrainer:
    """The TF engine's side of ``engine.fit_with`` (see the module doc and
    ``engine``): a compiled tf-keras model (transformers' TF classes) on its strategy."""

    def __init__(self, model, *, log: Callable[[str], None] = say, verbose=2, fit_kwargs=None):
        self.model, self.log = model, log
        self.fit_kwargs = {"verbose": verbose, **(fit_kwargs or {})}
        self.max_to_keep = self.fit_kwargs.pop("max_to_keep", 2)  # checkpoints kept
        self.strategy = getattr(model, "distribute_strategy", None)

    writer = True  # one process: a TPU VM or a Colab/Kaggle runtime

    def steps_per_epoch(self, batches) -> int:
        return batches.steps_on(self.strategy)

    @staticmethod
    def agree(flag: bool) -> bool:
        return flag

    def model_config(self):
        return model_config(self.model)

    def source_fingerprint(self) -> str | None:
        """The fingerprint of the checkpoint the model was loaded from (its config's
        ``_name_or_path``: a folder, or a hub name in the cache)."""
        from tpu_helpers.data.hub import checkpoint_fingerprint

        name = getattr(model_config(self.model), "_name_or_path", None)
        return checkpoint_fingerprint(name) if name else None

    def check(self, train, validation) -> None:
        from tpu_helpers.core.pipeline import model_input_shapes

        inputs = model_input_shapes(self.model)
        for batches in (train, validation):
            if batches is not None:
                if self.strategy is not None:
                    batches.per_replica_batch(self.strategy.num_replicas_in_sync)
                batches.check_inputs(inputs)

    def open(self, directory: str, run: dict, epochs: int) -> tuple[int, int]:
        self.steps = run["steps_per_epoch"]
        self.checkpoints = RunCheckpoints(
            directory, self.model, self.model.optimizer, run, self.max_to_keep, self.log
        )
        epoch, skip = self.checkpoints.resume_point(self.steps)
        if not self.checkpoints.manager.latest_checkpoint:
            self.save(0, 0)  # what a re-run after an early interrupt starts from
        return epoch, skip

    def train_epoch(self, train, validation, epoch, first, after_call, callbacks) -> tuple:
        import tensorflow as tf

        checkpoints, start, trainer = self.checkpoints, epoch * self.steps, self
        self.last_loss = None

        class AfterCall(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                trainer.last_loss = (logs or {}).get("loss", trainer.last_loss)
                after_call(checkpoints.step - start)  # the optimizer's counter: the position

        kwargs = dict(self.fit_kwargs)
        if validation is not None:
            kwargs["validation_data"] = validation.distribute(self.strategy)
            kwargs["validation_steps"] = validation.steps_on(self.strategy)
        # the steps this fit ran: tf-keras counts them (reset by each fit); the optimizer's
        # counter also moves on the step that found the data ended
        counter = getattr(self.model, "_train_counter", None)

        def steps_run():
            return int(counter.numpy()) if counter is not None else checkpoints.step - start - first

        try:
            fitted = self.model.fit(
                train.distribute(self.strategy, epoch, skip_steps=first),
                initial_epoch=epoch,
                epochs=epoch + 1,
                steps_per_epoch=self.steps - first,
                callbacks=[*callbacks, AfterCall()],
                **kwargs,
            )
        except ValueError as error:  # the data ended inside the first call of several steps
            if "Empty logs" not in str(error):
                raise
            raise train.ran_out(
                first + steps_run(), f"epoch {epoch + 1} of fit_resumable"
            ) from error
        logs = {k: v[-1] for k, v in fitted.history.items()}
        self.last_loss = logs.get("loss", self.last_loss)
        return logs, steps_run()

    def loss(self) -> float | None:
        """The epoch's mean loss so far (the last call's logs), or None before any."""
        return None if self.last_loss is None else float(self.last_loss)

    def save(self, epoch: int, step: int) -> None:
        self.log(f"checkpoint step {self.checkpoints.step}: {self.checkpoints.save()}")

    def finish(self) -> None:
        pass

    def predict(self, batches, strategy=None):
        """``(labels, predictions, weights)``: each step on every replica (``strategy.run``
        in a ``tf.function``), the per-replica results gathered to the host."""
        import numpy as np
        import tensorflow as tf

        from tpu_helpers.core.metrics import logits_of

        strategy = strategy or self.strategy or tf.distribute.get_strategy()
        dataset = batches.distribute(strategy)
        steps = batches.steps_on(strategy)
        model = self.model

        @tf.function
        def step(features):
            def predict(x):
                logits = logits_of(model(x, training=False))
                return tf.argmax(logits, axis=-1, output_type=tf.int32)

            return strategy.run(predict, args=(features,))

        local = strategy.experimental_local_results
        labels, preds, weights = [], [], []
        iterator = iter(dataset)
        for done in range(steps):
            try:
                features, y, w = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                raise batches.ran_out(done, "predict_classes") from None
            preds += [x.numpy() for x in local(step(features))]
            labels += [x.numpy() for x in local(y)]
            weights += [x.numpy() for x in local(w)]
        return np.concatenate(labels), np.concatenate(preds), np.concatenate(weights)


def fit_resumable(model, train, epochs: int, directory: str, *, verbose=2, log=say, **options):
    """Train a compiled tf-keras ``model`` (transformers' TF classes) on ``train`` (a
    ``pipeline.Batches``) to ``epochs`` epochs, resuming from the newest save in
    ``directory``: ``engine.fit_with`` with ``TfTrainer`` (what it saves, checks and
    refuses is said there). ``options``: ``fit_with``'s (``validation``, ``every_steps``,
    ``every_minutes``, ``run``, ``callbacks``); any other goes to tf-keras' ``fit``
    (``max_to_keep``: the checkpoints kept, 2). Returns every epoch's history."""
    require_engine_model(model, "checkpoints", "fit_resumable")
    ours, fit_kwargs = fit_options(options)
    trainer = TfTrainer(model, log=log, verbose=verbose, fit_kwargs=fit_kwargs)
    return fit_with(trainer, train, epochs, directory, **ours)


def predict_classes(model, batches, strategy=None):
    """``(labels, predictions, weights)`` of one epoch of ``batches`` through a tf-keras
    ``model`` on ``strategy`` (or its own): ``engine.predict_with``."""
    require_engine_model(model, "checkpoints", "predict_classes")
    return predict_with(TfTrainer(model), batches, strategy)


def model_config(model):
    """The transformers config of ``model`` (or of the model a wrapper holds), or None."""
    for candidate in (model, getattr(model, "inner", None)):
        config = getattr(candidate, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    return None
