"""One host of a simulated two-host slice, for tests/test_pod.py (run as a subprocess).

    TF_CONFIG=... python tests/pod_worker.py DATA_DIR OUT_JSON [--kill-at STEP | --resume]

Two of these processes, each a ``MultiWorkerMirroredStrategy`` worker with one replica,
make a two-host cluster on loopback: one input pipeline per host, gradients all-reduced
between them each step. For each data source (an in-memory tokenized split, bucketed
shards, fixed-length shards) the host records, step by step, the width, the example ids
and the weights its replica was given over one epoch (each source one ``pipeline.Batches``,
``batches.distribute(strategy, epoch, skip_steps=...)``), then trains on the same epochs with
``CustomLoop``, with checkpoints in DATA_DIR/ckpt-*. ``--kill-at`` trains the bucketed
shards only, into a second checkpoint folder, and ends the process hard after that step's
checkpoint; ``--resume`` trains them again from that folder. The first token of every
example is its id + 1.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf  # noqa: E402  (after tpu_helpers through records below)

from tpu_helpers.data import records, text
from tpu_helpers.tf_engine.custom_loop import CustomLoop

PER_REPLICA = 8
EPOCHS = 2


class Pooled(tf.keras.Model):
    """Mean of token embeddings, then a dense layer: the smallest model a width reaches."""

    def __init__(self):
        super().__init__()
        init = tf.keras.initializers.RandomNormal(seed=1)
        self.embed = tf.keras.layers.Embedding(1000, 8, embeddings_initializer=init)
        self.out = tf.keras.layers.Dense(2, kernel_initializer=tf.keras.initializers.Zeros())

    def call(self, features, training=False):
        mask = tf.cast(features["attention_mask"], tf.float32)[..., None]
        pooled = tf.reduce_sum(self.embed(features["input_ids"]) * mask, 1)
        return self.out(pooled / tf.maximum(tf.reduce_sum(mask, 1), 1.0))


def split_in_memory(data_dir):
    with open(f"{data_dir}/split.json") as f:
        return json.load(f)


def observe(strategy, dataset):
    """Per step: this host's (width, ids, weights), from the distributed dataset."""
    steps = []
    for features, _, weights in dataset:
        ids = strategy.experimental_local_results(features["input_ids"])
        w = strategy.experimental_local_results(weights)
        steps.append(
            [
                [int(i.shape[1]), (i.numpy()[:, 0] - 1).tolist(), x.numpy().tolist()]
                for i, x in zip(ids, w, strict=True)
            ]
        )
    return steps


def train(strategy, batches, checkpoint_dir=None, kill_at=None):
    with strategy.scope():
        model = Pooled()
        optimizer = tf.keras.optimizers.SGD(0.5)
    global_batch = PER_REPLICA * strategy.num_replicas_in_sync
    assert batches.global_batch == global_batch
    loop = CustomLoop(strategy, model, optimizer, global_batch, checkpoint_dir, steps_per_call=2)
    resumed_at = loop.restore() if checkpoint_dir else 0

    def log(message):
        print(message, flush=True)
        if kill_at is not None and message.startswith(f"checkpoint step {kill_at}:"):
            os._exit(3)  # a host preempted right after a checkpoint

    loop.fit(batches, EPOCHS, checkpoint_every=3, log=log)
    weights = [float(np.abs(w).sum()) for w in model.get_weights()]
    return {"resumed_at": resumed_at, "final_step": loop.step, "weights": weights}


def main(data_dir, out, kill_at=None, resume=False):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result = {"task": task, "replicas": strategy.num_replicas_in_sync}
    split = split_in_memory(data_dir)
    boundaries = text.choose_boundaries(split["length"], 3)
    bucketed = records.open_records(f"{data_dir}/bucketed")
    fixed = records.open_records(f"{data_dir}/fixed")
    widths = text.choose_boundaries(records.record_lengths(bucketed), 3)
    global_batch = PER_REPLICA * strategy.num_replicas_in_sync

    def from_records(source, **kw):
        return records.read_records(
            source,
            global_batch=global_batch,
            seed=7,
            shared_filesystem=True,  # both "hosts" see this machine's disk
            **kw,
        )

    sources = {  # one plan each; every epoch, from any step, is batches.distribute(...)
        "in_memory": text.text_batches(
            split, global_batch=global_batch, boundaries=boundaries, seed=0
        ),
        "bucketed": from_records(bucketed, boundaries=widths),
        "fixed": from_records(fixed),
    }
    interrupted = kill_at is not None or resume
    for name, batches in sources.items():
        if interrupted and name != "bucketed":
            continue
        steps = batches.steps_on(strategy)
        entry = {"steps_per_epoch": steps, "one_host_steps": batches.steps_per_epoch}
        if not interrupted:
            entry["epochs"] = [
                observe(strategy, batches.distribute(strategy, e)) for e in range(EPOCHS)
            ]
            entry["resumed_epoch"] = observe(
                strategy, batches.distribute(strategy, 1, skip_steps=2)
            )
        if name in ("bucketed", "fixed"):
            plan = records.plan_reads(
                bucketed if name == "bucketed" else fixed,
                PER_REPLICA,
                widths if name == "bucketed" else None,
                pipelines=2,
            )
            entry["files"] = sorted(p for paths in plan.files[task] for p in paths)
        checkpoint_dir = f"{data_dir}/ckpt-{name}-{'killed' if interrupted else 'whole'}-{task}"
        entry["training"] = train(strategy, batches, checkpoint_dir, kill_at)
        result[name] = entry
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    kill = int(sys.argv[sys.argv.index("--kill-at") + 1]) if "--kill-at" in sys.argv else None
    main(sys.argv[1], sys.argv[2], kill, "--resume" in sys.argv)
