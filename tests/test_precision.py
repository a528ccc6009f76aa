"""Under the ``mixed_bfloat16`` policy (every TPU run's precision) the layers compute in
bfloat16, and every loss and metric the notebooks train and judge with is computed in
float32: a model's logits, Keras' compiled loss and metrics, the masked-LM loss, the packed
loss, the custom loop's losses and the preflight check."""

import numpy as np
import pytest
import tensorflow as tf
from transformers import TFAutoModelForSequenceClassification

from tpu_helpers.core import pipeline
from tpu_helpers.tf_engine import packed_classes, tf_classes, xla
from tpu_helpers.tf_engine.custom_loop import CustomLoop


@pytest.fixture
def bfloat16():
    tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    features = {
        "input_ids": tf.constant(rng.integers(5, 300, (4, 16)), tf.int32),
        "attention_mask": tf.ones((4, 16), tf.int32),
    }
    return features, tf.constant([0, 1, 1, 0]), tf.constant([1.0, 1.0, 1.0, 0.0])


def classifier(fixtures_dir):
    return tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, fixtures_dir / "tiny-distilbert", num_labels=2
    )


def test_a_loaded_model_computes_in_bfloat16_and_returns_float32_logits(
    bfloat16, fixtures_dir, batch
):
    model = classifier(fixtures_dir)
    assert model.compute_dtype == "bfloat16" and model.trainable_weights[0].dtype == tf.float32
    assert model(batch[0]).logits.dtype == tf.float32


def test_keras_loss_and_metrics_are_float32_under_bfloat16(bfloat16, fixtures_dir, batch):
    model = classifier(fixtures_dir)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(1e-3),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    features, labels, weights = batch
    logits = model(features).logits
    loss = model.compiled_loss(labels, logits, weights)
    assert loss.dtype == tf.float32
    reference = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        labels, tf.cast(logits, tf.float32), weights
    )
    assert float(loss) == pytest.approx(float(reference), rel=1e-6)
    history = model.fit(tf.data.Dataset.from_tensors(batch), epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0]) and 0 <= history["accuracy"][0] <= 1


def test_the_masked_lm_loss_is_float32_and_counts_every_position(bfloat16):
    rng = np.random.default_rng(1)
    labels = np.where(rng.random((8, 128)) < 0.5, rng.integers(0, 50, (8, 128)), -100)
    logits = tf.constant(rng.normal(size=(8, 128, 50)), tf.float32)
    exact = xla.masked_sparse_crossentropy(tf.constant(labels), logits)
    loss = xla.masked_sparse_crossentropy(tf.constant(labels), tf.cast(logits, tf.bfloat16))
    assert loss.dtype == tf.float32
    assert (labels >= 0).sum() > 256  # beyond the integers bfloat16 counts exactly
    # within the rounding of the bfloat16 logits, not of a bfloat16 sum over 500 positions
    assert float(loss) == pytest.approx(float(exact), rel=2e-3)


def test_the_packed_loss_is_float32(bfloat16):
    logits = tf.constant([[[2.0, -1.0], [0.5, 0.25]]], tf.bfloat16)
    loss = packed_classes.packed_loss(tf.constant([[0, 1]]), logits, tf.constant([[1.0, 0.0]]))
    assert loss.dtype == tf.float32
    expected = float(np.log1p(np.exp(-3.0)))  # the first slot's cross-entropy alone
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_the_custom_loop_trains_and_reports_in_float32(bfloat16, fixtures_dir, batch):
    """Also with a model whose logits are bfloat16 (one not loaded through hub: from the
    tf_model.h5 of the engines' DistilBERT, read by transformers itself)."""
    strategy = tf.distribute.get_strategy()
    model = TFAutoModelForSequenceClassification.from_pretrained(
        fixtures_dir / "engines" / "distilbert", use_safetensors=False
    )
    assert model(batch[0]).logits.dtype == tf.bfloat16
    loop = CustomLoop(strategy, model, tf.keras.optimizers.Adam(1e-3), 4, None, steps_per_call=1)
    batches = pipeline.from_dataset_fn(
        lambda epoch, skip: tf.data.Dataset.from_tensors(batch).repeat(2 - skip),
        steps_per_epoch=2,
        global_batch=4,
    )
    history = loop.fit(batches, epochs=1, log=lambda line: None)
    assert loop.train_loss.result().dtype == tf.float32
    assert np.isfinite(history[-1]["loss"])


def test_preflight_judges_a_bfloat16_loss(bfloat16, fixtures_dir, batch):
    model = classifier(fixtures_dir)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(1e-3),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    report = xla.preflight(model, tf.data.Dataset.from_tensors(batch).repeat(2), batches=2)
    assert report.ok, report
