"""The Keras 3 engine's training step at BERT-base size on one accelerator, beside Keras'
own ``fit`` and a hand-written jitted JAX step on the same model and batches: steps/s,
real tokens/s and the ratios, printed in one run (and written to ``$OUT/time_steps.json``
where ``OUT`` is set).

    python benchmarks/base_bert.py /tmp/base-bert      # BERT-base in the hub's layout
    python benchmarks/keras3_step.py /tmp/base-bert [--batch 32] [--width 128] [--steps 64]

Needs Keras 3, KerasHub and JAX, not TensorFlow: the batches are in memory, handed to
``keras3.steps.Steps`` through the two methods it reads of a ``tf.data.Dataset``.
"""

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

from tpu_helpers import keras3  # noqa: E402


class Epoch:
    """What keras3.steps.Steps reads of a tf.data.Dataset (take, as_numpy_iterator), over
    batches in memory: no TensorFlow on this machine."""

    def __init__(self, batches):
        self.batches = batches

    def take(self, n):
        return Epoch(self.batches[:n])

    def as_numpy_iterator(self):
        return iter(self.batches)


def batches(n, batch, width, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(1000, 30000, (batch, width)).astype("int32")
        lengths = rng.integers(width // 2, width + 1, batch)
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype("int32")
        out.append(
            (
                {"input_ids": ids * mask, "attention_mask": mask},
                rng.integers(0, 2, batch).astype("int32"),
                np.ones(batch, "float32"),
            )
        )
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--per-call", type=int, default=32)
    p.add_argument("--float32", action="store_true")
    a = p.parse_args()
    import jax
    import keras

    keras3.connect()
    if not a.float32:
        keras.config.set_dtype_policy("mixed_bfloat16")
    data = batches(a.steps, a.batch, a.width)
    tokens = sum(int(m["attention_mask"].sum()) for m, _, _ in data)
    out = {
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "batch": a.batch,
        "width": a.width,
        "steps": a.steps,
        "precision": "float32" if a.float32 else "mixed_bfloat16",
    }

    def timed(run, label, repeats=3):
        run()  # compile
        seconds = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - t)
        best = min(seconds)
        out[label] = {"steps_per_s": a.steps / best, "real_tokens_per_s": tokens / best}
        print(label, json.dumps(out[label]), flush=True)

    # 1. the engine: keras3.steps.Steps, per_call steps fused per compiled call
    model = keras3.classifier(a.checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(model, 3e-5, steps_per_execution=a.per_call)
    from tpu_helpers.keras3.steps import Steps

    steps = Steps.of(model)
    steps.build(data[0])
    box = {"state": steps.state()}

    def engine():
        box["state"], _ = steps.train(box["state"], Epoch(data), a.steps)

    t = time.perf_counter()
    engine()
    out["engine_first_call_s"] = time.perf_counter() - t
    timed(engine, "engine_fused")

    # 2. the same engine, one step per call
    one = keras3.classifier(a.checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(one, 3e-5, steps_per_execution=1)
    single = Steps.of(one)
    single.build(data[0])
    box1 = {"state": single.state()}

    def engine_one():
        box1["state"], _ = single.train(box1["state"], Epoch(data), a.steps)

    timed(engine_one, "engine_one_step_per_call")

    # 3. Keras' own fit on the same arrays, steps_per_execution=per_call
    fit_model = keras3.classifier(a.checkpoint, num_labels=2, verbose=False)
    keras3.compile_classifier(fit_model, 3e-5, steps_per_execution=a.per_call)
    x = {k: np.concatenate([b[0][k] for b in data]) for k in data[0][0]}
    y = np.concatenate([b[1] for b in data])
    w = np.concatenate([b[2] for b in data])

    def keras_fit():
        fit_model.fit(x, y, sample_weight=w, batch_size=a.batch, epochs=1, verbose=0, shuffle=False)

    timed(keras_fit, "keras_fit")

    # 4. a hand-written jitted step: stateless_call, value_and_grad, stateless_apply,
    #    batches already on the device
    hand = keras3.classifier(a.checkpoint, num_labels=2, verbose=False)
    optimizer = keras.optimizers.Adam(3e-5)
    optimizer.build(hand.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(tv, ntv, x, y, w):
        logits, ntv = hand.stateless_call(tv, ntv, x, training=True)
        return loss_fn(y, logits, sample_weight=w), ntv

    @jax.jit
    def step(tv, ntv, ov, x, y, w):
        (value, ntv), grads = jax.value_and_grad(loss, has_aux=True)(tv, ntv, x, y, w)
        tv, ov = optimizer.stateless_apply(ov, grads, tv)
        return tv, ntv, ov, value

    placed = [jax.device_put(b) for b in data]
    hs = {
        "s": (
            [v.value for v in hand.trainable_variables],
            [v.value for v in hand.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
    }

    def handwritten():
        tv, ntv, ov = hs["s"]
        for x, y, w in placed:
            tv, ntv, ov, _ = step(tv, ntv, ov, x, y, w)
        jax.block_until_ready(tv)
        hs["s"] = (tv, ntv, ov)

    timed(handwritten, "handwritten_jit")
    e, f, h = (out[k]["steps_per_s"] for k in ("engine_fused", "keras_fit", "handwritten_jit"))
    out["engine_over_keras_fit"] = e / f
    out["engine_over_handwritten"] = e / h
    out["handwritten_over_keras_fit"] = h / f
    print("RESULT", json.dumps(out), flush=True)
    dest = os.environ.get("OUT")
    if dest:
        with open(f"{dest}/time_steps.json", "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
