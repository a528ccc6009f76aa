"""Classification metrics computed on the host from predictions (weights skip fillers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tpu_helpers.core.errors import InputError, InputTypeError
from tpu_helpers.core.validate import check_labels, check_positive, check_same_length

__all__ = [
    "matthews_correlation",
    "accuracy",
    "majority_rate",
    "logits_of",
    "count_examples",
    "examples_per_second",
]


def _scored(labels, predictions, weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, predictions and weights as arrays of one length, with some weight to score
    (weights of 0 mark filler rows), or ``ValueError`` naming what is off."""
    check_same_length(labels=labels, predictions=predictions, weights=weights)
    y = check_labels(labels, column="labels")
    p = check_labels(predictions, column="predictions")
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    if not w.sum() > 0:
        raise InputError(
            f"There is nothing to score: {len(y)} rows with a total weight of {w.sum()}. Fix:"
            " predict on at least one real (weight 1) example; check the split and its steps."
        )
    return y, p, w


def matthews_correlation(labels: Sequence[int], predictions: Sequence[int], weights=None) -> float:
    """Matthews correlation coefficient, CoLA's official metric; for more than two classes
    its multi-class form (Gorodkin's R_K, from the confusion matrix), which is the binary
    one when there are two.

    0 when a class is never predicted (or never present), as scikit-learn returns.

    >>> matthews_correlation([1, 1, 0, 0], [1, 1, 0, 0])
    1.0
    >>> matthews_correlation([1, 0, 1, 0], [1, 1, 1, 1])
    0.0
    """
    y, p, w = _scored(labels, predictions, weights)
    classes = int(max(y.max(initial=0), p.max(initial=0))) + 1
    confusion = np.zeros((classes, classes))
    np.add.at(confusion, (y, p), w)
    total, correct = confusion.sum(), np.trace(confusion)
    true, predicted = confusion.sum(axis=1), confusion.sum(axis=0)
    numerator = correct * total - predicted @ true
    denom = math.sqrt((total**2 - predicted @ predicted) * (total**2 - true @ true))
    return 0.0 if denom == 0 else float(numerator / denom)


def accuracy(labels, predictions, weights=None) -> float:
    """Share of (weighted) rows predicted right.

    >>> accuracy([1, 0, 1], [1, 1, 1], weights=[1, 1, 0])
    0.5
    """
    y, p, w = _scored(labels, predictions, weights)
    return float((w * (y == p)).sum() / w.sum())


def majority_rate(labels) -> float:
    """Accuracy of always predicting the most common class: the bar a model must clear."""
    counts = np.bincount(check_labels(labels, column="labels"))
    if counts.sum() == 0:
        raise InputError(
            "labels is empty: there is no majority class. Fix: pass the split's labels."
        )
    return float(counts.max() / counts.sum())


def logits_of(outputs):
    """The logits of a model's output (``.logits`` of a transformers output, else the
    tensor) in float32: a model under the ``mixed_bfloat16`` policy computes them in
    bfloat16, which has 8 bits of mantissa, too few for a softmax and a loss."""
    import tensorflow as tf

    logits = getattr(outputs, "logits", outputs)
    return tf.cast(logits, tf.float32) if logits.dtype != tf.float32 else logits


def count_examples(dataset) -> int:
    """Rows in a batched ``tf.data.Dataset``, counted inside the TensorFlow runtime (as
    ``fit`` consumes a dataset, so Python's cost per batch is not part of the count's
    time). Elements may be tensors, dicts, or tuples whose first item is either."""
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        raise InputTypeError(
            f"count_examples takes a tf.data.Dataset, not a {type(dataset).__name__}. Fix:"
            " tf.data.Dataset.from_tensor_slices(...).batch(...) first."
        )

    def rows(n, element):
        first = element[0] if isinstance(element, tuple) else element
        if isinstance(first, dict):
            first = next(iter(first.values()))
        return n + tf.shape(first, out_type=tf.int64)[0]

    return int(dataset.reduce(tf.constant(0, tf.int64), rows))


def examples_per_second(dataset, passes: int = 1) -> float:
    """The best rate over ``passes`` full passes of ``count_examples``."""
    import time

    check_positive(passes=passes)
    best = 0.0
    for _ in range(passes):
        start = time.perf_counter()
        count = count_examples(dataset)
        best = max(best, count / (time.perf_counter() - start))
    return best
