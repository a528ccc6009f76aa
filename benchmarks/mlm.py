"""Masked-language-model data and training: packed blocks against padded rows, measured on CPU.

    python benchmarks/mlm.py [--block 128] [--batch 32]

On the raw-prose fixture (Python's documentation laid out like WikiText) with the tiny
DistilBERT tokenizer and model, prints, from one run:

* the real-token share of packed blocks (100 % by construction) against one paragraph per
  row padded to the block size;
* masking throughput (examples/s, counted inside the TF runtime, best of 5 alternating
  rounds): ``mlm.mask_batches``,
  the TPU example's ``DataCollatorForLanguageModeling(return_tensors="tf").tf_mask_tokens``
  mapped over the same batches, and ``to_tf_dataset`` with the collator (what
  ``prepare_tf_dataset`` does);
* training real (non-padding) tokens per second, one device, packed against padded
  paragraph-per-row batches, with their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tpu_helpers.core.metrics import examples_per_second  # noqa: E402
from tpu_helpers.data import hub, mlm  # noqa: E402
from tpu_helpers.teaching.fixtures import build_fixtures  # noqa: E402
from tpu_helpers.tf_engine import tf_classes  # noqa: E402  (sets the Keras flag before TF loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=40)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf
    from datasets import load_dataset
    from transformers import DataCollatorForLanguageModeling, TFAutoModelForMaskedLM

    paths = build_fixtures(ROOT / "build" / "fixtures-full", verbose=False, full_splits=True)
    tokenizer = hub.load_tokenizer(paths["tiny-distilbert"])
    text = mlm.clean_lines(load_dataset(paths["text-corpus"])["train"])
    blocks = np.asarray(mlm.pack_blocks(text, tokenizer, args.block)["input_ids"], np.int32)
    rows = tokenizer(list(text["text"]), truncation=True, max_length=args.block)["input_ids"]
    lengths = np.array([len(r) for r in rows])
    padded_share = lengths.sum() / (len(rows) * args.block)
    print(f"{len(blocks):,} packed blocks of {args.block}; {len(rows):,} paragraphs")
    print(f"real-token share: packed 100 %, one paragraph per padded row {padded_share:.1%}")

    batches = tf.data.Dataset.from_tensor_slices(blocks).batch(args.batch, drop_remainder=True)
    batches = batches.cache()
    list(batches)  # fill the cache: the comparison is of masking, not of slicing
    ours = mlm.mask_batches(batches, tokenizer, seed=0)
    collator = DataCollatorForLanguageModeling(tokenizer, return_tensors="tf")
    special = tf.constant(tokenizer.all_special_ids, tf.int32)

    def reference(ids):
        is_special = tf.reduce_any(ids[..., None] == special, axis=-1)
        return collator.tf_mask_tokens(
            ids,
            vocab_size=len(tokenizer),
            mask_token_id=tokenizer.mask_token_id,
            special_tokens_mask=is_special,
        )

    theirs = batches.map(reference, num_parallel_calls=tf.data.AUTOTUNE)
    from datasets import Dataset

    np_collator = DataCollatorForLanguageModeling(tokenizer, return_tensors="np")
    via_datasets = Dataset.from_dict({"input_ids": blocks.tolist()}).to_tf_dataset(
        columns="input_ids",
        label_cols="labels",
        batch_size=args.batch,
        collate_fn=np_collator,
        drop_remainder=True,
        shuffle=False,
    )
    # best of 5 alternating rounds: this machine's speed drifts by a third between minutes
    pipelines = {
        "mlm.mask_batches": ours,
        "tf_mask_tokens (TPU example)": theirs,
        "to_tf_dataset + collator": via_datasets,
    }
    rates = dict.fromkeys(pipelines, 0.0)
    for _ in range(5):
        for name, ds in pipelines.items():
            rates[name] = max(rates[name], examples_per_second(ds))
    print("\n| masking | examples/s | vs ours |\n|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / rates['mlm.mask_batches']:.2f}x |")

    # training: the same model and steps, packed blocks against padded paragraph rows
    keep = lengths >= 8
    padded = np.zeros((keep.sum(), args.block), np.int32)
    for i, r in enumerate(r for r, k in zip(rows, keep, strict=True) if k):
        padded[i, : len(r)] = r
    padded_batches = tf.data.Dataset.from_tensor_slices(padded).batch(
        args.batch, drop_remainder=True
    )

    def train(data, attention):
        tf.keras.utils.set_random_seed(0)
        model = tf_classes.from_pretrained(TFAutoModelForMaskedLM, paths["tiny-distilbert"])
        model.compile(
            optimizer=tf.keras.optimizers.Adam(1e-3),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

        def with_mask(features, labels, weights):
            ids = features["input_ids"]
            mask = (
                tf.cast(ids != tokenizer.pad_token_id, tf.int32) if attention else tf.ones_like(ids)
            )
            return {"input_ids": ids, "attention_mask": mask}, labels, weights

        ds = mlm.mask_batches(data.repeat(), tokenizer).map(with_mask).take(args.train_steps + 5)
        model.fit(ds.take(5), verbose=0)  # compile and warm up
        real = sum(int(tf.reduce_sum(f["attention_mask"])) for f, _, _ in ds.skip(5))
        start = time.perf_counter()
        model.fit(ds.skip(5), verbose=0)
        return real / (time.perf_counter() - start)

    packed_rate = train(batches, attention=False)
    padded_rate = train(padded_batches, attention=True)
    print("\n| training (one device, tiny DistilBERT) | real tokens/s | vs padded |\n|---|---|---|")
    print(f"| paragraph per row, padded to {args.block} | {padded_rate:,.0f} | 1.00x |")
    print(f"| packed blocks | {packed_rate:,.0f} | {packed_rate / padded_rate:.2f}x |")


if __name__ == "__main__":
    main()
