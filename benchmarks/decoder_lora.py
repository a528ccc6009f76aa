"""Notebook 10's LoRA step through the Keras 3 engine (``keras3.steps.Steps``, the step
``fit_resumable`` runs) beside a hand-written jitted JAX LoRA step (``stateless_call``,
``jax.value_and_grad`` over the LoRA weights, ``optimizer.stateless_apply``) on the same
packed model and batches: real tokens/s and the ratio, at each device count, printed side by
side in one run (each count in a process of its own: JAX fixes its devices at start).

    python benchmarks/decoder_lora.py                    # a small Qwen 3 written here, 1 and 8
    python benchmarks/decoder_lora.py --checkpoint DIR --devices 1 --model-axis 1 --width 512

The model is notebook 10's: the hub's files read by KerasHub, its layout map over a
(batch, model) mesh, LoRA on the attention, its packed model (the page's own cells, run by
``tests/test_decoders.py``).
The engine's figure includes putting each batch on the devices (its feeding thread); the
hand-written step's batches are put there before the clock starts. Off a TPU or GPU the
devices are simulated CPU devices; a count the machine lacks is skipped.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_count(a):
    """Time both steps at ``a.devices`` devices; print one JSON line."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tpu_helpers import keras3

    devices = keras3.devices(a.devices)[: a.devices]  # simulated ones off a TPU or GPU
    if len(devices) < a.devices:
        print("RESULT", json.dumps({"devices": a.devices, "skipped": f"{len(devices)} found"}))
        return
    import jax
    import keras
    import numpy as np
    from keras3_step import Epoch  # what Steps reads of a tf.data.Dataset, in memory
    from test_decoders import load, notebook_layout, packed_model

    from tpu_helpers.keras3.steps import Steps

    mesh = keras.distribution.DeviceMesh(
        (len(devices) // a.model_axis, a.model_axis), ("batch", "model"), devices
    )
    config = json.loads((Path(a.checkpoint) / "config.json").read_text())
    layout = notebook_layout(mesh, gemma=config["model_type"] == "gemma3_text")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    )
    lm = load(Path(a.checkpoint))
    keras.utils.set_random_seed(0)
    lm.backbone.enable_lora(a.rank)
    model = packed_model(lm, Path(a.checkpoint), a.width)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100),
        steps_per_execution=a.per_call,
    )
    rng = np.random.default_rng(0)
    vocab = lm.backbone.vocabulary_size
    data = []
    for _ in range(a.steps):
        ids = rng.integers(5, vocab, (a.rows, a.width)).astype("int32")
        segments = np.repeat(np.arange(1, 5), a.width // 4)[None].repeat(a.rows, 0).astype("int32")
        labels = np.where(rng.random(ids.shape) < 0.6, np.roll(ids, -1, 1), -100).astype("int32")
        data.append(
            ({"token_ids": ids, "segment_ids": segments}, labels, np.ones(ids.shape, "float32"))
        )
    tokens = a.steps * a.rows * a.width  # every token of a packed row is real here

    steps = Steps.of(model)
    steps.build(data[0])
    box = {"state": steps.state()}

    def engine():
        box["state"], _ = steps.train(box["state"], Epoch(data), a.steps)

    optimizer = keras.optimizers.AdamW(1e-3)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)

    def loss(tv, ntv, x, y):
        logits, ntv = model.stateless_call(tv, ntv, x, training=True)
        return loss_fn(y, logits), ntv

    @jax.jit
    def step(tv, ntv, ov, x, y):
        (value, ntv), grads = jax.value_and_grad(loss, has_aux=True)(tv, ntv, x, y)
        tv, ov = optimizer.stateless_apply(ov, grads, tv)
        return tv, ntv, ov, value

    split = jax.sharding.NamedSharding(mesh.backend_mesh, jax.sharding.PartitionSpec("batch"))
    placed = [jax.device_put((x, y), split) for x, y, _ in data]
    hand = {
        "s": (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
    }

    def handwritten():
        tv, ntv, ov = hand["s"]
        for x, y in placed:
            tv, ntv, ov, _ = step(tv, ntv, ov, x, y)
        jax.block_until_ready(tv)
        hand["s"] = (tv, ntv, ov)

    out = {
        "devices": len(devices),
        "mesh": [len(devices) // a.model_axis, a.model_axis],
        "platform": devices[0].platform,
        "jax": jax.__version__,
        "keras": keras.__version__,
    }
    for label, run in (("engine", engine), ("handwritten", handwritten)):
        run()  # compiles
        best = min(_seconds(run) for _ in range(3))
        out[label] = round(tokens / best)
    out["engine_over_handwritten"] = round(out["engine"] / out["handwritten"], 3)
    print("RESULT", json.dumps(out), flush=True)


def _seconds(run):
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default="")
    p.add_argument("--devices", default="1,8")
    p.add_argument("--model-axis", type=int, default=0, help="0: 1 on one device, 4 on more")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--per-call", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        a.devices = int(a.devices)
        one_count(a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not a.checkpoint:  # a small Qwen 3: 4 layers of 256, written as the hub serves it
            from tpu_helpers.llm import fixtures as d

            a.checkpoint = f"{tmp}/small-qwen3"
            d.write_tiny_decoder(
                Path(a.checkpoint),
                "qwen3",
                d.decoder_corpus(),
                0,
                1 << 22,
                hidden_size=256,
                intermediate_size=768,
                num_hidden_layers=4,
                head_dim=32,
            )
        rows = []
        for count in map(int, a.devices.split(",")):
            axis = a.model_axis or (1 if count == 1 else 4)
            command = [
                sys.executable,
                __file__,
                "--one",
                "--devices",
                str(count),
                "--model-axis",
                str(axis),
                "--checkpoint",
                a.checkpoint,
                "--rows",
                str(a.rows),
                "--width",
                str(a.width),
                "--steps",
                str(a.steps),
                "--per-call",
                str(a.per_call),
                "--rank",
                str(a.rank),
            ]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
            if line is None:
                sys.exit(f"{count} devices failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(line.removeprefix("RESULT ")))
    print(f"{'devices':>8} {'mesh':>7} {'engine tokens/s':>16} {'hand-written':>13} {'ratio':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['devices']:>8} skipped: {r['skipped']}")
            continue
        mesh = "x".join(map(str, r["mesh"]))
        print(
            f"{r['devices']:>8} {mesh:>7} {r['engine']:>16,} {r['handwritten']:>13,} {r['engine_over_handwritten']:>6.2f}"
        )
    print("RESULTS", json.dumps(rows))


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "jax")
    main()
