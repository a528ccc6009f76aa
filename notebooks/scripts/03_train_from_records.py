"""Notebook 03's training from TFRecord shards, as the script every host of a pod slice runs.

Every host starts the same program. It joins the others (``jax.distributed.initialize()``),
reads only its own shards of the records notebook 03 wrote (``records.read_records``: the
plan of which host reads which shard is derived from the metadata, the same on every
host), puts its rows of each global batch on its own chips, and trains with
``keras3.fit_resumable``, which saves the run in ``OUTPUT/checkpoints``: started again
after a lost host, it goes on from the last save. The first host then writes the model in
the hub's layout to ``OUTPUT/model``.

On a slice (notebook 03's last section says how to create one and copy the records)::

    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command \\
      "python3 03_train_from_records.py --slice --records gs://BUCKET/cola/helper \\
       --checkpoint distilbert-base-cased --output gs://BUCKET/cola-run"

On one machine's CPU, two processes of four simulated devices each stand in for two hosts
(what ``tests/test_keras3.py`` runs)::

    python 03_train_from_records.py --records DIR --checkpoint CKPT --output OUT \\
      --simulated-devices 4 --coordinator 127.0.0.1:23456 --processes 2 --process-id 0
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", required=True, help="the folder of train.metadata.json")
    parser.add_argument("--checkpoint", required=True, help="the model: a hub name or folder")
    parser.add_argument("--output", required=True, help="a folder every host can read")
    parser.add_argument("--num-labels", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--per-replica-batch",
        type=int,
        default=4,
        help="rows a chip takes a step (4 on a v5e-32: 128 a step, notebook 03's on a v5e-8)",
    )
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--max-widths", type=int, default=4, help="padding widths at most")
    parser.add_argument("--steps-per-execution", type=int, default=32)
    parser.add_argument("--every-minutes", type=float, default=10.0, help="between saves")
    parser.add_argument("--float32", action="store_true", help="not mixed bfloat16")
    parser.add_argument("--slice", action="store_true", help="join the slice's other hosts")
    rehearsal = parser.add_argument_group("several processes on one machine's CPU")
    rehearsal.add_argument("--simulated-devices", type=int, default=0, help="per process")
    rehearsal.add_argument("--coordinator", default="", help="HOST:PORT of process 0")
    rehearsal.add_argument("--processes", type=int, default=1)
    rehearsal.add_argument("--process-id", type=int, default=0)
    return parser.parse_args(argv)


def join(args):
    """Join the other hosts before JAX's backend starts: on a TPU slice JAX finds them
    itself; CPU processes are told the coordinator and talk over gloo."""
    import jax

    if args.coordinator:
        from tpu_helpers.keras3.distribution import simulation_env

        count = "--xla_force_host_platform_device_count"  # this process's own, not inherited
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
        os.environ["XLA_FLAGS"] = " ".join(flags)
        os.environ.update(simulation_env(args.simulated_devices or 1))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator, num_processes=args.processes, process_id=args.process_id
        )
    elif args.slice:
        jax.distributed.initialize()


def main(argv=None):
    args = arguments(argv)
    join(args)
    import jax
    import keras

    from tpu_helpers import keras3
    from tpu_helpers.data import records, text
    from tpu_helpers.keras3.distribution import all_processes_reach

    devices = keras3.devices(args.simulated_devices)  # every host's chips
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    if not args.float32:
        keras.config.set_dtype_policy("mixed_bfloat16")
    source = records.open_records(f"{args.records.rstrip('/')}/train.metadata.json")
    boundaries = text.choose_boundaries(
        records.record_lengths(source), max_shapes=args.max_widths, max_length=args.max_length
    )
    train = records.read_records(
        source,
        global_batch=text.global_batch_size(args.per_replica_batch, len(devices)),
        boundaries=boundaries,
        seed=0,
        num_labels=args.num_labels,
        shared_filesystem=bool(args.coordinator),  # one machine's folder: every process reads it
    )
    model = keras3.classifier(args.checkpoint, num_labels=args.num_labels)
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
        steps_per_execution=args.steps_per_execution,
    )
    output = args.output.rstrip("/")
    history = keras3.fit_resumable(
        model,
        train,
        args.epochs,
        f"{output}/checkpoints",
        every_minutes=args.every_minutes,
        run={"model": args.checkpoint, "records": source.num_records},
    )
    if jax.process_index() == 0:  # the first host writes; the others wait for it
        keras3.save_hub_layout(model, f"{output}/model")
        print(f"saved the model in the hub's layout: {output}/model")
    all_processes_reach("model saved")  # no host ends well before the model is written
    print(f"process {jax.process_index()} of {jax.process_count()}: loss {history['loss']}")


if __name__ == "__main__":
    main()
