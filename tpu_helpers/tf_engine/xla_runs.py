"""What padding costs under XLA: one pass of training with every step compiled, counting
the compilations (one per distinct input shape, as on a TPU) and the real tokens per second.
Notebook 05's padding comparison and ``benchmarks/xla_padding.py`` are built on it.

* ``train_counting_compiles``: the pass, returned as an ``XlaRun``;
* ``XlaRun``: its steps, compilations and their seconds, shapes and padding share, and a
  table row (``row()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_helpers.core.metrics import logits_of
from tpu_helpers.data.shapes import element_stats
from tpu_helpers.tf_engine.xla import require_running_target

__all__ = [
    "XlaRun",
    "runs_table",
    "train_counting_compiles",
]


@dataclass(frozen=True)
class XlaRun:
    """One pass of XLA-compiled training over a dataset: compilations and throughput."""

    name: str
    steps: int
    seconds: float
    compiles: int
    compile_seconds: float
    shapes: int
    real_tokens: int
    tokens: int
    steady_real_tokens: int = 0  # real tokens of the steps that did not compile

    @property
    def real_tokens_per_second(self) -> float:
        """Over the whole pass, compilation included (what one epoch costs)."""
        return self.real_tokens / self.seconds

    @property
    def steady_real_tokens_per_second(self) -> float:
        """Over the steps that reused a compiled program (what a long run tends to)."""
        run = self.seconds - self.compile_seconds
        return self.steady_real_tokens / run if run > 0 else 0.0

    @property
    def padding_fraction(self) -> float:
        return 1 - self.real_tokens / self.tokens if self.tokens else 0.0

    COLUMNS = (
        "padding",
        "steps",
        "distinct shapes",
        "compilations",
        "padding share",
        "compile s",
        "total s",
        "real tokens/s",
        "real tokens/s without compiling",
    )

    def row(self) -> dict:
        """One line of ``runs_table``, under ``COLUMNS``."""
        values = (
            self.name,
            self.steps,
            self.shapes,
            self.compiles,
            round(self.padding_fraction, 3),
            round(self.compile_seconds, 1),
            round(self.seconds, 1),
            round(self.real_tokens_per_second),
            round(self.steady_real_tokens_per_second),
        )
        return dict(zip(self.COLUMNS, values, strict=True))


def runs_table(runs: dict):
    """The runs as a ``pandas.DataFrame``, one row per run indexed by its padding; with no
    runs (nothing here runs compiled steps), the same columns and no rows."""
    import pandas as pd

    rows = [run.row() for run in runs.values()]
    return pd.DataFrame(rows, columns=list(XlaRun.COLUMNS)).set_index("padding")


def train_counting_compiles(model, dataset, optimizer, loss=None, name: str = "") -> XlaRun:
    """Train ``model`` for one pass over ``dataset`` with every step compiled by XLA
    (``jit_compile=True``), one compilation per distinct input shape, as on a TPU.

    Elements are ``(features, labels[, weights])``. Counts the compilations (a step whose
    input shape is new is traced and compiled; ``tracing_count`` tells which), the time
    they took, and the real (``attention_mask``) tokens per second over the whole pass,
    compilation included. Run it on one device (see the field notes on XLA under a
    multi-device CPU strategy).
    """
    import tensorflow as tf

    from tpu_helpers.core.pipeline import as_dataset

    dataset = as_dataset(dataset)
    target = require_running_target()
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y, w):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            value = loss(y, logits_of(out), sample_weight=w)
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return value

    # Create the optimizer's slots now: variables created inside the first call would make
    # tf.function trace twice and compile the second trace silently at the second step.
    if hasattr(optimizer, "build"):
        optimizer.build(model.trainable_variables)
    step = tf.function(train_step, jit_compile=True, reduce_retracing=False)
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # a retrace per new shape is the point here, not a mistake
    try:
        with tf.device(target.device):
            return _count(step, dataset, name)
    finally:
        logger.setLevel(level)


def _count(step, dataset, name):
    import time

    import tensorflow as tf

    steps = compiles = real = total = steady = 0
    compile_seconds = 0.0
    shapes = set()
    start = last = time.perf_counter()
    for element in dataset:
        x, y = element[0], element[1]
        w = element[2] if len(element) > 2 else tf.ones_like(y, tf.float32)
        before = step.experimental_get_tracing_count()
        began = time.perf_counter()
        step(x, y, w).numpy()
        compiled = step.experimental_get_tracing_count() > before
        if compiled:
            compiles += 1
            compile_seconds += time.perf_counter() - began
        steps += 1
        key, count, size = element_stats(element)
        shapes.add(key)
        real, total = real + count, total + size
        steady += 0 if compiled else count
        last = time.perf_counter()
    # the clock stops at the last step: tearing the iterator down afterwards (seconds, at
    # times) is not training
    seconds = last - start
    return XlaRun(name, steps, seconds, compiles, compile_seconds, len(shapes), real, total, steady)
