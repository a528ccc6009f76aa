"""CustomLoop: checkpoints on a bucket-like path, restores refused or fallen back from,
batches of the wrong size, corrupt records. Killed and resumed runs are in
``test_tf_trainer`` (the custom-loop kill chain: bit-for-bit weights and learning rates)."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_helpers
from tpu_helpers.data import text
from tpu_helpers.tf_engine.custom_loop import CustomLoop
from tpu_helpers.tf_engine.trainer import CheckpointMismatchError


class Tiny(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = tf.keras.layers.Embedding(
            50, 8, embeddings_initializer=tf.keras.initializers.RandomNormal(seed=1)
        )
        self.out = tf.keras.layers.Dense(
            2, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2)
        )

    def call(self, features, training=False):
        mask = tf.cast(features["attention_mask"], tf.float32)[..., None]
        pooled = tf.reduce_sum(self.embed(features["input_ids"]) * mask, 1) / tf.reduce_sum(mask, 1)
        return self.out(pooled)


class Renamed(tf.keras.Model):
    """``Tiny`` with its layers under other names: a checkpoint of ``Tiny`` matches none."""

    def __init__(self):
        super().__init__()
        self.embedding = tf.keras.layers.Embedding(50, 8)
        self.head = tf.keras.layers.Dense(2)

    def call(self, features, training=False):
        mask = tf.cast(features["attention_mask"], tf.float32)[..., None]
        total = tf.reduce_sum(self.embedding(features["input_ids"]) * mask, 1)
        return self.head(total / tf.reduce_sum(mask, 1))


def train(checkpoint_dir, epochs=3, model_class=Tiny, max_steps=None):
    """A small ``CustomLoop`` run (4 steps a call, a checkpoint every 5 steps) on 300
    bucketed examples; returns ``(loop, steps per epoch, the lines it logged)``, and the
    history as the loop's ``history``."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 30, 300)
    ids = [rng.integers(1, 50, n).tolist() for n in lengths]
    split = {"input_ids": ids, "length": lengths.tolist(), "label": [int(x[0] > 25) for x in ids]}
    strategy = tpu_helpers.connect(verbose=False)
    boundaries = text.choose_boundaries(lengths, 3)
    batches = text.text_batches(split, global_batch=16, boundaries=boundaries, seed=0)
    steps = batches.steps_on(strategy)

    with strategy.scope():
        model, optimizer = model_class(), tf.keras.optimizers.Adam(0.01)
    loop = CustomLoop(strategy, model, optimizer, 16, str(checkpoint_dir), steps_per_call=4)
    said = []
    loop.history = loop.fit(
        batches, epochs=epochs, checkpoint_every=5, log=said.append, max_steps=max_steps
    )
    return loop, steps, said


def test_max_steps_stops_mid_epoch_at_a_checkpoint_and_the_next_fit_goes_on(tmp_path):
    """A run stopped at ``max_steps`` halfway through an epoch (not a checkpoint step of
    its own) saves there; a new model and loop go on from it to the weights of a run
    that never stopped."""
    whole, steps, _ = train(tmp_path / "whole", epochs=2)
    stop = steps + steps // 2 + 1
    assert stop % 5 and stop % steps  # neither a checkpoint step nor an epoch's end
    stopped, _, said = train(tmp_path / "stopped", epochs=2, max_steps=stop)
    assert stopped.step == stop and [row["epoch"] for row in stopped.history] == [1]
    assert f"stopped at step {stop} (max_steps={stop}), in epoch 2" in said
    resumed, _, said = train(tmp_path / "stopped", epochs=2)
    assert resumed.step == 2 * steps and [row["epoch"] for row in resumed.history] == [2]
    for ours, theirs in zip(resumed.model.variables, whole.model.variables, strict=True):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    again, _, said = train(tmp_path / "stopped", epochs=2, max_steps=steps)  # already past it
    assert again.history == [] and again.step == 2 * steps
    at_an_epoch_end, _, said = train(tmp_path / "at-the-end", epochs=2, max_steps=steps)
    assert at_an_epoch_end.step == steps and [r["epoch"] for r in at_an_epoch_end.history] == [1]
    assert said[-1] == f"stopped at step {steps} (max_steps={steps})"


def test_checkpoints_on_a_bucket_like_filesystem():
    # ram:// behaves like gs:// for tf.io.gfile: the loop must not touch os paths.
    loop, steps, _ = train("ram://bucket/custom-loop-run", epochs=1)
    assert loop.step == steps > 0
    files = sorted(tf.io.gfile.listdir("ram://bucket/custom-loop-run"))
    assert files[0] == "checkpoint" and any(f.endswith(".index") for f in files), files


def test_a_checkpoint_that_does_not_match_the_model_is_refused(tmp_path):
    train(tmp_path / "ckpt", epochs=1)
    with pytest.raises(CheckpointMismatchError, match="does not hold every variable.*Fix:"):
        train(tmp_path / "ckpt", model_class=Renamed)


def test_a_corrupt_checkpoint_is_named_and_the_one_before_restored(tmp_path):
    train(tmp_path / "ckpt", epochs=1)
    indexes = sorted((tmp_path / "ckpt").glob("*.index"), key=lambda p: int(p.stem.split("-")[1]))
    assert len(indexes) >= 2
    indexes[-1].write_bytes(b"not a checkpoint index")
    loop, steps, said = train(tmp_path / "ckpt")
    latest, before = (str(p)[: -len(".index")] for p in indexes[-1:-3:-1])
    assert f"checkpoint {latest} cannot be read; trying the one before it" in said
    assert any(line.startswith(f"restored {before} at step") for line in said), said
    assert loop.step == 3 * steps  # and the run went on to its end
    for index in (tmp_path / "ckpt").glob("*.index"):  # the resumed run's too
        index.write_bytes(b"not a checkpoint index")
    with pytest.raises(CheckpointMismatchError, match=f"No checkpoint in {tmp_path / 'ckpt'} can"):
        train(tmp_path / "ckpt")


def test_a_batch_of_the_wrong_size_is_refused():
    from tpu_helpers.core import pipeline

    strategy = tf.distribute.get_strategy()
    model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    loop = CustomLoop(strategy, model, tf.keras.optimizers.Adam(), global_batch=16)
    per_replica = tf.data.Dataset.from_tensor_slices(
        (np.ones((64, 3), np.float32), np.zeros(64, np.int32), np.ones(64, np.float32))
    ).batch(8, drop_remainder=True)
    # batches that say they are of 8 rows: refused before any step
    eight = pipeline.from_dataset_fn(lambda e, s: per_replica, steps_per_epoch=2, global_batch=8)
    with pytest.raises(ValueError, match="8 rows per step.*global_batch=16"):
        loop.fit(eight, epochs=1, log=lambda m: None)
    # batches that say 16 rows and give each replica 8: refused at the first step
    lying = pipeline.Batches(lambda e, s, c: per_replica, 2, 16, reads_per_host=True)
    with pytest.raises(ValueError, match="batch of 8 rows .*global_batch=16"):
        loop.fit(lying, epochs=1, log=lambda m: None)
    assert loop.step == 0


def test_a_corrupt_record_file_met_in_training_says_how_to_find_it(tmp_path):
    from tpu_helpers.data import records

    rows = [{"x": [float(i)] * 4, "label": i % 2} for i in range(200)]
    meta = records.write_records(rows, str(tmp_path), shard_records=50, progress=False)
    shard = tmp_path / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, broken CRC
    shard.write_bytes(bytes(data))

    inputs = tf.keras.Input((4,), name="x")
    model = tf.keras.Model({"x": inputs}, tf.keras.layers.Dense(2)(inputs))
    loop = CustomLoop(tf.distribute.get_strategy(), model, tf.keras.optimizers.Adam(), 10)
    batches = records.read_records(str(tmp_path), global_batch=10, shuffle=False)
    assert batches.steps_per_epoch == 20
    # the plan knows its shards: the message names the corrupt one (it said "use
    # verify_records to find it" when the loop had a bare dataset)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=f"{meta['shards'][1]['file']} ends after 25 of the 50 .*corrupt.*on_corrupt=skip",
    ):
        loop.fit(batches, epochs=1, log=lambda m: None)
    assert np.isfinite(model.get_weights()[0]).all()


def test_your_own_train_steps_and_metrics_are_what_the_loop_drives(tmp_path):
    """``train_steps=`` (notebook 02 writes one with strategy.run) is called in calls that
    end at checkpoint steps, and ``metrics=`` are reset each epoch and reported by name."""
    from tpu_helpers.core.pipeline import from_arrays

    strategy = tpu_helpers.connect(verbose=False)
    ids = np.ones((40, 6), np.int32)
    batches = from_arrays(
        {"input_ids": ids, "attention_mask": ids}, np.zeros(40, np.int32), global_batch=8
    )
    with strategy.scope():
        model, optimizer = Tiny(), tf.keras.optimizers.SGD(0.1)
        seen = tf.keras.metrics.Sum()
    calls = []

    @tf.function
    def train_steps(iterator, steps):
        for _ in tf.range(steps):
            features, labels, weights = next(iterator)

            def step(features, labels, weights):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(model(features, training=True) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                seen.update_state(tf.reduce_sum(weights))

            strategy.run(step, args=(features, labels, weights))

    def counted(iterator, steps):
        calls.append(int(steps))
        return train_steps(iterator, steps)

    loop = CustomLoop(
        strategy,
        model,
        optimizer,
        8,
        str(tmp_path),
        steps_per_call=4,
        train_steps=counted,
        metrics={"rows": seen},
    )
    history = loop.fit(batches, 2, checkpoint_every=3, log=lambda line: None)
    assert calls == [3, 2, 1, 3, 1]  # 5 steps an epoch, calls ending at steps 3, 6, 9
    assert [row["rows"] for row in history] == [40.0, 40.0]  # reset each epoch
    assert loop.step == 10 and set(history[0]) == {"epoch", "step", "rows"}


def _arrays(**features):
    """A ``Batches`` of 64 rows of ``features`` (label 0, weight 1), 16 rows a step."""
    from tpu_helpers.core import pipeline

    rows = len(next(iter(features.values())))
    data = tf.data.Dataset.from_tensor_slices(
        (features, np.zeros(rows, np.int32), np.ones(rows, np.float32))
    ).batch(16, drop_remainder=True)
    return pipeline.from_dataset_fn(lambda e, s: data, steps_per_epoch=4, global_batch=16)


def test_features_the_model_cannot_take_are_refused_with_their_shapes(fixtures_dir, tmp_path):
    """Before any step and any save: a 1-D or 3-D input_ids (from inside the model:
    TensorFlow's rank errors), per-token columns of two widths, features named for no
    input of the model; checked against transformers' input_signature."""
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.tf_engine import tf_classes

    model = tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, str(fixtures_dir / "tiny-distilbert"), num_labels=2
    )
    loop = CustomLoop(
        tf.distribute.get_strategy(), model, tf.keras.optimizers.Adam(), 16, str(tmp_path / "r")
    )
    ones = np.ones((64, 8), np.int32)
    cases = [
        (dict(input_ids=ones[:, 0], attention_mask=ones[:, 0]), r"input_ids of shape \(16\)"),
        (dict(input_ids=ones[..., None], attention_mask=ones), r"input_ids of shape \(16, 8, 1\)"),
        (dict(input_ids=ones, attention_mask=ones[:, :6]), r"different widths.*\(16, 6\)"),
        (dict(ids=ones, mask=ones), r"none of the model's inputs.*input_ids \(None, None\)"),
    ]
    for features, match in cases:
        with pytest.raises(ValueError, match=match) as raised:
            loop.fit(_arrays(**features), epochs=1, log=lambda m: None)
        assert "Fix:" in str(raised.value)
        assert loop.step == 0 and not (tmp_path / "r").exists()
    # the shapes it takes train; a column the signature does not name is not judged here
    loop.fit(_arrays(input_ids=ones, attention_mask=ones), epochs=1, log=lambda m: None)
    assert loop.step == 4


def test_images_with_channels_last_are_refused_by_both_loops(fixtures_dir, tmp_path):
    """transformers' TF ViT takes rows x channels x height x width: images with their
    channels last are refused by the custom loop and by fit_resumable, naming both shapes;
    a size its signature fixes is not held (many image models take any size)."""
    from transformers import TFAutoModelForImageClassification

    from tpu_helpers.tf_engine import tf_classes
    from tpu_helpers.tf_engine.trainer import fit_resumable

    model = tf_classes.from_pretrained(
        TFAutoModelForImageClassification, str(fixtures_dir / "tiny-vit")
    )  # its 10 classes
    model.compile(tf.keras.optimizers.Adam(), tf.keras.losses.SparseCategoricalCrossentropy(True))
    last = _arrays(pixel_values=np.zeros((64, 32, 32, 3), np.float32))
    match = r"pixel_values of shape \(16, 32, 32, 3\).*pixel_values \(None, 3, 32, 32\)"
    loop = CustomLoop(tf.distribute.get_strategy(), model, tf.keras.optimizers.Adam(), 16)
    with pytest.raises(ValueError, match=match):
        loop.fit(last, epochs=1, log=lambda m: None)
    with pytest.raises(ValueError, match=match):
        fit_resumable(model, last, 1, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    first = _arrays(pixel_values=np.zeros((64, 3, 32, 32), np.float32))
    history = fit_resumable(model, first, 1, str(tmp_path / "ok"), verbose=0)
    assert len(history["loss"]) == 1 and (tmp_path / "ok" / "history.json").exists()
