import math

import numpy as np
import pytest

from tpu_helpers.core.metrics import accuracy, majority_rate, matthews_correlation


def test_mcc_matches_the_formula():
    y = [1, 1, 1, 1, 0, 0, 0, 1, 0, 1]
    p = [1, 0, 1, 1, 0, 1, 0, 1, 0, 1]
    tp, tn, fp, fn = 5, 3, 1, 1
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert matthews_correlation(y, p) == pytest.approx(expected)
    assert matthews_correlation(y, [1 - x for x in y]) == pytest.approx(-1.0)


def test_weights_remove_rows():
    y, p = [1, 0, 1], [1, 0, 0]
    assert accuracy(y, p, [1, 1, 0]) == 1.0
    assert matthews_correlation(y, p, [1, 1, 0]) == 1.0
    assert accuracy(y, p) == pytest.approx(2 / 3)


def test_majority_rate():
    assert majority_rate([1, 1, 1, 0]) == 0.75


def test_predict_classes_scores_every_example_once_in_dataset_order():
    import numpy as np
    import tensorflow as tf

    from tpu_helpers.data import text
    from tpu_helpers.tf_engine.trainer import predict_classes

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 20, 45)
    ids = [rng.integers(1, 30, n).tolist() for n in lengths]
    split = {"input_ids": ids, "length": lengths.tolist(), "label": [int(x[0] > 15) for x in ids]}
    strategy = tf.distribute.get_strategy()
    batches = text.text_batches(split, global_batch=8, boundaries=[8, 24], shuffle=False)
    steps = batches.steps_on(strategy)
    assert steps == batches.steps_per_epoch

    # Predicts class 1 exactly when the first token is > 15: its predictions equal the labels.
    def model(features, training=False):
        first = tf.cast(features["input_ids"][:, :1] > 15, tf.float32)
        return tf.concat([1 - first, first], axis=1)

    labels, preds, weights = predict_classes(model, batches, strategy)
    assert len(labels) == steps * 8 and weights.sum() == 45
    assert (labels == preds).all()
    assert sorted(labels[weights == 1].tolist()) == sorted(split["label"])


def test_predict_classes_distributes_a_hand_made_pipeline_across_replicas():
    from tests.conftest import run_python

    result = run_python(
        """
        import numpy as np, tensorflow as tf
        import tpu_helpers
        from tpu_helpers.core import pipeline
        from tpu_helpers.tf_engine.trainer import predict_classes
        strategy = tpu_helpers.connect(simulated_replicas=2)
        x = np.arange(24, dtype=np.float32).reshape(24, 1)
        ds = tf.data.Dataset.from_tensor_slices(({"x": x}, (x[:, 0] > 11).astype(np.int32),
                                                 np.ones(24, np.float32))).batch(8)
        model = lambda f, training=False: tf.concat([11.5 - f["x"], f["x"] - 11.5], axis=1)
        try:  # a plain dataset has no steps nor epochs: refused, naming the wrapper
            predict_classes(model, ds, strategy)
        except TypeError as err:
            assert "pipeline.from_dataset_fn" in str(err), err
        else:
            raise AssertionError("a plain dataset was taken")
        batches = pipeline.from_dataset_fn(
            lambda epoch, skip: ds.skip(skip), steps_per_epoch=3, global_batch=8
        )
        labels, preds, weights = predict_classes(model, batches, strategy)
        print("result", len(labels), len(preds), int((labels == preds).sum()))
        print("order", sorted(labels.tolist()) == sorted((x[:, 0] > 11).astype(int).tolist()))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "result 24 24 24" in result.stdout
    assert "order True" in result.stdout


def test_count_examples_in_the_runtime():
    import numpy as np
    import tensorflow as tf

    from tpu_helpers.core.metrics import count_examples, examples_per_second

    x = np.arange(42, dtype=np.float32)
    plain = tf.data.Dataset.from_tensor_slices(x).batch(8)
    nested = tf.data.Dataset.from_tensor_slices(({"ids": x}, x, x)).batch(8, drop_remainder=True)
    assert count_examples(plain) == 42 and count_examples(nested) == 40
    assert examples_per_second(nested, passes=2) > 0


def test_matthews_correlation_of_several_classes_is_the_correlation_of_one_hot_labels():
    rng = np.random.default_rng(0)
    for classes in (2, 3, 5):
        y = rng.integers(0, classes, size=200)
        p = np.where(rng.random(200) < 0.6, y, rng.integers(0, classes, size=200))
        w = rng.random(200)
        # the definition: covariance of the one-hot matrices over their standard deviations
        onehot_y, onehot_p = np.eye(classes)[y], np.eye(classes)[p]

        def cov(a, b, w=w):
            a = a - np.average(a, axis=0, weights=w)
            b = b - np.average(b, axis=0, weights=w)
            return float(np.sum(w[:, None] * a * b))

        expected = cov(onehot_y, onehot_p) / np.sqrt(
            cov(onehot_y, onehot_y) * cov(onehot_p, onehot_p)
        )
        assert abs(matthews_correlation(y, p, w) - expected) < 1e-12
    assert matthews_correlation([0, 1, 2], [0, 1, 2]) == 1.0


def test_predict_classes_on_data_that_ends_before_its_steps_names_both_counts():
    """An empty data set (or steps declared beyond the data): refused naming the batches
    given and the steps promised, not a bare StopIteration (the Keras 3 engine's is in
    tests/test_keras3.py)."""
    import numpy as np
    import pytest
    import tensorflow as tf

    from tpu_helpers.core import pipeline
    from tpu_helpers.tf_engine.trainer import predict_classes

    def model(features, training=False):
        return tf.one_hot(features["input_ids"][:, 0] % 2, 2)

    rows = {"input_ids": np.ones((8, 4), np.int32)}
    data = tf.data.Dataset.from_tensor_slices((rows, np.zeros(8, np.int32), np.ones(8)))
    strategy = tf.distribute.get_strategy()
    for batches_given, dataset in [(0, data.take(0)), (1, data)]:
        batches = pipeline.from_dataset_fn(
            lambda e, s, d=dataset: d.batch(8, drop_remainder=True),
            steps_per_epoch=3,
            global_batch=8,
        )
        with pytest.raises(ValueError, match=f"gave {batches_given} batch.*3 step.*Fix:"):
            predict_classes(model, batches, strategy)
