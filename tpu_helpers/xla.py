"""Tools for code that XLA (and so a TPU) can compile.

* ``masked_sparse_crossentropy``: a loss that ignores labels marked negative without
  boolean indexing, whose output shape would depend on the data;
* ``shape_report``: how many distinct input shapes a dataset produces (each one is a
  separate XLA compilation) and how much of it is padding;
* ``tracing_count``: how many times a ``tf.function`` (such as Keras' train function)
  was traced.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import tpu_helpers._env  # noqa: F401


def masked_sparse_crossentropy(labels, logits):
    """Mean cross-entropy over the positions whose label is >= 0 (e.g. -100 is ignored).

    Shapes never depend on the data: the mask multiplies the per-position loss, and the
    sum is divided by the mask's sum (at least 1, so an all-masked batch gives 0, not NaN).
    """
    import tensorflow as tf

    mask = tf.cast(labels >= 0, logits.dtype)
    safe_labels = tf.maximum(labels, 0)  # a valid class index; its loss is masked out anyway
    loss = tf.keras.losses.sparse_categorical_crossentropy(safe_labels, logits, from_logits=True)
    return tf.reduce_sum(loss * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)


@dataclass(frozen=True)
class ShapeReport:
    """Distinct input shapes among the first batches, and the padding share."""

    counts: dict
    batches: int
    padding_fraction: float | None

    @property
    def distinct(self) -> int:
        return len(self.counts)

    def __str__(self) -> str:
        pad = "" if self.padding_fraction is None else f", {self.padding_fraction:.1%} padding"
        lines = [f"{self.distinct} distinct input shape(s) in {self.batches} batches{pad}"]
        lines += [f"  {count:>5} x {shape}" for shape, count in self.counts.items()]
        return "\n".join(lines)


def _features(element):
    return element[0] if isinstance(element, tuple) else element


def shape_report(dataset, n: int = 50) -> ShapeReport:
    """Look at the first ``n`` elements of ``dataset`` (plain ``tf.data``) and count shapes.

    A shape is the tuple of every feature's shape; ``attention_mask`` (if present) gives
    the padding share.
    """
    counts: Counter = Counter()
    real = total = 0
    seen = 0
    for element in dataset.take(n):
        features = _features(element)
        items = sorted(features.items()) if isinstance(features, dict) else [("x", features)]
        counts[tuple((k, tuple(v.shape)) for k, v in items)] += 1
        if isinstance(features, dict) and "attention_mask" in features:
            mask = features["attention_mask"].numpy()
            real, total = real + int(mask.sum()), total + mask.size
        seen += 1
    shapes = {", ".join(f"{k}{list(s)}" for k, s in key): c for key, c in counts.most_common()}
    return ShapeReport(shapes, seen, (1 - real / total) if total else None)


def tracing_count(function) -> int:
    """Times a ``tf.function`` was traced.

    Accepts the function or a Keras model (its ``train_function`` after ``fit``). With
    fully static input shapes every new shape is a new trace, so this counts compilations.
    With ``None`` dimensions in the dataset's spec one trace serves every width, while XLA
    (``jit_compile=True``, or a TPU) still compiles once per concrete shape: count those
    with ``shape_report``.
    """
    fn = getattr(function, "train_function", function)
    if fn is None:
        raise ValueError("The model has no train_function yet: call fit first.")
    inner = getattr(fn, "experimental_get_tracing_count", None)
    if inner is None:  # Keras wraps the tf.function when steps_per_execution > 1
        inner = getattr(
            getattr(fn, "python_function", None), "experimental_get_tracing_count", None
        )
    if inner is None:
        raise TypeError(f"{fn!r} is not a tf.function.")
    return int(inner())
