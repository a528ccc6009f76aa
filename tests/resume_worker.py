"""Train a tiny classifier with ``checkpoints.fit_resumable`` on notebook 01's in-memory
bucketed batches (or, with ``--data records``, notebook 03's TFRecord shards), for
``test_checkpoints``: uninterrupted, killed with SIGKILL when a step
is about to start (``--kill-at``), or interrupted by a ``KeyboardInterrupt`` and run again
in the same process (``--interrupt-at``). Writes the final weights (``--out``, .npz) and
appends ``step learning_rate`` per step to ``--lr-log``.

    python tests/resume_worker.py --dir CKPT --out weights.npz --lr-log lr.txt [--kill-at 6]
"""

import argparse
import os
import signal

import numpy as np

import tpu_helpers  # noqa: F401  (the Keras flag before TensorFlow loads)

EPOCHS, BATCH, WIDTHS = 3, 8, [16, 40]


def counting_split(n=100, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 41, size=n)
    ids = [list(rng.integers(1, 60, size=k)) for k in lengths]
    return {
        "input_ids": ids,
        "length": lengths.tolist(),
        "label": [int(np.mean(x) > 30) for x in ids],
    }


def tiny_model(total_steps):
    import tensorflow as tf

    ids = tf.keras.Input((None,), dtype=tf.int32, name="input_ids")
    mask = tf.keras.Input((None,), dtype=tf.int32, name="attention_mask")
    x = tf.keras.layers.Embedding(60, 8)(ids)
    x = tf.keras.layers.GlobalAveragePooling1D()(x, mask=tf.cast(mask, tf.bool))
    model = tf.keras.Model({"input_ids": ids, "attention_mask": mask}, tf.keras.layers.Dense(2)(x))
    schedule = tf.keras.optimizers.schedules.PolynomialDecay(0.05, total_steps, 0.0)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(schedule),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def watchers(model, args):
    import tensorflow as tf

    class Watch(tf.keras.callbacks.Callback):
        interrupted = False

        def on_train_batch_begin(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.interrupt_at and not Watch.interrupted:
                Watch.interrupted = True
                raise KeyboardInterrupt
            with open(args.lr_log, "a") as log:
                log.write(f"{step} {float(model.optimizer.learning_rate):.10g}\n")

    return [Watch()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lr-log", required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--interrupt-at", type=int, default=-1)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--data", choices=["memory", "records"], default="memory")
    args = parser.parse_args()

    import tensorflow as tf

    from tpu_helpers import checkpoints, text

    tf.config.experimental.enable_op_determinism()
    tf.keras.utils.set_random_seed(0)
    split = counting_split()
    steps = text.count_steps(split["length"], WIDTHS, BATCH)

    def dataset_fn(epoch, skip):
        return text.make_text_dataset(split, BATCH, WIDTHS, seed=epoch, skip_steps=skip)

    if args.data == "records":  # notebook 03's path: shards written once, read per epoch
        from tpu_helpers import records

        folder = f"{args.dir}-records"
        if not os.path.exists(f"{folder}/train.metadata.json"):
            rows = [
                dict(zip(split, values, strict=True))
                for values in zip(*split.values(), strict=True)
            ]
            records.write_records(
                rows, folder, columns=["input_ids", "label"], progress=False, shard_records=30
            )
        source = records.open_records(f"{folder}/train.metadata.json")
        steps = records.read_records(source, BATCH, boundaries=WIDTHS, seed=0).steps

        def dataset_fn(epoch, skip):  # noqa: F811
            return records.read_records(
                source, BATCH, boundaries=WIDTHS, seed=0, epoch=epoch, skip_steps=skip
            )

    model = tiny_model(steps * EPOCHS)
    watch = watchers(model, args)  # one interrupt in all

    def train():
        return checkpoints.fit_resumable(
            model,
            dataset_fn,
            steps,
            EPOCHS,
            args.dir,
            every_steps=args.every,
            run={"global_batch": BATCH},
            callbacks=watch,
            verbose=0,
        )

    try:
        history = train()
    except KeyboardInterrupt:
        print("INTERRUPTED at step", int(model.optimizer.iterations.numpy()))
        history = train()  # the cell run again, in the same process
    print("STEPS", steps, "FINAL", int(model.optimizer.iterations.numpy()))
    print("EPOCHS IN HISTORY", len(history["loss"]))
    np.savez(args.out, *model.get_weights())


if __name__ == "__main__":
    main()
