"""What padding costs when every step is compiled by XLA (as on a TPU), measured on CPU.

    python benchmarks/xla_padding.py [--examples 8551]

Tiny DistilBERT fixture, CoLA-like fixture, batch 32, one device, ``jit_compile=True``,
one epoch each (compilation included, as a TPU pays it), side by side in one run:

* (a) longest: random batches padded to their longest row (``prepare_tf_dataset``);
* (b) fixed 128: the tutorial's ``padding="max_length"``;
* (c) multiple of 32: sorted into widths 32, 64, 96, 128;
* (d) buckets: at most 4 widths chosen from the length histogram (``text.choose_boundaries``).

Prints distinct shapes, XLA compilations, padding share, seconds, real (non-padding)
tokens/s over the epoch (compilation included) and over the steps that did not compile,
with their ratios against (b).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tpu_helpers.data import hub, text  # noqa: E402
from tpu_helpers.tf_engine import tf_classes, xla_runs  # noqa: E402  (sets the Keras flag before TF loads)

BATCH = 32


def configurations(split, max_length=128):
    lengths = split["length"]
    return {
        "(a) longest in batch": lambda: text.longest_padded_batches(
            split, global_batch=BATCH, seed=0
        ),
        "(b) fixed 128": lambda: text.text_batches(
            split, global_batch=BATCH, boundaries=[max_length], seed=0
        ),
        "(c) multiple of 32": lambda: text.text_batches(
            split,
            global_batch=BATCH,
            boundaries=text.padding_boundaries(lengths, "multiple", max_length),
            seed=0,
        ),
        "(d) data-chosen buckets": lambda: text.text_batches(
            split,
            global_batch=BATCH,
            boundaries=text.padding_boundaries(lengths, "buckets", max_length),
            seed=0,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=8551)
    parser.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures-full"))
    args = parser.parse_args()

    import tensorflow as tf
    from datasets import load_dataset
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.teaching.fixtures import build_fixtures

    fixtures = Path(args.fixtures)
    build_fixtures(fixtures, verbose=False, full_splits=True)
    checkpoint = str(fixtures / "tiny-distilbert")
    tokenizer = hub.load_tokenizer(checkpoint)
    split = load_dataset(str(fixtures / "cola"))["train"]
    split = text.tokenize(split.select(range(min(args.examples, len(split)))), tokenizer, 128)

    runs = []
    for name, make in configurations(split).items():
        tf.keras.utils.set_random_seed(0)
        model = tf_classes.from_pretrained(
            TFAutoModelForSequenceClassification, checkpoint, num_labels=2
        )
        optimizer = tf.keras.optimizers.Adam(1e-3)
        runs.append(xla_runs.train_counting_compiles(model, make(), optimizer, name=name))
        print(f"{name}: done in {runs[-1].seconds:.1f} s", flush=True)

    base = next(r for r in runs if r.name.startswith("(b)"))
    print(f"\n{len(split):,} examples, batch {BATCH}, one epoch each, jit_compile=True on CPU\n")
    print(
        "| padding | shapes | compilations | padding share | compile s | total s"
        " | real tokens/s | vs (b) | without compiling | vs (b) |"
        "\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in runs:
        print(
            f"| {r.name} | {r.shapes} | {r.compiles} | {r.padding_fraction:.0%}"
            f" | {r.compile_seconds:.1f} | {r.seconds:.1f} | {r.real_tokens_per_second:,.0f}"
            f" | {r.real_tokens_per_second / base.real_tokens_per_second:.2f}x"
            f" | {r.steady_real_tokens_per_second:,.0f}"
            f" | {r.steady_real_tokens_per_second / base.steady_real_tokens_per_second:.2f}x |"
        )


if __name__ == "__main__":
    main()
