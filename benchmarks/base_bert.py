#!/usr/bin/env python3
"""Write a random BERT sequence classifier in the Hugging Face hub's layout, for timing
an engine at a real model's size where no hub is reachable (``benchmarks/keras3_step.py``).

    python benchmarks/base_bert.py FOLDER [--layers N] [--hidden H] [--heads A]
                                          [--intermediate I] [--seed S]

FOLDER gets ``config.json`` and ``model.safetensors`` exactly as
``BertForSequenceClassification.save_pretrained`` writes them (PyTorch tensor names,
Linear weights ``[out, in]``, float32, metadata ``{"format": "pt"}``). Without options the
model is BERT-base (12 layers, 768 hidden, 12 heads, 3072 intermediate, ~110M parameters).

Weights: Linear and embedding weights random normal * 0.02 (``initializer_range``),
biases 0, LayerNorm weight 1 / bias 0. Needs only numpy and safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

VOCAB_SIZE = 30522
MAX_POSITIONS = 512
TYPE_VOCAB_SIZE = 2
NUM_LABELS = 2
INIT_RANGE = 0.02


def config(layers: int, hidden: int, heads: int, intermediate: int) -> dict:
    labels = {i: f"LABEL_{i}" for i in range(NUM_LABELS)}
    return {
        "architectures": ["BertForSequenceClassification"],
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": hidden,
        "id2label": {str(i): name for i, name in labels.items()},
        "initializer_range": INIT_RANGE,
        "intermediate_size": intermediate,
        "label2id": {name: i for i, name in labels.items()},
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": "bert",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
        "transformers_version": "4.46.0",
        "type_vocab_size": TYPE_VOCAB_SIZE,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def tensors(layers: int, hidden: int, intermediate: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * INIT_RANGE).astype(np.float32)

    def zeros(*shape):
        return np.zeros(shape, np.float32)

    def ones(*shape):
        return np.ones(shape, np.float32)

    out = {}

    def linear(name, n_out, n_in):  # PyTorch nn.Linear: weight [out, in]
        out[f"{name}.weight"] = normal(n_out, n_in)
        out[f"{name}.bias"] = zeros(n_out)

    def layer_norm(name, n):
        out[f"{name}.weight"] = ones(n)
        out[f"{name}.bias"] = zeros(n)

    e = "bert.embeddings"
    out[f"{e}.word_embeddings.weight"] = normal(VOCAB_SIZE, hidden)
    out[f"{e}.word_embeddings.weight"][0] = 0.0  # padding_idx=0 row, as transformers zeroes it
    out[f"{e}.position_embeddings.weight"] = normal(MAX_POSITIONS, hidden)
    out[f"{e}.token_type_embeddings.weight"] = normal(TYPE_VOCAB_SIZE, hidden)
    layer_norm(f"{e}.LayerNorm", hidden)
    for n in range(layers):
        p = f"bert.encoder.layer.{n}"
        for part in ("query", "key", "value"):
            linear(f"{p}.attention.self.{part}", hidden, hidden)
        linear(f"{p}.attention.output.dense", hidden, hidden)
        layer_norm(f"{p}.attention.output.LayerNorm", hidden)
        linear(f"{p}.intermediate.dense", intermediate, hidden)
        linear(f"{p}.output.dense", hidden, intermediate)
        layer_norm(f"{p}.output.LayerNorm", hidden)
    linear("bert.pooler.dense", hidden, hidden)
    linear("classifier", NUM_LABELS, hidden)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.layers, args.hidden, args.heads, args.intermediate) < 1:
        parser.error("--layers, --hidden, --heads and --intermediate must be positive")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")

    os.makedirs(args.folder, exist_ok=True)
    cfg = config(args.layers, args.hidden, args.heads, args.intermediate)
    with open(os.path.join(args.folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    weights = tensors(args.layers, args.hidden, args.intermediate, args.seed)
    path = os.path.join(args.folder, "model.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    count = sum(int(t.size) for t in weights.values())
    print(
        f"wrote {args.folder}: bert {args.layers}x{args.hidden} ({args.heads} heads,"
        f" {args.intermediate} intermediate), {len(weights)} tensors,"
        f" {count:,} parameters, {os.path.getsize(path) / 2**20:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
