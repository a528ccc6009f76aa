import re
import time

import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.core import pipeline
from tpu_helpers.tf_engine import observe


def _tiny_model(hidden=4, layers=0, lr=0.01):
    inputs = tf.keras.Input([8], name="x")
    x = inputs
    for _ in range(layers):
        x = tf.keras.layers.Dense(hidden, activation="relu")(x)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(x))
    model.compile(
        optimizer=tf.keras.optimizers.SGD(lr),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _xy(n=64, batch=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def _batches(n=64, batch=16):
    """``_xy``'s rows as a ``pipeline.Batches`` (in order): ``({"x"}, y, weights)``."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return pipeline.from_arrays({"x": x}, y, global_batch=batch, shuffle=False)


def test_fit_writes_loss_learning_rate_and_rates_per_epoch(tmp_path):
    schedule = tf.keras.optimizers.schedules.PolynomialDecay(0.1, 12, 0.01)
    model = _tiny_model(lr=schedule)
    log = observe.TrainingLog(
        str(tmp_path / "logs"), examples_per_epoch=64, real_tokens_per_epoch=512
    )
    history = model.fit(
        _xy(), validation_data=_xy(32), epochs=3, verbose=0, callbacks=[log.callback()]
    )
    train, valid = log.scalars("train"), log.scalars("validation")
    # each run in a folder of its own under the log folder (a curve of its own)
    assert log.run_dir.startswith(str(tmp_path / "logs") + "/")
    assert [s for s, _ in train["loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in train["loss"]], history.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(
        [v for _, v in valid["loss"]], history.history["val_loss"], rtol=1e-6
    )
    # the schedule at the step each epoch ended on: 4, 8, 12 steps
    np.testing.assert_allclose(
        [v for _, v in train["learning_rate"]], [float(schedule(s)) for s in (4, 8, 12)], rtol=1e-5
    )
    seconds = [v for _, v in train["epoch_seconds"]]
    np.testing.assert_allclose(
        [v for _, v in train["examples_per_second"]], [64 / s for s in seconds], rtol=1e-5
    )
    np.testing.assert_allclose(
        [v for _, v in train["real_tokens_per_second"]], [512 / s for s in seconds], rtol=1e-5
    )


def test_an_epoch_resumed_in_its_middle_counts_the_steps_it_ran(tmp_path, monkeypatch):
    model = _tiny_model()
    log = observe.TrainingLog(str(tmp_path), examples_per_epoch=64, run="resumed")
    clock = iter(range(0, 100, 3))  # each epoch lasts 3 "seconds"
    monkeypatch.setattr(observe.time, "perf_counter", lambda: next(clock))
    # epoch 2 of 4 steps each, resumed after its first step: 3 steps in 3 s
    model.optimizer.iterations.assign(5)
    model.fit(
        _xy().skip(1),
        initial_epoch=1,
        epochs=2,
        verbose=0,
        callbacks=[log.callback(steps_per_epoch=4)],
    )
    monkeypatch.undo()
    train = log.scalars()
    assert train["epoch_seconds"] == [(2, 4.0)]  # the whole epoch's estimate
    assert train["examples_per_second"] == [(2, 16.0)]  # 48 examples in 3 s


def test_a_ram_bucket_takes_the_logs_too():
    log = observe.TrainingLog("ram://observe-test/logs", run="first")
    log.write(0, {"loss": 0.5, "val_loss": 0.7}, seconds=2.0, learning_rate=0.1)
    assert observe.read_scalars("ram://observe-test/logs/first")["loss"] == [(1, 0.5)]
    [(step, value)] = log.scalars("validation")["loss"]
    assert step == 1 and value == pytest.approx(0.7)
    assert log.scalars()["learning_rate"] == [(1, pytest.approx(0.1))]


def test_outside_colab_and_kaggle_the_command_is_printed(capsys, monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert observe.show_tensorboard("/tmp/x") == "command"
    assert "tensorboard --logdir /tmp/x" in capsys.readouterr().out


def _slow(x, y):
    # a slow input step, as a heavy map (decoding, tokenizing) is
    def wait(t):
        time.sleep(0.02)
        return t

    return tf.py_function(wait, [x], tf.float32), y


def test_a_slow_map_is_found_input_bound():
    def slow_epoch(epoch, skip_steps):
        ds = _xy(n=4096, batch=8).skip(skip_steps).map(_slow)
        return ds.map(lambda x, y: ({"x": tf.ensure_shape(x, [8, 8])}, y, tf.ones([8])))

    batches = pipeline.from_dataset_fn(slow_epoch, steps_per_epoch=512, global_batch=8)
    report = observe.input_bound_check(_tiny_model(), batches, steps=15)
    assert report.verdict == "input-bound", str(report)
    assert report.input_per_second < 60 and report.step_per_second > 2 * report.input_per_second
    assert "records.write_records" in str(report) and "input-bound" in str(report)


def test_a_heavy_model_on_fast_input_is_found_compute_bound():
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    batches = pipeline.from_dataset_fn(
        lambda epoch, skip: tf.data.Dataset.from_tensors(
            ({"x": x}, np.zeros(256, "int32"), np.ones(256, "float32"))
        ),
        steps_per_epoch=1,
        global_batch=256,
    )
    model = _tiny_model(hidden=1024, layers=3)
    before = [w.copy() for w in model.get_weights()]
    report = observe.input_bound_check(model, batches, steps=10)
    assert report.verdict == "compute-bound", str(report)
    assert report.input_per_second > 3 * report.step_per_second
    # the check trained, and put every weight back
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_advice_follows_the_verdict():
    compute = pipeline.InputBoundReport(900.0, 300.0, 290.0, steps=20)
    balanced = pipeline.InputBoundReport(400.0, 300.0, 260.0, steps=20)
    waiting = pipeline.InputBoundReport(100.0, 300.0, 95.0, steps=20)
    assert [r.verdict for r in (compute, balanced, waiting)] == [
        "compute-bound",
        "balanced",
        "input-bound",
    ]
    assert "the input has headroom" in compute.advice and "feed it" not in compute.advice
    assert "only just keeps up" in balanced.advice and "feed it faster" in balanced.advice
    assert waiting.advice.startswith("feed it faster") and "step is what" not in waiting.advice


def test_a_run_time_is_told_in_the_unit_that_reads_best():
    report = pipeline.InputBoundReport(100.0, 10.0, 4.0, steps=20)
    assert report.time_for(200) == "50 s"
    assert report.time_for(4 * 60 * 30) == "30 min"
    assert report.time_for(4 * 3600 * 3) == "3.0 h"
    with pytest.raises(ValueError, match="steps"):
        report.time_for(0)


def test_the_check_leaves_an_unused_legacy_optimizer_as_it_was():
    """transformers' ``create_optimizer`` gives a legacy Keras optimizer, whose step counter
    and slots appear on first use: the check runs before training (notebook 06 times the
    run with it), and training must then start at step 0 with fresh slots."""
    from transformers import create_optimizer

    batches = pipeline.from_dataset_fn(
        lambda epoch, skip: _xy(n=256, batch=16).map(lambda x, y: ({"x": x}, y, tf.ones([16]))),
        steps_per_epoch=16,
        global_batch=16,
    )
    model = _tiny_model()
    optimizer, _ = create_optimizer(1e-3, 100, 10, weight_decay_rate=0.01)
    model.compile(optimizer=optimizer, loss=model.loss, steps_per_execution=4)
    before = [w.copy() for w in model.get_weights()]
    observe.input_bound_check(model, batches, steps=8)
    assert int(optimizer.iterations.numpy()) == 0
    assert all(
        not np.any(v.numpy()) for v in optimizer.variables() if v is not optimizer.iterations
    )
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_new_width_after_the_expected_ones_is_reported(tmp_path):
    widths = [8, 8, 16, 8, 16, 16, 24, 8]
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(widths)).map(
        lambda w: ({"input_ids": tf.zeros([4, w], tf.int32)}, tf.zeros([4], tf.int32))
    )
    watch = observe.CompileWatch(str(tmp_path), expected=2)
    out = [w for w in watch.watch(ds)]
    assert len(out) == len(widths)  # the batches pass unchanged
    assert [int(f["input_ids"].shape[1]) for f, _ in out] == widths
    events = watch.events()
    assert [(e["element"], e["expected"]) for e in events] == [(0, True), (2, True), (6, False)]
    lines = watch.report()
    assert "element 6" in lines[-1] and "input_ids=[4 24] labels=[4]" in lines[-1]
    assert "UNEXPECTED" in lines[-1] and '"' not in lines[-1]
    assert watch.report() == []  # reported once
    # the next epoch's dataset (fit_resumable makes one per epoch): its widths are known
    again = [w for w in watch.watch(ds.skip(3))]
    assert len(again) == len(widths) - 3
    assert len(watch.events()) == 3 and watch.report() == []
    wider = ds.map(lambda f, y: ({"input_ids": tf.pad(f["input_ids"], [[0, 0], [0, 8]])}, y))
    list(watch.watch(wider.take(1)))  # width 16: known; 32 next would be the fourth shape
    list(watch.watch(wider.skip(6)))
    assert [e["shapes_so_far"] for e in watch.events()] == [1, 2, 3, 4]
    assert "input_ids=[4 32]" in watch.report()[0]


def test_a_profile_of_a_few_steps_is_written(tmp_path):
    model = _tiny_model()
    step = observe.keras_step(model, _batches())
    files = observe.capture_profile(str(tmp_path), step, steps=3)
    assert any(f.endswith(".xplane.pb") for f in files), files
    assert all(tf.io.gfile.stat(f).length > 0 for f in files)


def test_the_profiled_step_is_the_train_function_fit_traced():
    model = _tiny_model()
    batches = _batches()
    model.fit(batches.dataset(), epochs=1, verbose=0)
    traced = model.train_function
    count = traced.experimental_get_tracing_count()
    step = observe.keras_step(model, batches)
    assert model.train_function is traced  # not a new function, traced again
    step()
    assert traced.experimental_get_tracing_count() == count  # same batches: no new trace


def test_the_check_needs_a_compiled_model_and_a_pipeline():
    model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Compile the model first"):
        observe.input_bound_check(model, _batches())
    compiled = _tiny_model()
    distributed = tf.distribute.get_strategy().experimental_distribute_dataset(_xy())
    # a Batches only: a dataset, distributed or not, has neither epochs nor steps
    for data in (distributed, _xy()):
        with pytest.raises(
            TypeError, match="input_bound_check takes a pipeline.Batches.*from_dataset_fn"
        ):
            observe.input_bound_check(compiled, data)
        with pytest.raises(TypeError, match="keras_step takes a pipeline.Batches.*from_dataset_fn"):
            observe.keras_step(compiled, data)
    with pytest.raises(TypeError, match="takes a pipeline.Batches, not list"):
        observe.input_bound_check(compiled, [1, 2])


def test_the_custom_loop_writes_the_same_scalars(tmp_path):
    from tpu_helpers.tf_engine.custom_loop import CustomLoop

    strategy = tf.distribute.get_strategy()
    model = _tiny_model()
    optimizer = tf.keras.optimizers.SGD(tf.keras.optimizers.schedules.PolynomialDecay(0.1, 8, 0.0))
    data = _xy().map(lambda x, y: (x, y, tf.ones([16])))
    batches = pipeline.from_dataset_fn(
        lambda e, s: data.skip(s), steps_per_epoch=4, global_batch=16
    )
    loop = CustomLoop(strategy, model, optimizer, 16)
    log = observe.TrainingLog(str(tmp_path), examples_per_epoch=64)
    history = loop.fit(batches, epochs=2, log=lambda m: None, training_log=log)
    train = log.scalars()
    np.testing.assert_allclose(
        [v for _, v in train["loss"]], [h["loss"] for h in history], rtol=1e-6
    )
    assert [round(v, 6) for _, v in train["learning_rate"]] == [0.05, 0.0]
    assert all(v > 0 for _, v in train["examples_per_second"])


def test_the_watch_sees_the_widths_read_records_chooses(tmp_path):
    from tpu_helpers.data import records

    rows = [{"input_ids": [1] * (2 + i % 30), "label": i % 2} for i in range(200)]
    records.write_records(rows, str(tmp_path / "records"), shard_records=20, progress=False)
    watch = observe.CompileWatch(str(tmp_path / "logs"), expected=2)
    batches = records.read_records(
        str(tmp_path / "records"),
        global_batch=8,
        boundaries=[16, 32],
        seed=0,
        transform=watch.watch,
    )
    assert len(list(batches.dataset())) == batches.steps_per_epoch
    widths = sorted(
        int(re.search(r"input_ids=\[8 (\d+)\]", e["shapes"])[1]) for e in watch.events()
    )
    assert widths == [16, 32]
    assert all(e["expected"] for e in watch.events())


def test_without_tensorboard_the_log_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install 'tensorboard~=2\\.2\\d\\.0'"):
        observe.TrainingLog(str(tmp_path))
