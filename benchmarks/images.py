"""Image pipeline throughput on CPU: the tutorial's ``map(decode_fn)`` against
``tpu_helpers.data.images.image_batches``.

    python benchmarks/images.py [--images 300] [--size 224] [--rounds 5]

Writes ``--images`` synthetic 500x500 JPEG leaves (the beans fixture's generator) to a
temporary folder, then measures images/s of each pipeline, counted inside the TF runtime
(as ``fit`` consumes a dataset), batch 32, at this machine's core count. The pipelines
are measured in alternation, ``--rounds`` times each, and the best round of each is
reported, so a slow moment of a shared machine does not land on one side only.

* tutorial: read, ``decode_jpeg``, ``resize`` to the processor size, scale, normalize,
  transpose; ``map`` without ``num_parallel_calls`` (TF 2.21 parallelizes it anyway);
* ours: the same output from ``image_batches`` (each JPEG decoded at the reduced scale that
  leaves twice the target, ``decode_scale``; file checks, fused normalization), evaluation mode;
* ours, training: with shuffling and augmentation (the last batch completed with weight-0
  copies, which are counted);
* ours, cached: second pass with ``cache=True`` (decoded images kept in memory).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tpu_helpers.core.metrics import examples_per_second  # noqa: E402
from tpu_helpers.data import images  # noqa: E402  (sets the Keras flag before TF loads)

BATCH = 32


def write_jpegs(folder: Path, n: int) -> tuple[list[str], list[int]]:
    import numpy as np
    from PIL import Image

    from tpu_helpers.teaching.fixtures import leaf_image

    rng = np.random.default_rng(0)
    paths, labels = [], []
    for i in range(n):
        label = i % 3
        path = folder / f"{i:04d}.jpg"
        Image.fromarray(leaf_image(rng, label, 500)).save(path, quality=90)
        paths.append(str(path))
        labels.append(label)
    return paths, labels


def tutorial(paths, labels, spec):
    import tensorflow as tf

    image_size, image_mean, image_std = (spec.height, spec.width), spec.mean, spec.std

    def decode_fn(sample):
        image_data = tf.io.read_file(sample["filename"])
        image = tf.io.decode_jpeg(image_data, channels=3)
        image = tf.image.resize(image, image_size)
        array = tf.cast(image, tf.float32)
        array /= 255.0
        array = (array - image_mean) / image_std
        array = tf.transpose(array, perm=[2, 0, 1])
        return {"pixel_values": array, "labels": sample["labels"]}

    ds = tf.data.Dataset.from_tensor_slices({"filename": paths, "labels": labels})
    return ds.map(decode_fn).batch(BATCH, drop_remainder=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--size", type=int, default=224, help="the processor's height/width")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import os

    spec = images.ImageSpec(args.size, args.size, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    with tempfile.TemporaryDirectory() as tmp:
        paths, labels = write_jpegs(Path(tmp), args.images)

        def ours(**kwargs):  # epoch 0's batches of the pipeline
            return images.image_batches(paths, labels, spec, global_batch=BATCH, **kwargs).dataset()

        pipelines = {
            "tutorial map(decode_fn)": tutorial(paths, labels, spec),
            "image_batches": ours(),
            "image_batches, full-scale decode": ours(reduced_decode=False),
            "image_batches, training (augmented)": ours(training=True),
            "image_batches, cache=True, 2nd pass": ours(cache=True),
        }
        for ds in pipelines.values():
            examples_per_second(ds)  # warm up: trace, fill the cache, read the files once
        best = dict.fromkeys(pipelines, 0.0)
        for _ in range(args.rounds):
            for name, ds in pipelines.items():
                best[name] = max(best[name], examples_per_second(ds))
    base = best["tutorial map(decode_fn)"]
    print(
        f"{args.images} JPEGs of 500x500 -> {args.size}x{args.size}, batch {BATCH},"
        f" {os.cpu_count()} cores, best of {args.rounds} rounds\n"
    )
    print("| pipeline | images/s | vs tutorial |\n|---|---|---|")
    for name, rate in best.items():
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
