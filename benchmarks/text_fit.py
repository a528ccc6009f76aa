"""Training throughput of notebook 01's setup on CPU: the tutorial's against ours.

    python benchmarks/text_fit.py [--epochs 2] [--examples 8551]

Tiny DistilBERT fixture, CoLA-like fixture (8,551 training sentences), one device, batch 32.
Each configuration trains ``--epochs`` epochs; the figures are from the last epoch (the
first one pays for tracing and compilation, reported separately). Prints examples/s and
real (non-padding) tokens/s, and the ratios against the tutorial.

* tutorial: every sentence padded to 128 in memory, ``compile(optimizer="adam")``;
* buckets: widths chosen from the data (``text.padding_boundaries``), full batches,
  ``steps_per_execution=32``;
* buckets+xla: the same with ``jit_compile=True``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import tensorflow as tf  # noqa: E402  (after tpu_helpers)
from transformers import TFAutoModelForSequenceClassification  # noqa: E402

from tpu_helpers.data import hub, text
from tpu_helpers.teaching.fixtures import build_fixtures
from tpu_helpers.tf_engine import tf_classes

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32


class EpochTimer(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times = getattr(self, "times", []) + [time.perf_counter() - self.start]


def model_for(checkpoint):
    tf.keras.utils.set_random_seed(0)
    return tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, checkpoint, num_labels=2
    )


def run_tutorial(checkpoint, sentences, labels, epochs):
    tokenizer = hub.load_tokenizer(checkpoint)
    enc = dict(
        tokenizer(
            sentences, padding="max_length", truncation=True, max_length=128, return_tensors="np"
        )
    )
    ds = tf.data.Dataset.from_tensor_slices((enc, np.asarray(labels)))
    ds = ds.shuffle(len(labels)).batch(BATCH, drop_remainder=True)
    model = model_for(checkpoint)
    model.compile(optimizer="adam")
    timer = EpochTimer()
    model.fit(ds, epochs=epochs, callbacks=[timer], verbose=0)
    steps = len(labels) // BATCH
    real = int(enc["attention_mask"][: steps * BATCH].sum())  # about the tokens of one epoch
    return timer.times, steps * BATCH, real


def run_ours(checkpoint, split, epochs, jit):
    boundaries = text.padding_boundaries(split["length"], "buckets")
    batches = text.text_batches(split, global_batch=BATCH, boundaries=boundaries)
    ds = batches.dataset(0)  # every epoch on one iterator, each epoch in its own order
    for epoch in range(1, epochs):
        ds = ds.concatenate(batches.dataset(epoch))
    model = model_for(checkpoint)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(1e-3),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
        steps_per_execution=32,
        jit_compile=jit,
    )
    timer = EpochTimer()
    steps = batches.steps_per_epoch
    model.fit(ds, epochs=epochs, steps_per_epoch=steps, callbacks=[timer], verbose=0)
    real = int(np.minimum(split["length"], boundaries[-1]).sum())
    return timer.times, len(split["length"]), real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--examples", type=int, default=8551)
    args = parser.parse_args()
    paths = build_fixtures(ROOT / "build" / "fixtures-full", verbose=False, full_splits=True)
    data = text.load_text_dataset(paths["cola"])["train"].select(range(args.examples))
    tokenizer = hub.load_tokenizer(paths["tiny-distilbert"])
    split = text.tokenize(data, tokenizer, 128)
    split = {"input_ids": split["input_ids"], "length": split["length"], "label": split["label"]}

    rows = {}
    times, n, real = run_tutorial(
        paths["tiny-distilbert"], list(data["sentence"]), data["label"], args.epochs
    )
    rows["tutorial"] = (times, n, real)
    for name, jit in (("buckets", False), ("buckets+xla", True)):
        rows[name] = run_ours(paths["tiny-distilbert"], split, args.epochs, jit)

    base = rows["tutorial"]
    out = {}
    print(
        f"{'config':<12} {'first epoch s':>13} {'epoch s':>8} {'examples/s':>11} {'real tok/s':>11} {'x tutorial':>10}"
    )
    for name, (times, n, real) in rows.items():
        eps, tps = n / times[-1], real / times[-1]
        ratio = tps / (base[2] / base[0][-1])
        out[name] = {
            "first_epoch_s": times[0],
            "epoch_s": times[-1],
            "examples_per_s": eps,
            "real_tokens_per_s": tps,
            "ratio_real_tokens": ratio,
        }
        print(
            f"{name:<12} {times[0]:>13.1f} {times[-1]:>8.1f} {eps:>11.0f} {tps:>11.0f} {ratio:>9.1f}x"
        )
    target = ROOT / "build" / "benchmarks" / "text_fit.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=1))
    print(f"written {target}")


if __name__ == "__main__":
    main()
