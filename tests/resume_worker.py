"""Train a tiny model with ``trainer.fit_resumable`` (or ``CustomLoop.fit`` with
``--loop custom``) for ``test_tf_trainer``: on notebook 01's in-memory bucketed batches,
notebook 03's TFRecord shards (``--data records``) or notebook 06's masked blocks read from
shards (``--data masked``); uninterrupted, killed with SIGKILL when a step is about to
start (``--kill-at``), or interrupted by a ``KeyboardInterrupt`` and run again in the same
process (``--interrupt-at``). Writes the final weights (``--out``, .npz) and appends
``step learning_rate`` per step (per call of ``CustomLoop``) to ``--lr-log``.

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


class BlockTokenizer:
    """What ``mlm.mask_batches`` reads of a tokenizer: ids 0-3 special, 3 the mask."""

    mask_token_id, all_special_ids = 3, [0, 1, 2, 3]

    def __len__(self):
        return 60


def tiny_model(total_steps, masked=False):
    import tensorflow as tf

    ids = tf.keras.Input((None,), dtype=tf.int32, name="input_ids")
    x = tf.keras.layers.Embedding(60, 8)(ids)
    if masked:  # a token's logits over the vocabulary, as a masked-LM head gives
        model = tf.keras.Model({"input_ids": ids}, tf.keras.layers.Dense(60)(x))
    else:
        mask = tf.keras.Input((None,), dtype=tf.int32, name="attention_mask")
        x = tf.keras.layers.GlobalAveragePooling1D()(x, mask=tf.cast(mask, tf.bool))
        inputs = {"input_ids": ids, "attention_mask": mask}
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(x))
    schedule = tf.keras.optimizers.schedules.PolynomialDecay(0.05, total_steps, 0.0)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(schedule),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def before_each_step(model, args):
    """Kill, interrupt (once) or log the learning rate when a step is about to start."""
    state = {"interrupted": False}

    def check():
        step = int(model.optimizer.iterations.numpy())
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.interrupt_at and not state["interrupted"]:
            state["interrupted"] = True
            raise KeyboardInterrupt
        with open(args.lr_log, "a") as log:
            log.write(f"{step} {float(model.optimizer.learning_rate):.10g}\n")

    return check


def watchers(model, args):
    import tensorflow as tf

    check = before_each_step(model, args)

    class Watch(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            check()

    return [Watch()]


def custom_loop(model, args):
    """A ``CustomLoop`` on ``model``, two steps a call, its calls watched."""
    import tensorflow as tf

    from tpu_helpers.tf_engine.custom_loop import CustomLoop

    loop = CustomLoop(
        tf.distribute.get_strategy(), model, model.optimizer, BATCH, args.dir, steps_per_call=2
    )
    check, call = before_each_step(model, args), loop._train_call

    def watched(iterator, steps):
        check()
        return call(iterator, steps)

    loop._train_call = watched
    return loop


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lr-log", required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--interrupt-at", type=int, default=-1)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--data", choices=["memory", "records", "masked"], default="memory")
    parser.add_argument("--loop", choices=["fit", "custom"], default="fit")
    args = parser.parse_args()

    import tensorflow as tf

    from tpu_helpers.data import text
    from tpu_helpers.tf_engine import trainer

    tf.config.experimental.enable_op_determinism()
    tf.keras.utils.set_random_seed(0)
    split = counting_split()
    # one plan for the whole run: each epoch, from any step, is train_batches.distribute(...)
    train_batches = text.text_batches(split, global_batch=BATCH, boundaries=WIDTHS, seed=0)
    assert train_batches.steps_per_epoch == text.count_steps(split["length"], WIDTHS, BATCH)

    if args.data != "memory":  # notebooks 03 and 06: shards written once, read per epoch
        from tpu_helpers.data import mlm, records

        folder = f"{args.dir}-records"
        if args.data == "masked":  # blocks of 16 token ids, no labels: the masks make them
            rows = [{"input_ids": (ids + [5] * 16)[:16]} for ids in split["input_ids"]]
            widths, label_column = None, None
        else:
            pairs = zip(split["input_ids"], split["label"], strict=True)
            rows = [{"input_ids": ids, "label": y} for ids, y in pairs]
            widths, label_column = WIDTHS, "label"
        if not os.path.exists(f"{folder}/train.metadata.json"):
            records.write_records(rows, folder, progress=False, shard_records=30)
        source = records.open_records(f"{folder}/train.metadata.json")
        train_batches = records.read_records(
            source, global_batch=BATCH, label_column=label_column, boundaries=widths, seed=0
        )
        if args.data == "masked":  # notebook 06: the masks of (seed, epoch, step)
            train_batches = mlm.masked_batches(train_batches, BlockTokenizer(), seed=0)
    steps = train_batches.steps_per_epoch

    model = tiny_model(steps * EPOCHS, masked=args.data == "masked")
    if args.loop == "custom":
        loop = custom_loop(model, args)

        def train():
            history = loop.fit(train_batches, EPOCHS, checkpoint_every=args.every)
            return {"loss": [row["loss"] for row in history]}

    else:
        watch = watchers(model, args)  # one interrupt in all

        def train():
            return trainer.fit_resumable(
                model,
                train_batches,
                EPOCHS,
                args.dir,
                every_steps=args.every,
                run={"data": args.data},
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
