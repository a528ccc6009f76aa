"""Packed fine-tuning against notebook 01's bucketed batches, on the Keras 3 engine.

    python benchmarks/packing_keras3.py [--examples 8000] [--epochs 3] [--replicas 1]
                                        [--task single|pairs|both]

Run it in the Keras 3 stack (``STACK=keras3 bash -c 'source tools/env.sh; python ...'``).
The data are ``benchmarks/packing.py``'s (the CoLA-like single sentences, the MRPC-like
pairs, up to 128 tokens); the model a BERT classifier of the proportions that benchmark
uses (hidden size 256, 4 heads, 2 layers, feed-forward 1024), written in the hub's layout
with random weights (speed does not depend on them) and loaded by ``keras3.classifier``.

Every run goes through the engine's own path, ``keras3.fit_resumable`` with
``steps_per_execution=32`` in float32: notebook 01's batches (32 rows of the 4 widths
chosen from the data, in runs of one width) for the classifier, and packed rows of width
64 (widened to the longest example; at most 16 examples a row) for
``keras3.packed_classifier`` of the same classifier, two ways (``ROWS``): about as many
examples a step as the bucketed batches (notebook 07's ``packing.rows_per_replica``), and
32 rows, the shape of the bucketed run's widest batch. The first epoch pays for compiling
and is left out; the figure is the real (non-padding) tokens of an epoch over its
seconds, the mean of the later epochs, and the ratio packed / bucketed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from packing import TASKS, load, shares  # noqa: E402

SIZE = {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024}
WIDTH, STEPS_PER_EXECUTION, BATCH = 64, 32, 32
#: Packed rows per device, two ways: about as many examples a step as the bucketed batches
#: (as notebook 07 trains: the same steps, schedule and per-step costs), and the bucketed
#: run's widest batch (``BATCH`` rows of the row width: the same largest shape, so the
#: same memory on a TPU, with about five times the examples a step).
ROWS = {"as many examples": None, "the widest batch's shape": BATCH}  # None: rows_per_replica


def wider_checkpoint(tiny: Path, folder: Path) -> Path:
    """The tiny BERT fixture at ``SIZE``: its config with those sizes, and random weights of
    the shapes they give under the fixture's own names (PyTorch's layout), in one file.
    Every axis as long as the fixture's hidden or feed-forward size is taken for one (its
    vocabulary, positions and token types are other lengths; KerasHub's converter refuses
    a shape that does not fit the config)."""
    from safetensors.numpy import load_file

    from tpu_helpers.data.hub import write_hub_weights

    config = json.loads((tiny / "config.json").read_text())
    resize = {config["hidden_size"]: SIZE["hidden_size"]}
    resize[config["intermediate_size"]] = SIZE["intermediate_size"]
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.normal(0, 0.02, [resize.get(d, d) for d in array.shape]).astype("float32")
        for file in sorted(tiny.glob("*.safetensors"))  # one file, or shards
        for name, array in load_file(file).items()
    }
    write_hub_weights(tensors, folder)
    (folder / "config.json").write_text(json.dumps({**config, **SIZE}))
    for path in tiny.iterdir():  # the tokenizer's files
        if path.suffix in (".json", ".txt") and not path.name.startswith(("config", "model")):
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


class EpochClock:
    """Seconds per epoch, read where the engine calls the epoch's end (its state is back
    in the model's variables then: the epoch's steps have run)."""

    def __init__(self, keras):
        clock = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                clock.started = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                clock.seconds.append(time.perf_counter() - clock.started)

        self.seconds: list[float] = []
        self.callback = Callback()


def rate(model, batches, real_tokens: int, epochs: int, folder: str) -> float:
    """Real tokens per second of ``fit_resumable``'s later epochs."""
    import keras

    from tpu_helpers import keras3

    keras3.compile_classifier(model, 1e-4, steps_per_execution=STEPS_PER_EXECUTION)
    clock = EpochClock(keras)
    keras3.fit_resumable(
        model, batches, epochs, folder, every_minutes=None, callbacks=[clock.callback], verbose=0
    )
    return real_tokens / float(np.mean(clock.seconds[1:]))


def compare(checkpoint: Path, task: str, args, replicas: int) -> list[float]:
    """Real tokens/s of the bucketed run and of the packed ones (``ROWS``), printed with
    the ratios packed / bucketed; returns the ratios."""
    from tpu_helpers import keras3
    from tpu_helpers.data import hub, packing, text

    tokenized, _ = load(Path(args.fixtures), args.examples, task)
    tokenizer = hub.load_tokenizer(str(checkpoint))
    lengths = np.asarray(tokenized["length"])
    real = int(lengths.sum())
    boundaries = text.padding_boundaries(lengths, "buckets", 128)
    print(f"\n## {task}: {len(lengths):,} examples, {real:,} real tokens, {replicas} device(s)\n")
    shares(lengths, boundaries)
    types = tokenized["token_type_ids"] if "token_type_ids" in tokenized.column_names else None
    width = packing.row_width(lengths, WIDTH)
    bucketed = text.text_batches(
        tokenized,
        global_batch=BATCH,
        boundaries=boundaries,
        seed=0,
        group_widths=STEPS_PER_EXECUTION,
    )
    runs = {f"bucketed {boundaries}, {BATCH} rows": (lambda model: model, bucketed)}
    for layout, global_rows in ROWS.items():
        rows = global_rows or packing.rows_per_replica(lengths, BATCH // replicas, width) * replicas
        batches = packing.packed_batches(
            list(tokenized["input_ids"]),
            list(tokenized["label"]),
            width=width,
            global_batch=rows,
            epochs=args.epochs,
            max_per_row=16,
            pad_token_id=tokenizer.pad_token_id or 0,
            token_type_ids=types,
        )
        runs[f"packed, width {width}, {rows} rows ({layout})"] = (keras3.packed_classifier, batches)
    print("\n| training, Keras 3 engine | steps an epoch | real tokens/s |\n|---|---|---|")
    found = []
    for name, (wrap, batches) in runs.items():
        model = wrap(keras3.classifier(checkpoint, num_labels=2, verbose=False))
        with tempfile.TemporaryDirectory() as folder:
            found.append(rate(model, batches, real, args.epochs, folder))
        print(f"| {name} | {batches.steps_per_epoch} | {found[-1]:,.0f} |")
    ratios = [packed / found[0] for packed in found[1:]]
    for layout, ratio in zip(ROWS, ratios, strict=True):
        print(
            f"packed ({layout}) / bucketed, real tokens/s ({task}, {replicas} device(s)): {ratio:.2f}"
        )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=8000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures-full"))
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error(f"--epochs {args.epochs}: the first epoch compiles; give 2 or more")

    from tpu_helpers import keras3
    from tpu_helpers.teaching.fixtures import build_fixtures

    build_fixtures(args.fixtures, verbose=False, full_splits=True)
    keras3.connect(args.replicas)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = wider_checkpoint(Path(args.fixtures) / "tiny-bert", Path(folder))
        for task in TASKS if args.task == "both" else [args.task]:
            compare(checkpoint, task, args, args.replicas)


if __name__ == "__main__":
    main()
