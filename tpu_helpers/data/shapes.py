"""How many distinct input shapes a stream of batches has, and how much of it is padding.

Under XLA (a TPU, ``jax.jit``, ``jit_compile=True``) every new input shape is a new
compilation, and every padded token is computed for nothing: ``shape_report`` counts both
over the first batches of a ``Batches``, a ``tf.data.Dataset`` or any iterable of batches.
``element_stats`` reads one batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tpu_helpers.core.errors import InputTypeError
from tpu_helpers.core.validate import check_positive

__all__ = ["ShapeReport", "element_stats", "shape_report"]


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


def element_stats(element) -> tuple[tuple, int, int]:
    """``(shape key, real tokens, tokens)`` of one batch (a features dict or a tuple whose
    first item is one); tokens from its attention mask, or the segment ids of packed rows
    (0, 0 without either)."""
    import numpy as np

    features = _features(element)
    items = sorted(features.items()) if isinstance(features, dict) else [("x", features)]
    key = tuple((k, tuple(v.shape)) for k, v in items)
    if isinstance(features, dict) and "attention_mask" in features:
        mask = np.asarray(features["attention_mask"])
        return key, int(mask.sum()), int(mask.size)
    if isinstance(features, dict) and "segment_ids" in features:  # packed rows
        segments = np.asarray(features["segment_ids"])
        return key, int((segments > 0).sum()), int(segments.size)
    return key, 0, 0


def shape_report(dataset, n: int = 50) -> ShapeReport:
    """Look at the first ``n`` batches of ``dataset`` (a ``pipeline.Batches``' first
    epoch, a plain ``tf.data.Dataset`` or any iterable of batches) and count shapes.

    A shape is the tuple of every feature's shape; ``attention_mask`` (if present), or
    the ``segment_ids`` of packed rows (0: padding), gives the padding share.
    """
    from itertools import islice

    from tpu_helpers.core.pipeline import Batches

    check_positive(n=n)
    if isinstance(dataset, Batches):
        dataset = dataset.dataset(0)
    if not hasattr(dataset, "take") and not hasattr(dataset, "__iter__"):
        raise InputTypeError(
            f"shape_report reads batches from a tf.data.Dataset or an iterable of batches, not"
            f" a {type(dataset).__name__}. Fix: pass the dataset the model trains on."
        )
    elements = dataset.take(n) if hasattr(dataset, "take") else islice(dataset, n)
    counts: Counter = Counter()
    real = total = seen = 0
    for element in elements:
        key, element_real, element_total = element_stats(element)
        counts[key] += 1
        real, total, seen = real + element_real, total + element_total, seen + 1
    shapes = {", ".join(f"{k}{list(s)}" for k, s in key): c for key, c in counts.most_common()}
    return ShapeReport(shapes, seen, (1 - real / total) if total else None)
