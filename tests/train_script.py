"""A small deterministic ``CustomLoop`` run for tests/test_training.py (which calls
``main``; it also runs alone):

    python tests/train_script.py CHECKPOINT_DIR [--epochs N] [--renamed]

Prints checkpoint lines as it goes and, at the end, ``FINAL step=<n> weights=<sum>``.
"""

import sys

import numpy as np
import tensorflow as tf  # noqa: E402  (after tpu_helpers)

import tpu_helpers
from tpu_helpers import text
from tpu_helpers.training import CustomLoop


class Tiny(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = tf.keras.layers.Embedding(
            50, 8, embeddings_initializer=tf.keras.initializers.RandomNormal(seed=1)
        )
        self.out = tf.keras.layers.Dense(
            2, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2)
        )

    def call(self, features, training=False):
        mask = tf.cast(features["attention_mask"], tf.float32)[..., None]
        pooled = tf.reduce_sum(self.embed(features["input_ids"]) * mask, 1) / tf.reduce_sum(mask, 1)
        return self.out(pooled)


class Renamed(tf.keras.Model):
    """``Tiny`` with its layers under other names: a checkpoint of ``Tiny`` matches none."""

    def __init__(self):
        super().__init__()
        self.embedding = tf.keras.layers.Embedding(50, 8)
        self.head = tf.keras.layers.Dense(2)

    def call(self, features, training=False):
        mask = tf.cast(features["attention_mask"], tf.float32)[..., None]
        total = tf.reduce_sum(self.embedding(features["input_ids"]) * mask, 1)
        return self.head(total / tf.reduce_sum(mask, 1))


def main(checkpoint_dir, renamed=False, epochs=3):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 30, 300)
    ids = [rng.integers(1, 50, n).tolist() for n in lengths]
    split = {"input_ids": ids, "length": lengths.tolist(), "label": [int(x[0] > 25) for x in ids]}
    strategy = tpu_helpers.connect(verbose=False)
    boundaries = text.choose_boundaries(lengths, 3)
    steps = text.distribute_text_dataset(strategy, split, 16, boundaries)[1]

    def train_fn(epoch, skip):
        return text.distribute_text_dataset(
            strategy, split, 16, boundaries, seed=epoch, skip_steps=skip
        )[0]

    with strategy.scope():
        model = Renamed() if renamed else Tiny()
        optimizer = tf.keras.optimizers.Adam(0.01)
    loop = CustomLoop(strategy, model, optimizer, 16, checkpoint_dir, steps_per_call=4)

    def log(message):
        print(message, flush=True)

    loop.fit(train_fn, steps, epochs=epochs, checkpoint_every=5, log=log)
    total = sum(float(np.abs(w).sum()) for w in model.get_weights())
    print(f"FINAL step={loop.step} steps_per_epoch={steps} weights={total:.6f}", flush=True)


if __name__ == "__main__":
    epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 3
    main(sys.argv[1], "--renamed" in sys.argv, epochs)
