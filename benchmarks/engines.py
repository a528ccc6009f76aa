"""Training throughput of the two engines side by side, on the same data, on CPU: the TF
engine (transformers 4's TF class, tf-keras) and the Keras 3 engine (KerasHub on JAX).

    python benchmarks/engines.py [--epochs 3] [--replicas 1 8] [--examples 8551]

Each engine runs in its own stack (``.venv`` and ``.venv-keras3``, made by ``tools/env.sh``;
another Python with ``--tf-python`` / ``--keras3-python``), one after the other, at each
number of (simulated) devices: the tiny DistilBERT fixture (PyTorch-named safetensors, read
by both) fine-tuned on the CoLA-like fixture with notebook 01's batches (widths chosen from
the data, full batches of 32, weight-0 fillers, the same shuffle, in runs of one width),
Adam, ``steps_per_execution=32``, float32, through each engine's ``fit_resumable`` (saves
at epoch ends only). The first epoch pays for tracing and compiling and is reported apart;
the throughput is the mean of the later epochs: examples/s and real (non-padding)
tokens/s, and the ratio Keras 3 / TF; for the Keras 3 engine, the compilations after the
first epoch too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH, STEPS_PER_EXECUTION, MAX_LENGTH = 32, 32, 128


def batches(fixtures: Path, examples: int):
    """Notebook 01's training batches of the CoLA-like fixture, in runs of one width of
    ``steps_per_execution`` batches, and its real tokens."""
    from tpu_helpers.data import hub, text

    data = text.load_text_dataset(str(fixtures / "cola"))
    tokenizer = hub.load_tokenizer(str(fixtures / "tiny-distilbert"))
    train = text.tokenize(data["train"].select(range(examples)), tokenizer, MAX_LENGTH)
    widths = text.padding_boundaries(train["length"], "buckets", MAX_LENGTH)
    plan = text.text_batches(
        train,
        global_batch=BATCH,
        boundaries=widths,
        seed=0,
        num_labels=2,
        group_widths=STEPS_PER_EXECUTION,
    )
    return plan, int(sum(train["length"]))


def tf_model(checkpoint: str, replicas: int):
    import tensorflow as tf
    from transformers import TFAutoModelForSequenceClassification

    import tpu_helpers
    from tpu_helpers.tf_engine import tf_classes

    strategy = tpu_helpers.connect(simulated_replicas=replicas)
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf_classes.from_pretrained(
            TFAutoModelForSequenceClassification, checkpoint, num_labels=2
        )
        model.compile(
            optimizer=tf.keras.optimizers.Adam(1e-3),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
            steps_per_execution=STEPS_PER_EXECUTION,
        )
    return model


def keras3_model(checkpoint: str, replicas: int):
    from tpu_helpers import keras3

    keras3.connect(replicas)
    model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
    return keras3.compile_classifier(model, 1e-3, steps_per_execution=STEPS_PER_EXECUTION)


def worker(args) -> None:
    """One engine's run: prints one JSON line of its figures."""
    import tempfile

    import tpu_helpers  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow, on the TF stack)

    fixtures = Path(args.fixtures)
    build = tf_model if args.worker == "tf" else keras3_model
    # the devices first: TensorFlow splits the CPU only before it runs anything
    model = build(str(fixtures / "tiny-distilbert"), args.replicas)
    plan, tokens = batches(fixtures, args.examples)
    if args.worker == "tf":  # each engine's entry to the one loop of both, engine.fit_with
        from tpu_helpers.tf_engine.trainer import fit_resumable

        callback_base = __import__("tensorflow").keras.callbacks.Callback
    else:
        from tpu_helpers.keras3 import fit_resumable

        callback_base = __import__("keras").callbacks.Callback
    seconds, compiles = [], []

    class Clock(callback_base):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)
            steps = getattr(model, "_tpu_helpers_steps", None)
            compiles.append(sum(steps.compiles.values()) if steps else None)

    with tempfile.TemporaryDirectory() as folder:
        fit_resumable(
            model,
            plan,
            args.epochs,
            folder,
            every_minutes=0,
            callbacks=[Clock()],
            verbose=0,
            log=lambda _: None,
        )
    later = sum(seconds[1:]) / len(seconds[1:])
    print(
        json.dumps(
            {
                "engine": args.worker,
                "first_epoch_s": round(seconds[0], 2),
                "epoch_s": round(later, 3),
                "examples_per_s": plan.examples / later,
                "real_tokens_per_s": tokens / later,
                "steps": plan.steps_per_epoch,
                "compiles_after_first": (
                    None if compiles[0] is None else compiles[-1] - compiles[0]
                ),
            }
        )
    )


def run(engine: str, python: str, args) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if engine == "keras3":
        env.update(KERAS_BACKEND="jax")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each run compiles, as a first run does
    command = [python, __file__, "--worker", engine, "--fixtures", str(args.fixtures)]
    command += ["--epochs", str(args.epochs), "--replicas", str(args.replicas)]
    command += ["--examples", str(args.examples)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        sys.exit(f"the {engine} engine's run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="at least 2 (the first compiles)")
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1, 8], help="simulated devices, both engines"
    )
    parser.add_argument("--examples", type=int, default=8551)
    parser.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures-full"))
    parser.add_argument("--tf-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--keras3-python", default=str(ROOT / ".venv-keras3" / "bin" / "python"))
    parser.add_argument("--worker", choices=("tf", "keras3"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs: 2 or more (the first epoch compiles and is reported apart)")
    if args.worker:
        args.replicas = args.replicas[0]
        worker(args)
        return
    build = "from tpu_helpers.teaching.fixtures import build_fixtures as b; import sys"
    build += "; b(sys.argv[1], verbose=False, full_splits=True)"  # in the TF stack's Python
    subprocess.run([args.tf_python, "-c", build, args.fixtures], check=True)
    print(
        f"tiny DistilBERT, {args.examples} CoLA-like sentences, global batch {BATCH},"
        f" steps_per_execution {STEPS_PER_EXECUTION}, float32, CPU; later"
        f" {args.epochs - 1} epoch(s) averaged"
    )
    header = f"{'devices':>8} {'engine':<8}{'first epoch s':>15}{'epoch s':>10}"
    print(f"{header}{'examples/s':>13}{'real tokens/s':>16}{'compiles after 1st':>20}")
    ratios = []
    for replicas in args.replicas:
        args.replicas = replicas
        figures = [run("tf", args.tf_python, args), run("keras3", args.keras3_python, args)]
        for f in figures:
            after = "-" if f["compiles_after_first"] is None else f["compiles_after_first"]
            print(
                f"{replicas:>8} {f['engine']:<8}{f['first_epoch_s']:>15.1f}{f['epoch_s']:>10.2f}"
                f"{f['examples_per_s']:>13,.0f}{f['real_tokens_per_s']:>16,.0f}{after:>20}"
            )
        tf_, k3 = figures
        ratios.append(
            f"{replicas} device(s): Keras 3 / TF"
            f" {k3['real_tokens_per_s'] / tf_['real_tokens_per_s']:.2f}x real tokens/s,"
            f" {k3['first_epoch_s'] / tf_['first_epoch_s']:.2f}x the first epoch's time"
        )
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
