"""Fine-tune the tiny DistilBERT on the Keras 3 engine with ``keras3.fit_resumable``, for
``test_keras3``: on notebook 01's bucketed batches of the CoLA-like fixture, 8 devices,
two steps fused per call, saving every 3 steps; uninterrupted, or killed with SIGKILL at
the end of the first call of the first epoch that reaches ``--kill-at`` steps. Writes the
final weights (``--out``, .npz) and the history (the same name, .json). With
``--processes 2``, one of two JAX processes on loopback (a pod slice's two hosts, each with
``--devices`` of its own, JAX's CPU collectives between them); each writes its weights
(``-1`` added to the name of the second's). With ``--records DIR``, from the TFRecord
shards of those rows in ``DIR`` (each host reading its own shards); ``--as-hosts 2`` trains
one process on the global batches that two such hosts make together.

    python tests/keras3_worker.py FIXTURES --dir CKPT --out weights.npz [--kill-at 7]
    python tests/keras3_worker.py FIXTURES --dir CKPT --out w.npz --devices 4 \
        --processes 2 --process-id 0 --port 23456 [--records SHARDS]
    python tests/keras3_worker.py FIXTURES --dir CKPT --out w.npz --records SHARDS --as-hosts 2
"""

import argparse
import json
import os
import re
import signal

import numpy as np

from tpu_helpers import keras3
from tpu_helpers.core import pipeline
from tpu_helpers.data import hub, records, text
from tpu_helpers.keras3.distribution import simulation_env

EPOCHS, BATCH, ROWS = 2, 16, 96
EXAMPLES = re.compile(r"epoch \d+: .* ([\d,]+) examples,")  # the engine's epoch line


def rows(fixtures):
    """The tokenized rows the worker trains on, and their padding widths."""
    data = text.load_text_dataset(f"{fixtures}/cola")
    tokenizer = hub.load_tokenizer(f"{fixtures}/tiny-distilbert")
    tokenized = text.tokenize(data["train"].select(range(ROWS)), tokenizer, 64)
    lengths = np.asarray(tokenized["length"])
    return tokenized, text.choose_boundaries(lengths, max_shapes=3, max_length=64)


def killer(kill_at: int):
    """A callback that kills this process with SIGKILL at the end of the first call of the
    first epoch that reaches ``kill_at`` steps (0: never)."""
    import keras

    class Killer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            # batch: the call's last step of the epoch
            if kill_at and self.epoch == 0 and batch + 1 >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    return Killer()


def examples_per_epoch(lines) -> list[int]:
    """The examples each of the engine's epoch lines counts."""
    return [int(m[1].replace(",", "")) for m in map(EXAMPLES.search, lines) if m]


def fit_until_killed(model, batches, directory: str, kill_at: int) -> tuple[dict, list[int]]:
    """``keras3.fit_resumable`` for ``EPOCHS`` epochs, saving every 3 steps, this process
    killed after step ``kill_at`` (0: never): the history and each epoch line's examples."""
    lines = []
    history = keras3.fit_resumable(
        model,
        batches,
        EPOCHS,
        directory,
        every_steps=3,
        callbacks=[killer(kill_at)],
        log=lines.append,
    )
    return history, examples_per_epoch(lines)


def as_hosts(batches, hosts, devices):
    """The global batches that ``hosts`` hosts of ``devices // hosts`` devices make together
    from ``batches`` (each its own rows, its own shards), as one process's ``Batches``."""
    import tensorflow as tf

    def build(epoch, skip_steps, context):
        parts = [
            batches.host_dataset(epoch, skip_steps=skip_steps, hosts=hosts, host=h, devices=devices)
            for h in range(hosts)
        ]
        joined = tf.data.Dataset.zip(tuple(parts))
        return joined.map(lambda *p: tf.nest.map_structure(lambda *t: tf.concat(t, 0), *p))

    steps = batches.steps_on_hosts(hosts, devices)
    return pipeline.Batches(build, steps, batches.global_batch, widths=batches.widths)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("fixtures")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--records", default="")
    parser.add_argument("--as-hosts", type=int, default=1)
    args = parser.parse_args()

    if args.processes > 1:  # before JAX's backend starts, as on a pod slice's hosts
        import jax

        os.environ.pop("XLA_FLAGS", None)  # each process's own count, not the leg's 8
        os.environ.update(simulation_env(args.devices))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.process_id
        )
    keras3.connect(args.devices)

    checkpoint = f"{args.fixtures}/tiny-distilbert"
    tokenized, boundaries = rows(args.fixtures)
    if args.records:  # every host reads its own shards of the same folder
        train = records.read_records(
            f"{args.records}/train.metadata.json",
            global_batch=BATCH,
            boundaries=boundaries,
            seed=0,
            shared_filesystem=True,
        )
    else:
        train = text.text_batches(
            tokenized, global_batch=BATCH, boundaries=boundaries, seed=0, group_widths=2
        )
    if args.as_hosts > 1:
        train = as_hosts(train, args.as_hosts, args.devices)

    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(model, 1e-3, steps_per_execution=2)

    history, examples = fit_until_killed(model, train, args.dir, args.kill_at)
    out = args.out.removesuffix(".npz") + (f"-{args.process_id}" if args.process_id else "")
    np.savez(f"{out}.npz", *[np.asarray(v.value) for v in model.weights])
    with open(f"{out}.json", "w") as f:  # with the examples each epoch line counts
        json.dump({**history, "examples_per_epoch": examples}, f)


if __name__ == "__main__":
    main()
