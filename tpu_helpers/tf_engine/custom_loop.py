"""A custom training loop with ``strategy.run``, and checkpoints that resume exactly.

What ``model.fit`` does for you, written out so each piece can be changed:

* a ``tf.function`` that runs ``steps_per_call`` training steps per call (fewer round trips
  between the host and the TPU), each step ``strategy.run`` on every replica;
* the loss of each replica divided by the *global* batch (``tf.nn.compute_average_loss``),
  so the gradients summed across replicas are those of the global mean;
* metrics created in the strategy scope and reset every epoch;
* checkpoints of model and optimizer (``tf_engine.trainer.RunCheckpoints``, the code Keras
  ``fit`` resumes with too; any ``tf.io.gfile`` path: local, ``gs://``, ``ram://``).
  ``fit`` restores the latest checkpoint and continues from its step: the optimizer's
  step counter goes on, and the data resumes at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable

from tpu_helpers.core.errors import InputError
from tpu_helpers.core.messages import say
from tpu_helpers.core.metrics import logits_of
from tpu_helpers.core.validate import check_positive
from tpu_helpers.tf_engine.observe import current_learning_rate
from tpu_helpers.tf_engine.trainer import (
    CheckpointMismatchError,
    RunCheckpoints,
    data_errors_explained,
)

__all__ = ["CheckpointMismatchError", "CustomLoop"]


class CustomLoop:
    """Train a classifier with ``strategy.run``.

    Args:
        strategy: from ``tpu_helpers.connect``.
        model, optimizer: created inside ``strategy.scope()``.
        global_batch: rows per step over all replicas (the loss is averaged over it).
        checkpoint_dir: where checkpoints go; ``None`` for none.
        steps_per_call: training steps inside one ``tf.function`` call.
        max_to_keep: checkpoints kept.
        replica_loss: ``replica_loss(per_example_loss, global_batch)``, one replica's
            share of the step's loss (its weighted per-example losses in, a scalar out);
            the replicas' shares are summed. Default: ``tf.nn.compute_average_loss``,
            the sum divided by the global batch.
        train_steps: your own ``tf.function`` ``train_steps(iterator, steps)`` that runs
            ``steps`` training steps, each ``strategy.run`` of your replica step on the
            next batch (notebook 02 writes one); the loop then drives it: resume, calls
            that end at checkpoint steps, saves, evaluation, the log. Default: the
            loop's own (a ``GradientTape`` step with ``replica_loss``).
        metrics: ``{name: metric}`` that ``train_steps`` updates, reset each epoch and
            reported by name. Default: the loop's own ``loss`` and ``accuracy``.

    The datasets yield ``(features, labels, weights)``: weights 0 mark filler rows.
    """

    def __init__(
        self,
        strategy,
        model,
        optimizer,
        global_batch: int,
        checkpoint_dir: str | None = None,
        steps_per_call: int = 1,
        max_to_keep: int = 3,
        replica_loss=None,
        train_steps=None,
        metrics: dict | None = None,
    ):
        import tensorflow as tf

        self.replica_loss = replica_loss or (
            lambda per_example, global_batch: tf.nn.compute_average_loss(
                per_example, global_batch_size=global_batch
            )
        )
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.global_batch, self.steps_per_call = global_batch, steps_per_call
        with strategy.scope():
            self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE
            )
            self.train_loss = tf.keras.metrics.Mean("train_loss")
            self.train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy("train_accuracy")
            self.val_loss = tf.keras.metrics.Mean("val_loss")
            self.val_accuracy = tf.keras.metrics.SparseCategoricalAccuracy("val_accuracy")
        # the checkpoint code that fit_resumable uses: verified restores, fallback to the
        # checkpoint before a damaged one
        self.checkpoints = (
            RunCheckpoints(checkpoint_dir, model, optimizer, max_to_keep=max_to_keep)
            if checkpoint_dir
            else None
        )
        self._train_call = train_steps or tf.function(self._train_steps)
        self.metrics = metrics or {"loss": self.train_loss, "accuracy": self.train_accuracy}
        self._eval_call = tf.function(self._eval_step)

    # --- one replica's work ---------------------------------------------------------
    def _replica_train_step(self, features, labels, weights):
        import tensorflow as tf

        self._check_batch(labels)
        with tf.GradientTape() as tape:
            logits = logits_of(self.model(features, training=True))
            per_example = self.loss_fn(labels, logits) * tf.cast(weights, tf.float32)
            loss = self.replica_loss(per_example, self.global_batch)
        variables = self.model.trainable_variables
        grads = tape.gradient(loss, variables)
        # Embedding gradients arrive as IndexedSlices whose size depends on the batch width;
        # dense gradients have one shape, which every replica's all-reduce agrees on.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        self.optimizer.apply_gradients(zip(grads, variables, strict=True))
        self.train_loss.update_state(self.loss_fn(labels, logits), sample_weight=weights)
        self.train_accuracy.update_state(labels, logits, sample_weight=weights)

    def _check_batch(self, labels) -> None:
        """The loss is divided by ``global_batch``: a batch of another size would scale
        every gradient wrongly (8x with the per-replica batch on 8 cores)."""
        import tensorflow as tf

        replicas = self.strategy.num_replicas_in_sync
        rows = labels.shape[0]
        message = (
            f"global_batch={self.global_batch} with {replicas} replica(s) means"
            f" {self.global_batch // replicas if self.global_batch % replicas == 0 else '?'}"
            " rows per replica per step"
        )
        if rows is not None:
            if rows * replicas != self.global_batch:
                raise InputError(
                    f"Each replica got a batch of {rows} rows ({rows * replicas} per step),"
                    f" but {message}: every gradient would be scaled by"
                    f" {rows * replicas}/{self.global_batch}. Fix: pass the global batch"
                    " (per-replica batch x replicas, text.global_batch_size) both to the"
                    " dataset and to CustomLoop."
                )
        else:
            tf.debugging.assert_equal(
                tf.shape(labels)[0] * replicas, self.global_batch, message=message
            )

    def _train_steps(self, iterator, steps):
        import tensorflow as tf

        for _ in tf.range(steps):
            features, labels, weights = next(iterator)
            self.strategy.run(self._replica_train_step, args=(features, labels, weights))

    def _eval_step(self, features, labels, weights):
        def step(features, labels, weights):
            logits = logits_of(self.model(features, training=False))
            self.val_loss.update_state(self.loss_fn(labels, logits), sample_weight=weights)
            self.val_accuracy.update_state(labels, logits, sample_weight=weights)

        self.strategy.run(step, args=(features, labels, weights))

    # --- the loop ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored with the checkpoint)."""
        return int(self.optimizer.iterations.numpy())

    def restore(self) -> int:
        """Load the latest checkpoint if there is one; return the step it resumes at.

        Every variable of the model and the optimizer must find its value in the
        checkpoint, or ``CheckpointMismatchError`` names those that did not (a renamed
        layer, another architecture) instead of training on from fresh weights. Variables
        that do not exist yet (a model built by its first batch, optimizer slots) are
        checked after the first training step, before anything is saved. A damaged latest
        checkpoint falls back to the one before (see ``tf_engine.trainer.RunCheckpoints``).
        """
        return self.checkpoints.restore() if self.checkpoints else self.step

    def _verify_restore(self) -> None:
        if self.checkpoints:
            self.checkpoints.verify()

    def evaluate(self, batches) -> dict:
        """Loss and accuracy over one pass of ``batches`` (a ``pipeline.Batches``; the
        weight-0 fillers count for nothing)."""
        from tpu_helpers.core.pipeline import require_batches

        batches = require_batches(batches, "CustomLoop.evaluate")
        self.val_loss.reset_state()
        self.val_accuracy.reset_state()
        iterator = iter(batches.distribute(self.strategy))
        for _ in range(batches.steps_on(self.strategy)):
            self._eval_call(*next(iterator))
        return {
            "val_loss": float(self.val_loss.result()),
            "val_accuracy": float(self.val_accuracy.result()),
        }

    def fit(
        self,
        train,
        epochs: int,
        *,
        validation=None,
        checkpoint_every: int | None = None,
        log: Callable[[str], None] = say,
        training_log=None,
        max_steps: int | None = None,
    ) -> list[dict]:
        """Train on ``train`` (a ``pipeline.Batches`` of ``global_batch`` rows) to
        ``epochs`` epochs, resuming from the latest checkpoint.

        Each epoch is ``train.distribute(strategy, epoch, skip_steps=...)``: the same
        batches in every process, so a resumed run sees the batches an uninterrupted one
        would. ``validation`` (a ``Batches``) is evaluated at each epoch's end. A
        checkpoint is written every ``checkpoint_every`` steps (default: each epoch end).
        ``training_log`` (an ``observe.TrainingLog``) gets each epoch's metrics, learning
        rate and rates for TensorBoard. ``max_steps`` stops the run at that step of the
        whole run, with a checkpoint there, as a lost runtime would stop it (the next
        ``fit`` goes on from it); an epoch cut short is neither evaluated nor reported.
        Returns one dict of metrics per epoch completed in this call.
        """
        import time

        train = self._checked_train(train, epochs, checkpoint_every, max_steps)
        steps_per_epoch = train.steps_on(self.strategy)
        checkpoint_every = checkpoint_every or steps_per_epoch
        last_step = epochs * steps_per_epoch if max_steps is None else max_steps
        if self.checkpoints:  # what the restore says (a damaged checkpoint skipped) goes to
            self.checkpoints.log = log  # the same log as the epochs
        start = self.restore()
        history = []
        for epoch in range(start // steps_per_epoch, epochs):
            done = self.step - epoch * steps_per_epoch
            end = min(steps_per_epoch, last_step - epoch * steps_per_epoch)
            if end <= done:
                log(f"stopped at step {self.step} (max_steps={max_steps})")
                break
            started = time.perf_counter()
            self._train_epoch(train, epoch, done, end, checkpoint_every, log)
            if end < steps_per_epoch:
                log(f"stopped at step {self.step} (max_steps={max_steps}), in epoch {epoch + 1}")
                break
            row = {"epoch": epoch + 1, "step": self.step}
            row.update({name: float(m.result()) for name, m in self.metrics.items()})
            seconds = time.perf_counter() - started
            if validation is not None:
                row.update(self.evaluate(validation))
            share = (steps_per_epoch - done) / steps_per_epoch  # resumed: < 1
            self._report(epoch, row, seconds, share, training_log, log)
            history.append(row)
        if self.model.variables:
            self._verify_restore()  # also when the checkpoint left nothing to train
        return history

    def _report(self, epoch, row, seconds, share, training_log, log) -> None:
        """An epoch's metrics to TensorBoard (with the learning rate, and the rates of the
        ``share`` of the epoch trained in this process) and as one ``log`` line."""
        if training_log is not None:
            rate = current_learning_rate(self.optimizer)
            training_log.write(epoch, row, seconds, rate, share)
        log(
            " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )

    def _checked_train(self, train, epochs, checkpoint_every, max_steps):
        """``train``, refused unless it is a ``pipeline.Batches`` of this loop's global batch
        that the model can take, with positive ``epochs`` and, when given, positive
        ``checkpoint_every`` and ``max_steps``."""
        from tpu_helpers.core.pipeline import model_input_shapes, require_batches
        from tpu_helpers.tf_engine.trainer import model_config

        train = require_batches(train, "CustomLoop.fit")
        if train.global_batch != self.global_batch:
            raise InputError(
                f"The batches have {train.global_batch} rows per step, the loop divides the"
                f" loss by global_batch={self.global_batch}: every gradient would be scaled"
                f" by {train.global_batch}/{self.global_batch}. Fix: one global batch for"
                " both (per-replica batch x replicas, text.global_batch_size)."
            )
        check_positive(epochs=epochs)
        if checkpoint_every is not None:
            check_positive(checkpoint_every=checkpoint_every)
        if max_steps is not None:
            check_positive(max_steps=max_steps)
        train.check_model(model_config(self.model))
        train.check_inputs(model_input_shapes(self.model))
        return train

    def _train_epoch(self, train, epoch, done, end, checkpoint_every, log):
        """The steps of epoch ``epoch`` of ``train`` from ``done`` to ``end`` (its metrics
        reset first), in calls of up to ``steps_per_call`` steps that end at every
        checkpoint step; a checkpoint at those and at ``end``; an unreadable shard or a
        short stream named with where it stopped."""
        for metric in self.metrics.values():
            metric.reset_state()
        dataset = train.distribute(self.strategy, epoch, skip_steps=done)
        with data_errors_explained(f"epoch {epoch + 1} after step {self.step}"):
            self._train_steps_until(iter(dataset), done, end, checkpoint_every, log)

    def _train_steps_until(self, iterator, done, end, checkpoint_every, log):
        import tensorflow as tf

        while done < end:
            until_checkpoint = checkpoint_every - self.step % checkpoint_every
            n = min(self.steps_per_call, end - done, until_checkpoint)
            self._train_call(iterator, tf.constant(n))
            self._verify_restore()  # variables built by the first step exist now
            done += n
            if self.checkpoints and (self.step % checkpoint_every == 0 or done == end):
                log(f"checkpoint step {self.step}: {self.checkpoints.save()}")
