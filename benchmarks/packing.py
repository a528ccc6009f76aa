"""Packed fine-tuning against notebook 01's best bucketed setup, on one device.

    python benchmarks/packing.py [--examples 2048] [--repeats 3] [--task single|pairs|both]

Data: single sentences, the CoLA-like fixture's training sentences tokenized with the tiny
DistilBERT fixture's tokenizer; sentence pairs, the MRPC-like fixture's pairs tokenized
with the tiny BERT fixture's tokenizer (token types per sentence). Up to 128 tokens. Model: a BERT classifier built from a config with
hidden size 256 (4 heads, 2 layers, feed-forward 1024), so that attention has the share of
the work it has in real checkpoints; random weights (speed does not depend on them).

* real-token share of packing at widths 64 and 128 (each widened to hold the longest
  example, ``packing.row_width``), against the 4 data-chosen widths
  (``text.padding_boundaries(..., "buckets")``) and one width of 128;
* training steps compiled with XLA (``jit_compile=True``) on one device: every input shape
  is compiled before timing, then one pass over the examples is timed, best of
  ``--repeats``; printed as real tokens per second and as the ratio packed / bucketed;
* an estimate of the same ratio for ``bert-base`` proportions (hidden 768, 12 layers),
  from the measured token shares and the FLOPs of a layer per token:
  ``24 H^2`` (projections and feed-forward, 4x expansion) ``+ 4 T H`` (attention over a
  row of width ``T``), forward and backward alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tpu_helpers.data import hub, packing, text  # noqa: E402  (sets the Keras flag before TF loads)
from tpu_helpers.tf_engine import packed_classes  # noqa: E402

TOKENS_PER_BATCH = 4096  # rows x width of every batch, packed or bucketed (32 x 128)


TASKS = {  # task: (data set, tokenizer, text columns)
    "single": ("cola", "tiny-distilbert", ("sentence",)),
    "pairs": ("mrpc", "tiny-bert", ("sentence1", "sentence2")),
}


def load(fixtures: Path, examples: int, task: str):
    from datasets import load_dataset

    data, checkpoint, columns = TASKS[task]
    tokenizer = hub.load_tokenizer(str(fixtures / checkpoint))
    split = load_dataset(str(fixtures / data))["train"].shuffle(seed=0)
    split = split.select(range(min(examples, len(split))))
    pair = columns[1] if len(columns) > 1 else None
    tokenized = text.tokenize(split, tokenizer, 128, columns[0], 1000, pair)
    return tokenized, tokenizer


def build_model(vocab_size: int):
    import tensorflow as tf
    from transformers import BertConfig, TFBertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
        num_labels=2,
    )
    tf.keras.utils.set_random_seed(0)
    model = TFBertForSequenceClassification(config)
    model(model.dummy_inputs)
    return model


def time_pass(step, batches, repeats):
    for batch in {tuple(b[0]["input_ids"].shape): b for b in batches}.values():
        step(*batch)  # compile every shape first
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            loss = step(*batch)
        float(loss)
        best = min(best, time.perf_counter() - start)
    return best


def flops_per_real_token(hidden: int, layers: int, widths, shares) -> float:
    """Relative cost of one real token: the layer FLOPs of a token of a row of width T,
    averaged over the rows (weights ``shares`` of computed tokens per width), divided by
    the share of computed tokens that are real."""
    dense, per_width = 24 * hidden**2, {w: 4 * w * hidden for w in widths}
    computed = sum(s * (dense + per_width[w]) for w, s in shares.items())
    return layers * computed


def shares(lengths, boundaries):
    """Print the real-token share of each layout; return ``{width: packed rows}``."""
    print("| layout | shapes | real-token share | rows |\n|---|---|---|---|")
    print(f"| one width, 128 | 1 | {text.padding_report(lengths, [128]).real_token_share:.1%} | |")
    bucket_share = text.padding_report(lengths, boundaries).real_token_share
    print(f"| bucketed {boundaries} | {len(boundaries)} | {bucket_share:.1%} | |")
    packed_rows = {}
    for width in sorted({packing.row_width(lengths, w) for w in (64, 128)}):
        rows = packing.pack_rows(lengths, width, max_per_row=16)
        packed_rows[width] = rows
        report = packing.pack_report(lengths, rows, width)
        print(f"| packed, width {width} | 1 | {report.real_token_share:.1%} | {report.rows:,} |")
    return packed_rows


def steps(model):
    """The bucketed and the packed training step, each compiled with XLA."""
    import tensorflow as tf

    packed = packed_classes.PackedClassifier(model)
    optimizer = tf.keras.optimizers.SGD(1e-3)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def bucketed_step(features, y, w):
        with tf.GradientTape() as tape:
            logits = model(features, training=True).logits
            loss = loss_fn(y, logits, sample_weight=w)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function(jit_compile=True)
    def packed_step(features, y, w):
        with tf.GradientTape() as tape:
            loss = packed_classes.packed_loss(y, packed(features, training=True), w)
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return bucketed_step, packed_step


def rates(tokenized, tokenizer, boundaries, widths, repeats):
    """Real tokens per second of notebook 01's batches (32 rows, one data-chosen width
    each) and of packed batches of ``TOKENS_PER_BATCH`` tokens at each width."""
    lengths = np.asarray(tokenized["length"])
    real = int(lengths.sum())
    types = tokenized["token_type_ids"] if "token_type_ids" in tokenized.column_names else None
    ids, labels = list(tokenized["input_ids"]), list(tokenized["label"])
    bucketed_step, packed_step = steps(build_model(len(tokenizer)))
    bucketed = text.text_batches(tokenized, global_batch=32, boundaries=boundaries, seed=0)
    bucketed = list(bucketed.dataset())
    seconds = time_pass(bucketed_step, bucketed, repeats)
    out = {"bucketed": real / seconds}
    print("\n| training, XLA on one device | steps | seconds per pass | real tokens/s |")
    print("|---|---|---|---|")
    print(
        f"| bucketed {boundaries}, 32 rows | {len(bucketed)} | {seconds:.2f} | {out['bucketed']:,.0f} |"
    )
    for width in widths:
        batch = TOKENS_PER_BATCH // width
        packed = packing.packed_batches(
            ids,
            labels,
            width=width,
            global_batch=batch,
            epochs=1,
            max_per_row=16,
            seed=0,
            token_type_ids=types,
        )
        n = packed.steps_per_epoch
        seconds = time_pass(packed_step, list(packed.dataset()), repeats)
        out[width] = real / seconds
        print(f"| packed, width {width}, {batch} rows | {n} | {seconds:.2f} | {out[width]:,.0f} |")
    for width in widths:
        ratio = out[width] / out["bucketed"]
        print(f"packed width {width} / bucketed, real tokens per second: {ratio:.2f}")
    return out


def estimate(lengths, boundaries, packed_rows):
    """The packed / bucketed ratio for bert-base proportions, from the token shares."""
    real = int(lengths.sum())
    widths_of = np.asarray(boundaries)[np.searchsorted(boundaries, np.minimum(lengths, 128))]
    computed = {w: float((widths_of == w).sum() * w) for w in boundaries}
    total = sum(computed.values())
    bucket_cost = flops_per_real_token(
        768, 12, boundaries, {w: c / real for w, c in computed.items()}
    )
    for width, rows in packed_rows.items():
        share = packing.pack_report(lengths, rows, width).real_token_share
        packed_cost = flops_per_real_token(768, 12, [width], {width: 1 / share})
        print(
            f"estimate for bert-base proportions, packed width {width} / bucketed:"
            f" {bucket_cost / packed_cost:.2f} (FLOPs per real token; bucketed computes"
            f" {total / real:.2f} tokens per real one, packed {1 / share:.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures-full"))
    args = parser.parse_args()

    from tpu_helpers.teaching.fixtures import build_fixtures

    build_fixtures(Path(args.fixtures), verbose=False, full_splits=True)
    for task in TASKS if args.task == "both" else [args.task]:
        tokenized, tokenizer = load(Path(args.fixtures), args.examples, task)
        lengths = np.asarray(tokenized["length"])
        boundaries = text.padding_boundaries(lengths, "buckets", 128)
        print(f"\n## {task}: {len(lengths):,} examples, {int(lengths.sum()):,} real tokens\n")
        packed_rows = shares(lengths, boundaries)
        rates(tokenized, tokenizer, boundaries, list(packed_rows), args.repeats)
        estimate(lengths, boundaries, packed_rows)


if __name__ == "__main__":
    main()
