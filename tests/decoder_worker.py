"""LoRA-tune the tiny Qwen 3 as notebook 10 does, for ``test_decoders``: the notebook's
layout map over a (batch 2, model 4) mesh of 8 devices, its packed model, LoRA on the
attention, ``keras3.fit_resumable`` saving every 3 steps; uninterrupted, or killed with
SIGKILL after step ``--kill-at`` of the first epoch. Writes the LoRA weights (``--out``,
.npz) and, beside them (.json), the history, the weights no layout splits over ``model``
and what the newest save left out.

    python tests/decoder_worker.py FIXTURES --dir CKPT --out lora.npz [--kill-at 5]
"""

import argparse
import json
from pathlib import Path

import numpy as np

from tpu_helpers import keras3

ROWS, WIDTH, BATCH = 24, 32, 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("fixtures")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()

    devices = keras3.devices(8)
    import keras
    from keras3_worker import fit_until_killed
    from test_decoders import load, notebook_layout, packed_model, per_token_weights

    from tpu_helpers.core import pipeline
    from tpu_helpers.llm import decoders

    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=notebook_layout(mesh), batch_dim_name="batch")
    )
    lm = load(Path(args.fixtures) / "tiny-qwen3")
    keras.utils.set_random_seed(0)  # LoRA's A is drawn: the same in every run
    lm.backbone.enable_lora(4)
    model = packed_model(lm, Path(args.fixtures) / "tiny-qwen3", WIDTH)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100),
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 300, (ROWS, WIDTH)).astype("int32")
    segments = np.repeat(np.arange(1, 5), WIDTH // 4)[None].repeat(ROWS, 0).astype("int32")
    labels = np.where(rng.random((ROWS, WIDTH)) < 0.5, np.roll(tokens, -1, 1), -100).astype("int32")
    batches = pipeline.from_arrays(
        {"token_ids": tokens, "segment_ids": segments}, labels, global_batch=BATCH, seed=0
    ).with_transform(per_token_weights)

    history, examples = fit_until_killed(model, batches, args.dir, args.kill_at)  # 4 a row
    np.savez(args.out, *[np.asarray(v.value) for v in lm.backbone.trainable_weights])
    missed = decoders.replicated_weights(lm, min_elements=512)
    newest = json.loads((Path(args.dir) / "latest.json").read_text())["file"]
    saved = np.load(Path(args.dir) / newest)  # what the newest save holds
    report = {"replicated": missed, "examples_per_epoch": examples}
    frozen = [w for w in lm.backbone.non_trainable_weights if np.prod(w.shape) >= 1024]
    order = [*model.trainable_variables, *model.non_trainable_variables]  # the saves' order
    report["left_out"] = sorted(order[int(i)].path for i in saved["unchanged"][:, 0])
    report["large_frozen"] = sorted(w.path for w in frozen)
    with open(args.out.removesuffix(".npz") + ".json", "w") as f:
        json.dump({**history, **report}, f)


if __name__ == "__main__":
    main()
