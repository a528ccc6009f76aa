"""TFRecord writing and reading on CPU: the tutorial's code against ``tpu_helpers.data.records``.

    python benchmarks/records.py [--repeats 5]

Data: the CoLA-like fixture's 8,551 training sentences, tokenized with the tiny
DistilBERT fixture's tokenizer and padded to 128, as in the tutorial. Every figure is the
best of ``--repeats`` runs, all measured side by side in this one process (the memory
figures in two child processes).

* writer: the tutorial's loop (one ``tf.train.Example`` per example) against
  ``write_records``; also the unpadded, variable-length records and their size;
* reader (counted inside the TF runtime, as ``fit`` consumes a dataset): iterating the
  raw records with no parsing (the ceiling), the tutorial's
  ``map(decode_fn)`` then ``batch``, and ``read_records`` (batch, then one vectorized
  ``parse_example``), with sequential and parallel file reads on a local disk and on
  ``ram://``; and the same examples unpadded, read back padded per batch to four widths
  (each width's shards read on their own, each batch parsed and padded in one op), as a
  ratio to the fixed-length reader: from the best rates, and from many alternating passes
  (one epoch per pass, and five epochs on one iterator);
* memory: peak resident memory added while writing the set and a 10x larger one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tpu_helpers.core.metrics import count_examples  # noqa: E402
from tpu_helpers.data import hub, records  # noqa: E402  (sets the Keras flag before TF loads)

BATCH = 32


def load(fixtures: Path):
    from datasets import Dataset, load_dataset

    tokenizer = hub.load_tokenizer(str(fixtures / "tiny-distilbert"))
    split = load_dataset(str(fixtures / "cola"))["train"]
    sentences, labels = list(split["sentence"]), np.asarray(split["label"])
    enc = tokenizer(
        sentences, padding="max_length", truncation=True, max_length=128, return_tensors="np"
    )
    padded = Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "label": labels}
    )
    unpadded = Dataset.from_dict(
        {
            "input_ids": tokenizer(sentences, truncation=True, max_length=128)["input_ids"],
            "label": labels,
        }
    )
    return enc, labels, padded, unpadded


def tutorial_write(enc, labels, path):
    import tensorflow as tf

    with tf.io.TFRecordWriter(path) as file_writer:
        for i in range(len(labels)):
            features = {
                "input_ids": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=enc["input_ids"][i])
                ),
                "attention_mask": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=enc["attention_mask"][i])
                ),
                "labels": tf.train.Feature(int64_list=tf.train.Int64List(value=[labels[i]])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=features))
            file_writer.write(example.SerializeToString())


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def folder_bytes(path):
    import tensorflow as tf

    return sum(tf.io.gfile.stat(p).length for p in tf.io.gfile.glob(f"{path}/*.tfrecord*"))


def memory_child(scale: int, fixtures: str) -> None:
    """Child process: write ``scale`` copies of the padded set, print the added peak RSS."""
    import psutil
    from datasets import concatenate_datasets

    _, _, padded, _ = load(Path(fixtures))
    data = concatenate_datasets([padded] * scale)  # Arrow tables shared, not copied
    with tempfile.TemporaryDirectory() as out:
        records.write_records(padded.select(range(100)), f"{out}/warm", progress=False)
        before = psutil.Process().memory_info().rss
        records.write_records(data, f"{out}/data", progress=False)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rows": len(data), "before": before, "peak": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures-full"))
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(args.memory_child, args.fixtures)

    import tensorflow as tf

    from tpu_helpers.teaching.fixtures import build_fixtures

    build_fixtures(Path(args.fixtures), verbose=False, full_splits=True)
    enc, labels, padded, unpadded = load(Path(args.fixtures))
    n = len(labels)
    tmp = tempfile.mkdtemp(prefix="records-bench-")
    print(f"CoLA-like set: {n:,} examples, padded to 128; best of {args.repeats} runs\n")

    # --- writer
    tut_file = f"{tmp}/dataset.tfrecords"
    t_tut = best(lambda: tutorial_write(enc, labels, tut_file), args.repeats)

    def ours(data, out, **kw):
        return lambda: records.write_records(data, out, overwrite=True, progress=False, **kw)

    t_ours = best(ours(padded, f"{tmp}/padded"), args.repeats)
    t_gzip = best(ours(padded, f"{tmp}/gzip", compression="GZIP"), args.repeats)
    t_var = best(ours(unpadded, f"{tmp}/var"), args.repeats)
    size_tut = os.path.getsize(tut_file)
    rows = [
        ("tutorial loop, padded to 128", t_tut, size_tut),
        ("write_records, padded to 128", t_ours, folder_bytes(f"{tmp}/padded")),
        ("write_records, padded, GZIP", t_gzip, folder_bytes(f"{tmp}/gzip")),
        ("write_records, unpadded", t_var, folder_bytes(f"{tmp}/var")),
    ]
    print("| writer | examples/s | vs tutorial | MB on disk |\n|---|---|---|---|")
    for name, t, size in rows:
        print(f"| {name} | {n / t:,.0f} | {t_tut / t:.1f}x | {size / 1e6:.1f} |")

    # --- reader
    shard_dirs = {}
    for kind, base in (("local", f"{tmp}/sharded"), ("ram://", "ram://bench/sharded")):
        records.write_records(padded, base, shard_records=n // 16 + 1, progress=False)
        shard_dirs[kind] = base
    # the same examples unpadded: written grouped by length, read back padded per batch
    records.write_records(unpadded, f"{tmp}/bucketed", shard_records=n // 16 + 1, progress=False)
    bucketed = records.open_records(f"{tmp}/bucketed")
    from tpu_helpers.data.text import choose_boundaries

    widths = choose_boundaries(records.record_lengths(bucketed), max_shapes=4)
    files = sorted(tf.io.gfile.glob(f"{shard_dirs['local']}/*.tfrecord"))

    def raw():
        return tf.data.TFRecordDataset(files).batch(BATCH)

    def tutorial_read():
        def decode_fn(sample):
            features = {
                "input_ids": tf.io.FixedLenFeature((128,), dtype=tf.int64),
                "attention_mask": tf.io.FixedLenFeature((128,), dtype=tf.int64),
                "labels": tf.io.FixedLenFeature((1,), dtype=tf.int64),
            }
            return tf.io.parse_example(sample, features)

        ds = tf.data.TFRecordDataset([tut_file]).map(decode_fn)
        ds = ds.shuffle(n).batch(BATCH, drop_remainder=True)
        return ds.apply(tf.data.experimental.assert_cardinality(n // BATCH))

    def epochs_of(batches, epochs=1):
        """``epochs`` epochs of a ``pipeline.Batches`` on one iterator."""
        ds = batches.dataset(0)
        for epoch in range(1, epochs):
            ds = ds.concatenate(batches.dataset(epoch))
        return ds

    def ours_read(kind, parallel, epochs=1):
        return lambda: epochs_of(
            records.read_records(
                shard_dirs[kind], global_batch=BATCH, seed=0, parallel_reads=parallel
            ),
            epochs,
        )

    def bucketed_read(epochs=1):
        batches = records.read_records(bucketed, global_batch=BATCH, boundaries=widths, seed=0)
        return epochs_of(batches, epochs)

    readers = [
        ("raw records, no parsing (ceiling), local", raw),
        ("tutorial map(decode_fn) + batch, local", tutorial_read),
        ("read_records, local, 1 file at a time", ours_read("local", 1)),
        ("read_records, local, 8 files in parallel", ours_read("local", 8)),
        ("read_records, ram://, 1 file at a time", ours_read("ram://", 1)),
        ("read_records, ram://, 8 files in parallel", ours_read("ram://", 8)),
        (f"read_records, unpadded, widths {widths}, local", bucketed_read),
    ]
    rates = {}
    for name, make in readers:
        ds = make()
        count_examples(ds)  # warm the page cache and trace the functions
        count = count_examples(ds)
        rates[name] = count / best(lambda ds=ds: count_examples(ds), args.repeats)
    ceiling = rates[readers[0][0]]
    tut_rate = rates[readers[1][0]]
    print("\n| reader (batch 32) | examples/s | of raw rate | vs tutorial |\n|---|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:,.0f} | {rate / ceiling:.0%} | {rate / tut_rate:.1f}x |")
    fixed_rate = rates[readers[2][0]]
    print(
        f"\nbucketed / fixed-length reader, best rates above:"
        f" {rates[readers[-1][0]] / fixed_rate:.2f}"
    )
    # The ratio that matters, measured in alternation (fixed, then bucketed, many times)
    # so that a machine whose speed drifts moves both sides alike: one epoch per iterator
    # (as each epoch of fit on a dataset without repeat), and five epochs on one iterator
    # (epochs 0 to 4 of the read_records batches, one after the other).
    for label, epochs, rounds in (
        ("1 epoch per pass", 1, 5 * args.repeats),
        ("5 epochs per pass", 5, 2 * args.repeats),
    ):
        fixed_ds = ours_read("local", 1, epochs)()
        bucketed_ds = bucketed_read(epochs)
        n_fixed, n_bucketed = count_examples(fixed_ds), count_examples(bucketed_ds)  # warm
        fixed_rates, bucketed_rates = [], []
        for _ in range(rounds):
            fixed_rates.append(n_fixed / best(lambda ds=fixed_ds: count_examples(ds), 1))
            bucketed_rates.append(n_bucketed / best(lambda ds=bucketed_ds: count_examples(ds), 1))
        pairs = np.asarray(bucketed_rates) / np.asarray(fixed_rates)
        q1, q3 = np.percentile(pairs, [25, 75])
        print(
            f"bucketed / fixed-length reader (same examples, local, 1 file at a time),"
            f" {label}, {rounds} alternating passes each: ratio of medians"
            f" {np.median(bucketed_rates) / np.median(fixed_rates):.2f}"
            f" ({np.median(bucketed_rates):,.0f} / {np.median(fixed_rates):,.0f} examples/s;"
            f" pairs: median {np.median(pairs):.2f}, middle half {q1:.2f}-{q3:.2f})"
        )

    # --- memory
    print("\n| writing | examples | peak RSS added while writing |\n|---|---|---|")
    added = {}
    for scale in (1, 10):
        out = (
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--memory-child",
                    str(scale),
                    "--fixtures",
                    args.fixtures,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        m = json.loads(out)
        added[scale] = max(0, m["peak"] - m["before"])
        print(
            f"| {scale}x the set | {m['rows']:,} | {added[scale] / 2**20:.1f} MiB"
            f" (of {m['peak'] / 2**20:.0f} MiB peak) |"
        )
    print(
        f"\n10x / 1x peak process memory: see the table; added memory ratio"
        f" {added[10] / max(added[1], 1):.2f}"
    )


if __name__ == "__main__":
    main()
