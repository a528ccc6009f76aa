import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.xla import masked_sparse_crossentropy, shape_report, tracing_count


def boolean_mask_loss(labels, logits):
    keep = labels >= 0
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(
            labels[keep], logits[keep], from_logits=True
        )
    )


@pytest.mark.parametrize("seed", range(5))
def test_masked_loss_equals_the_boolean_mask_version(seed):
    rng = np.random.default_rng(seed)
    logits = tf.constant(rng.normal(size=(4, 9, 5)), tf.float32)
    labels = rng.integers(0, 5, (4, 9))
    labels[rng.random((4, 9)) < 0.4] = -100
    labels = tf.constant(labels)
    expected = boolean_mask_loss(labels, logits)
    assert float(masked_sparse_crossentropy(labels, logits)) == pytest.approx(
        float(expected), rel=1e-5
    )
    compiled = tf.function(masked_sparse_crossentropy, jit_compile=True)
    assert float(compiled(labels, logits)) == pytest.approx(float(expected), rel=1e-5)


def test_masked_loss_of_an_all_masked_batch_is_zero_not_nan():
    logits = tf.zeros((2, 3, 4))
    assert float(masked_sparse_crossentropy(tf.fill((2, 3), -100), logits)) == 0.0


def test_shape_report_counts_shapes_and_padding():
    def batch(width, real):
        mask = np.zeros((2, width), np.int32)
        mask[:, :real] = 1
        return {"input_ids": mask * 7, "attention_mask": mask}

    elements = [batch(8, 8), batch(16, 8), batch(8, 4)]
    ds = tf.data.Dataset.from_generator(
        lambda: iter(elements),
        output_signature={
            k: tf.TensorSpec((2, None), tf.int32) for k in ("input_ids", "attention_mask")
        },
    )
    rep = shape_report(ds, n=10)
    assert rep.batches == 3 and rep.distinct == 2
    assert rep.counts["attention_mask[2, 8], input_ids[2, 8]"] == 2
    assert rep.padding_fraction == pytest.approx(1 - (16 + 16 + 8) / (16 + 32 + 16))
    assert "2 distinct input shape(s) in 3 batches" in str(rep)


def test_tracing_count_counts_retraces_per_shape():
    f = tf.function(lambda x: x * 2)
    for width in (8, 8, 16, 32, 16):
        f(tf.zeros((2, width)))
    assert tracing_count(f) == 3
    with pytest.raises(TypeError):
        tracing_count(lambda x: x)


def test_tracing_count_reads_a_keras_models_train_function():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Lambda(lambda x: tf.reduce_mean(x, 1, keepdims=True)),
            tf.keras.layers.Dense(2),
        ]
    )
    model.compile("adam", "mse")
    with pytest.raises(ValueError, match="call fit first"):
        tracing_count(model)
    y = np.zeros((8, 2), np.float32)
    model.fit(np.zeros((8, 3), np.float32), y, batch_size=4, epochs=2, verbose=0)
    first = tracing_count(model)
    model.fit(np.zeros((8, 3), np.float32), y, batch_size=4, epochs=2, verbose=0)
    assert tracing_count(model) == first >= 1  # same shapes: no new trace
    model.fit(np.zeros((8, 5), np.float32), y, batch_size=4, verbose=0)
    assert tracing_count(model) > first  # a new input width is traced again
