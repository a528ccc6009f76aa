"""What padding costs when every step is compiled by XLA (as on a TPU), measured on CPU.

    python benchmarks/xla_padding.py [--examples 8551]

Tiny DistilBERT fixture, CoLA-like fixture, batch 32, one device, ``jit_compile=True``,
one epoch each (compilation included, as a TPU pays it), side by side in one run:

* (a) longest: random batches padded to their longest row (``prepare_tf_dataset``);
* (b) fixed 128: the tutorial's ``padding="max_length"``;
* (c) multiple of 32: sorted into widths 32, 64, 96, 128;
* (d) buckets: at most 4 widths chosen from the length histogram (``text.choose_boundaries``).

Prints distinct shapes, XLA compilations, padding share, seconds in steps, real
(non-padding) tokens/s over the epoch's steps (compilation included) and over the steps
that did not compile, with their ratios against (b). The pipeline (a), the training pass
and the table row are notebook tf/05's own functions, run from its page.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tpu_helpers.data import hub, text  # noqa: E402
from tpu_helpers.tf_engine import tf_classes  # noqa: E402  (sets the Keras flag before TF loads)

BATCH = 32
PAGE = "tf/05_xla_rules.ipynb"  # the functions are the notebook's own, run from its page


def configurations(split, longest_in_batch, max_length=128):
    lengths = split["length"]

    def buckets(boundaries):
        return text.text_batches(split, global_batch=BATCH, boundaries=boundaries).dataset(0)

    return {
        "(a) longest in batch": lambda: longest_in_batch(split),
        "(b) fixed 128": lambda: buckets([max_length]),
        "(c) multiple of 32": lambda: buckets(
            text.padding_boundaries(lengths, "multiple", max_length)
        ),
        "(d) data-chosen buckets": lambda: buckets(
            text.padding_boundaries(lengths, "buckets", max_length)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=8551)
    parser.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures-full"))
    args = parser.parse_args()

    import numpy as np
    import pandas as pd
    import tensorflow as tf
    from datasets import load_dataset
    from pages import page_function
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.teaching.fixtures import build_fixtures

    tf.get_logger().setLevel("ERROR")  # a retrace per new shape is the point here
    page = {"tf": tf, "np": np, "pd": pd, "time": time, "batch_size": BATCH}  # its globals
    train = page_function(PAGE, "train_counting_compiles", **page)
    summary = page_function(PAGE, "summary", **page)
    fixtures = Path(args.fixtures)
    build_fixtures(fixtures, verbose=False, full_splits=True)
    checkpoint = str(fixtures / "tiny-distilbert")
    tokenizer = hub.load_tokenizer(checkpoint)
    page["tokenizer"] = tokenizer  # the page pads with its pad id
    split = load_dataset(str(fixtures / "cola"))["train"]
    split = text.tokenize(split.select(range(min(args.examples, len(split)))), tokenizer, 128)

    rows = {}
    configs = configurations(split, page_function(PAGE, "longest_in_batch", **page))
    for name, make in configs.items():
        tf.keras.utils.set_random_seed(0)
        model = tf_classes.from_pretrained(
            TFAutoModelForSequenceClassification, checkpoint, num_labels=2
        )
        rows[name] = summary(train(model, make(), tf.keras.optimizers.Adam(1e-3)))
        print(f"{name}: done in {rows[name]['step s']:.1f} s of steps", flush=True)

    base = rows["(b) fixed 128"]
    print(f"\n{len(split):,} examples, batch {BATCH}, one epoch each, jit_compile=True on CPU\n")
    print(
        "| padding | shapes | compilations | padding share | compile s | step s"
        " | real tokens/s | vs (b) | without compiling | vs (b) |"
        "\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for name, r in rows.items():
        print(
            f"| {name} | {r['distinct shapes']} | {r['compilations']} | {r['padding share']:.0%}"
            f" | {r['compile s']:.1f} | {r['step s']:.1f} | {r['real tokens/s']:,}"
            f" | {r['real tokens/s'] / base['real tokens/s']:.2f}x"
            f" | {r['without compiling']:,}"
            f" | {r['without compiling'] / base['without compiling']:.2f}x |"
        )


if __name__ == "__main__":
    main()
