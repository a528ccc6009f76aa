"""Runs that are killed or interrupted resume to the weights and learning rates of a run
that never stopped; checkpoints of another run, another model or damaged files are named."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "resume_worker.py"


def start(tmp_path, name, *flags) -> subprocess.Popen:
    """Start the worker in a new process (checkpoints in ``name``-ckpt, weights in
    ``name``.npz, learning rates in ``name``.lr)."""
    command = [sys.executable, str(WORKER), "--dir", str(tmp_path / f"{name}-ckpt")]
    command += ["--out", str(tmp_path / f"{name}.npz"), "--lr-log", str(tmp_path / f"{name}.lr")]
    return subprocess.Popen(
        command + list(flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    """Wait for a worker (a hang fails the test); return (return code, output)."""
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("a worker did not finish within 300 s")
    return process.returncode, stdout + stderr[-3000:]


def train(tmp_path, name, *flags):
    """Run the worker in a new process; return (return code, output)."""
    return finish(start(tmp_path, name, *flags))


class Reference:
    """The run that never stopped, started at once and waited for only when its result is
    needed, so that it runs beside the kill chain it is compared with."""

    def __init__(self, tmp_path, *flags):
        self.tmp_path, self.process, self.done = tmp_path, start(tmp_path, "whole", *flags), None

    def result(self):
        """(final weights, learning rate per step, output)."""
        if self.done is None:
            code, out = finish(self.process)
            assert code == 0, out
            self.done = weights(self.tmp_path, "whole"), learning_rates(self.tmp_path, "whole"), out
        return self.done


def weights(tmp_path, name):
    with np.load(tmp_path / f"{name}.npz") as saved:
        return [saved[k] for k in sorted(saved.files, key=lambda k: int(k.split("_")[1]))]


def learning_rates(tmp_path, name):
    """step -> learning rate; a step run twice (after a kill) must have one rate."""
    rates = {}
    for line in (tmp_path / f"{name}.lr").read_text().split("\n"):
        if line:
            step, rate = line.split()
            assert rates.setdefault(int(step), rate) == rate, (step, rates[int(step)], rate)
    return rates


def assert_trained_like(tmp_path, reference):
    """The run in ``tmp_path`` ended with ``reference``'s weights, bit for bit (op
    determinism), and ran every step at its learning rate."""
    whole, whole_rates, _ = reference.result()
    for a, b in zip(weights(tmp_path, "run"), whole, strict=True):
        np.testing.assert_array_equal(a, b)
    assert learning_rates(tmp_path, "run") == whole_rates


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    reference = Reference(tmp_path_factory.mktemp("uninterrupted"))
    yield reference
    reference.process.kill()  # if no test waited for it


def kill_chain(tmp_path, reference, steps, *flags, kills=None):
    """Killed with SIGKILL at step 6 (mid-epoch, two steps after the save at 4), then,
    resumed, at 8 (just after the save at 8), then at ``steps``, the first epoch's end
    (after its save); the last process finishes the run. ``kills`` gives other
    ``(kill at step, checkpoint the process resumed from)`` pairs. The result is compared
    with ``reference``'s, a ``Reference`` of ``steps`` steps an epoch. Returns its output."""
    for kill_at, resumed_from in kills or ((6, None), (8, 4), (steps, 8)):
        code, out = train(tmp_path, "run", "--kill-at", str(kill_at), *flags)
        assert code == -9, out  # SIGKILL: nothing after the kill ran
        if resumed_from is not None:
            assert f"restored {tmp_path}/run-ckpt/ckpt-{resumed_from} at step" in out, out
    code, out = train(tmp_path, "run", *flags)
    assert code == 0, out
    assert f"restored {tmp_path}/run-ckpt/ckpt-{steps} at step {steps}" in out, out
    assert f"FINAL {3 * steps}" in out, out
    assert f"STEPS {steps} FINAL {3 * steps}" in reference.result()[2], reference.result()[2]
    assert_trained_like(tmp_path, reference)
    return out


def test_a_run_killed_again_and_again_resumes_to_the_weights_of_one_that_never_stopped(
    tmp_path, uninterrupted
):
    out = kill_chain(tmp_path, uninterrupted, 13)
    assert "EPOCHS IN HISTORY 3" in out  # the epochs of the killed processes are kept
    # what the checkpoints belong to: the plan's steps, global batch and order of batches,
    # the optimizer and its schedule, recorded by fit_resumable itself, and the worker's own
    recorded = json.loads((tmp_path / "run-ckpt" / "run.json").read_text())
    order = {"group_widths": 1, "seed": 0, "shuffle": True}
    schedule = recorded.pop("learning_rate")
    assert recorded == {
        "data": "memory",
        "global_batch": 8,
        "steps_per_epoch": 13,
        "order": order,
        "optimizer": "Adam",
    }
    assert schedule["class_name"] == "PolynomialDecay" and schedule["config"]["decay_steps"] == 39


@pytest.mark.parametrize(
    "steps, flags",
    [(13, ("--data", "masked")), (14, ("--loop", "custom", "--data", "records"))],
    ids=["notebook-06-masked-blocks", "custom-loop-on-records"],
)
def test_masked_pretraining_and_the_custom_loop_on_records_resume_the_same_way(
    tmp_path, steps, flags
):
    """Killed mid-epoch (step 6, after the save at 4), then at the first epoch's end (just
    after its save): the two kinds of stop the full chain above also covers; the custom
    loop reads notebook 03's bucketed shards (their read plan has 14 steps an epoch), so
    the records path resumes mid-epoch and at an epoch's end too."""
    reference = Reference(tmp_path, *flags)
    kill_chain(tmp_path, reference, steps, *flags, kills=((6, None), (steps, 4)))


def test_an_interrupt_then_a_rerun_in_the_same_process_trains_each_step_once(
    tmp_path, uninterrupted
):
    code, out = train(tmp_path, "run", "--interrupt-at", "6")
    assert code == 0, out
    assert "INTERRUPTED at step 6" in out and "restored" in out
    assert_trained_like(tmp_path, uninterrupted)


def tiny(units=3):
    import tensorflow as tf

    model = tf.keras.Sequential(
        [tf.keras.Input((4,)), tf.keras.layers.Dense(units), tf.keras.layers.Dense(2)]
    )
    model.compile(tf.keras.optimizers.Adam(), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def test_another_run_another_model_and_damaged_files_are_named(tmp_path):
    from tpu_helpers.tf_engine.trainer import CheckpointMismatchError, RunCheckpoints

    folder = str(tmp_path / "ckpt")
    model = tiny()
    saved = RunCheckpoints(folder, model, model.optimizer, {"steps_per_epoch": 10})
    saved.save()
    model.optimizer.iterations.assign(5)
    latest = saved.save()

    other_run = RunCheckpoints(folder, tiny(), model.optimizer, {"steps_per_epoch": 12})
    with pytest.raises(CheckpointMismatchError, match="steps_per_epoch was 10 there and is 12"):
        other_run.restore()
    bigger = tiny(units=5)
    with pytest.raises(CheckpointMismatchError, match="of another model.*shape"):
        RunCheckpoints(folder, bigger, bigger.optimizer, {"steps_per_epoch": 10}).restore()

    # a damaged latest checkpoint: the one before it is restored, and the log says so
    data = next(Path(folder).glob(Path(latest).name + ".data-*"))
    data.write_bytes(data.read_bytes()[:7])
    said = []
    fresh = tiny()
    again = RunCheckpoints(folder, fresh, fresh.optimizer, {"steps_per_epoch": 10}, log=said.append)
    assert again.restore() == 0
    assert any("cannot be read" in line for line in said) and "step 0" in said[-1]
    np.testing.assert_array_equal(fresh.layers[0].kernel.numpy(), model.layers[0].kernel.numpy())


def test_a_model_without_weights_is_refused_with_the_fix(tmp_path):
    import tensorflow as tf

    from tpu_helpers.core import pipeline
    from tpu_helpers.tf_engine.trainer import fit_resumable

    model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    model.compile("adam", "mse")
    plan = pipeline.from_dataset_fn(lambda e, s: None, steps_per_epoch=10, global_batch=1)
    with pytest.raises(ValueError, match="no weights yet"):
        fit_resumable(model, plan, 1, str(tmp_path))
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        pipeline.from_dataset_fn(lambda e, s: None, steps_per_epoch=0, global_batch=1)
    # the old call, a function of (epoch, skip) and its steps, is refused with the fix
    with pytest.raises(TypeError, match="pipeline.from_dataset_fn"):
        fit_resumable(model, lambda e, s: None, 1, str(tmp_path))


def test_checkpoints_of_another_global_batch_are_refused(tmp_path):
    import tensorflow as tf

    from tpu_helpers.core import pipeline
    from tpu_helpers.tf_engine.trainer import CheckpointMismatchError, fit_resumable

    def model():
        x = tf.keras.Input((4,), name="x")
        made = tf.keras.Model({"x": x}, tf.keras.layers.Dense(2)(x))
        made.compile(tf.keras.optimizers.Adam(), "mse")
        return made

    features = {"x": np.arange(32.0).reshape(8, 4)}
    labels = np.zeros((8, 2), np.float32)
    said = []
    four = pipeline.from_arrays(features, labels, global_batch=4)
    fit_resumable(model(), four, 1, str(tmp_path), log=said.append, verbose=0)
    recorded = json.loads((tmp_path / "run.json").read_text())
    assert recorded == {
        "global_batch": 4,
        "steps_per_epoch": 2,
        "optimizer": "Adam",
        "learning_rate": 0.001,
    }
    eight = pipeline.from_arrays(features, labels, global_batch=8)
    with pytest.raises(CheckpointMismatchError, match="global_batch was 4 there and is 8"):
        fit_resumable(model(), eight, 2, str(tmp_path), log=said.append, verbose=0)


def _tiny_tf_run(rate=1e-3, loss="mse", steps_per_execution=1):
    """A two-weight tf-keras model compiled with Adam(``rate``), and 8 rows in batches of 4."""
    import tensorflow as tf

    from tpu_helpers.core import pipeline

    x = tf.keras.Input((4,), name="x")
    model = tf.keras.Model({"x": x}, tf.keras.layers.Dense(2)(x))
    model.compile(tf.keras.optimizers.Adam(rate), loss, steps_per_execution=steps_per_execution)
    features = {"x": np.arange(32.0).reshape(8, 4)}
    return model, pipeline.from_arrays(features, np.zeros((8, 2), np.float32), global_batch=4)


def test_a_run_resumed_with_another_learning_rate_is_refused_naming_both(tmp_path):
    from tpu_helpers.tf_engine.trainer import CheckpointMismatchError, fit_resumable

    model, four = _tiny_tf_run(1e-3)
    fit_resumable(model, four, 1, str(tmp_path), log=lambda _: None, verbose=0)
    model, four = _tiny_tf_run(5e-5)
    for run in (None, {"learning_rate": 0.001}):  # not the caller's to override
        with pytest.raises(
            CheckpointMismatchError, match=r"another learning rate \(was 0.001 there, is 5e-05"
        ):
            fit_resumable(model, four, 2, str(tmp_path), run=run, log=lambda _: None, verbose=0)
    # a rate a callback changed is the run's own: the same session goes on training
    import tensorflow as tf

    model, four = _tiny_tf_run(1e-3)
    halve = tf.keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate / 2)
    fit_resumable(model, four, 2, str(tmp_path / "b"), callbacks=[halve], verbose=0)
    assert len(fit_resumable(model, four, 3, str(tmp_path / "b"), verbose=0)["loss"]) == 3


def test_the_optimizer_record_names_a_schedules_change_and_sees_through_a_loss_scale():
    import tensorflow as tf

    from tpu_helpers.core.engine import check_same_run, optimizer_record
    from tpu_helpers.core.errors import CheckpointMismatchError

    def cosine(steps):
        schedule = tf.keras.optimizers.schedules.CosineDecay(1e-3, steps)
        return optimizer_record(tf.keras.optimizers.Adam(schedule))

    with pytest.raises(CheckpointMismatchError, match="decay_steps was 85 there, is 170 now.*Fix"):
        check_same_run("run", cosine(85), cosine(170))
    scaled = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(2e-5))
    assert optimizer_record(scaled) == {"optimizer": "Adam", "learning_rate": 2e-05}

    class Halving(tf.keras.optimizers.schedules.LearningRateSchedule):  # no get_config
        def __call__(self, step):
            return 1e-3 / (1.0 + tf.cast(step, tf.float32))

    assert optimizer_record(tf.keras.optimizers.Adam(Halving()))["learning_rate"] == "Halving"


def test_a_loss_that_is_no_longer_a_number_stops_the_run_before_it_saves(tmp_path):
    import tensorflow as tf

    from tpu_helpers.core.errors import TrainingDivergedError
    from tpu_helpers.tf_engine.trainer import fit_resumable

    said = []
    model, four = _tiny_tf_run()
    fit_resumable(model, four, 1, str(tmp_path), log=said.append, verbose=0)
    saved = sorted(p.name for p in tmp_path.iterdir())

    def poisoned(y, p):  # what a diverged step gives: a loss that is not a number
        return tf.reduce_mean(p) * float("nan")

    for every_steps in (1, None):  # a save due mid-epoch, then the epoch's end
        model, four = _tiny_tf_run(loss=poisoned)
        with pytest.raises(TrainingDivergedError, match="the loss is nan in epoch 2 .* Fix:"):
            fit_resumable(
                model, four, 2, str(tmp_path), every_steps=every_steps, log=said.append, verbose=0
            )
        assert sorted(p.name for p in tmp_path.iterdir()) == saved  # the last good save kept
    assert issubclass(TrainingDivergedError, ArithmeticError)


def test_an_epoch_whose_data_ends_before_its_steps_is_refused_before_its_save(tmp_path):
    import tensorflow as tf

    from tpu_helpers.core import pipeline
    from tpu_helpers.tf_engine.trainer import fit_resumable

    rows = tf.data.Dataset.from_tensor_slices(
        ({"x": np.ones((4, 4), np.float32)}, np.zeros((4, 2), np.float32), np.ones(4, np.float32))
    )
    three = pipeline.from_dataset_fn(
        lambda epoch, skip: rows.batch(4, drop_remainder=True), steps_per_epoch=3, global_batch=4
    )
    for calls in (1, 4):  # steps_per_execution: the data ends inside a call of four
        model, _ = _tiny_tf_run(steps_per_execution=calls)
        folder = tmp_path / str(calls)
        with pytest.raises(ValueError, match="gave 1 batch.* in epoch 1 of fit_resumable.*3 step"):
            fit_resumable(model, three, 1, str(folder), log=lambda _: None, verbose=0)
        assert not list(folder.glob("ckpt-1*"))  # the step-0 save alone: no epoch end saved


def test_the_resume_pieces_of_a_plain_fit_loop(tmp_path):
    """What notebook 01 writes around ``model.fit``: ``resume_point`` restores and says
    where to go on, ``callback`` saves (step 0, every N steps, each epoch's end) and keeps
    the history of every process."""
    import numpy as np
    import tensorflow as tf

    from tpu_helpers.core.pipeline import from_arrays
    from tpu_helpers.tf_engine.trainer import RunCheckpoints

    def named():  # takes the pipeline's feature dict
        x = tf.keras.Input((4,), name="x")
        model = tf.keras.Model({"x": x}, tf.keras.layers.Dense(2)(tf.keras.layers.Dense(3)(x)))
        model.compile(tf.keras.optimizers.Adam(), "mse")
        return model

    data = from_arrays({"x": np.ones((24, 4), np.float32)}, np.zeros(24, np.int64), global_batch=4)
    model = named()
    first = RunCheckpoints(str(tmp_path), model, model.optimizer, {"data": "ones"})
    assert first.resume_point(data.steps_per_epoch) == (0, 0)
    model.fit(
        data.dataset(0, skip_steps=0), epochs=1, steps_per_epoch=6, callbacks=[first.callback(4)]
    )
    assert [int(p.rsplit("-", 1)[1]) for p in first.manager.checkpoints] == [0, 4, 6]
    again = named()
    second = RunCheckpoints(str(tmp_path), again, again.optimizer, {"data": "ones"})
    assert second.resume_point(6) == (1, 0) and second.step == 6
    assert list(second.history()) == ["loss"] and len(second.history()["loss"]) == 1
    with pytest.raises(ValueError, match="every_minutes=-1"):
        second.callback(every_minutes=-1)


def test_labels_and_token_ids_the_model_has_no_row_for_are_refused_before_any_step(
    cola_with_row_5, tmp_path
):
    """The TF engine refuses what the Keras 3 engine refuses, with the same messages
    (tests/test_keras3.py), before any step and any save."""
    import tensorflow as tf
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.tf_engine import tf_classes
    from tpu_helpers.tf_engine.trainer import fit_resumable

    checkpoint, batches, cases = cola_with_row_5
    model = tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, str(checkpoint), num_labels=2
    )
    model.compile(
        tf.keras.optimizers.Adam(1e-3), tf.keras.losses.SparseCategoricalCrossentropy(True)
    )
    for i, (bad, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            fit_resumable(model, batches(**bad), 1, str(tmp_path / str(i)))
        assert not (tmp_path / str(i)).exists()


def test_a_folder_of_another_checkpoints_run_is_not_resumed_in_its_place(
    fixtures_dir, two_checkpoints, tmp_path
):
    """As on the Keras 3 engine (tests/test_keras3.py): the checkpoint's fingerprint is
    part of the run."""
    import tensorflow as tf
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.core import pipeline
    from tpu_helpers.tf_engine import tf_classes
    from tpu_helpers.tf_engine.trainer import CheckpointMismatchError, fit_resumable

    def model_of(checkpoint):
        model = tf_classes.from_pretrained(
            TFAutoModelForSequenceClassification, str(checkpoint), num_labels=2
        )
        model.compile(
            tf.keras.optimizers.Adam(1e-3), tf.keras.losses.SparseCategoricalCrossentropy(True)
        )
        return model

    def batches(epoch, skip):
        ids = tf.data.Dataset.from_tensors(
            ({"input_ids": tf.ones((4, 8), tf.int32)}, tf.zeros(4, tf.int32))
        )
        return ids.repeat(2).skip(skip)

    plan = pipeline.from_dataset_fn(batches, steps_per_epoch=2, global_batch=4)
    same, other = two_checkpoints
    fit_resumable(model_of(fixtures_dir / "tiny-distilbert"), plan, 1, str(tmp_path), verbose=0)
    assert len(fit_resumable(model_of(same), plan, 2, str(tmp_path), verbose=0)["loss"]) == 2
    with pytest.raises(CheckpointMismatchError, match=r"started from another checkpoint.*Fix"):
        fit_resumable(model_of(other), plan, 3, str(tmp_path), verbose=0)
