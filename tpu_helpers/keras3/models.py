"""A classifier or masked LM from a checkpoint in the hub's layout, through KerasHub: the
encoder KerasHub converts, the head of the checkpoint's family rebuilt here (``HEADS``) and
read from the same files, and the compile settings of the notebooks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpu_helpers.core.errors import (
    CheckpointFormatError,
    EngineError,
    InputTypeError,
)
from tpu_helpers.core.families import (
    DISCRIMINATORS,
    FAMILIES,
    KERAS3,
    KERAS3_OTHER_FAMILY_FIX,
    MLM,
    Head,
    MlmHead,
)
from tpu_helpers.core.messages import say
from tpu_helpers.core.storage import is_remote, local_copy
from tpu_helpers.core.validate import check_learning_rate
from tpu_helpers.core.versions import KERAS_HUB_PIN
from tpu_helpers.data.hub import HUB_OPTIONS, find_weights, resolve_file
from tpu_helpers.keras3.converters import CONVERTERS
from tpu_helpers.keras3.distribution import _keras

__all__ = [
    "HEADS",
    "checkpoint_folder",
    "classifier",
    "compile_classifier",
    "masked_lm",
]


#: What a checkpoint this engine cannot train can do instead, on any runtime: the main
#: track runs here, on Colab's and Kaggle's TPUs, which have no TensorFlow for the TF engine.
#: The Keras 3 engine's head of each family it trains (``families.KERAS3``).
HEADS = {name: FAMILIES[name].keras3 for name in KERAS3}


def checkpoint_folder(checkpoint: str, **options) -> tuple[Path, dict]:
    """The local folder of ``checkpoint`` (a folder, a hub name fetched into the cache, or a
    folder on ``gs://`` copied to a temporary one) and its ``config.json``, refused with the fix unless the engine can read it: PyTorch-
    named safetensors of a family in ``HEADS``. ``options`` are the hub's
    (``hub.HUB_OPTIONS``); any other is refused, naming it."""
    unknown = sorted(set(options) - set(HUB_OPTIONS))
    if unknown:
        raise InputTypeError(
            f"{', '.join(unknown)}: not an option of the Keras 3 engine's loaders"
            " (classifier takes num_labels, ignore_mismatched_sizes, seed and verbose,"
            f" masked_lm seed and verbose, both the hub's {', '.join(HUB_OPTIONS)})."
            " Fix: check the spelling; class names are given when saving:"
            " save_hub_layout(model, folder, id2label={0: 'neg', 1: 'pos'})."
        )
    if is_remote(str(checkpoint)):
        checkpoint = local_copy(str(checkpoint))  # a save on gs://: read from a local copy
    config_file = resolve_file(str(checkpoint), "config.json", options)
    if not config_file:
        raise CheckpointFormatError(
            f"{checkpoint!r} has no config.json. Fix: a folder in the hub's layout, or a hub"
            " model name spelled as on its page (and a runtime that reaches the hub)."
        )
    config = json.loads(Path(config_file).read_text())
    family = config.get("model_type")
    if family not in HEADS:
        raise EngineError(
            f"{checkpoint!r} is a {family!r} checkpoint; the Keras 3 engine trains"
            f" {', '.join(KERAS3)}. Fix: {KERAS3_OTHER_FAMILY_FIX}"
        )
    weights = find_weights(str(checkpoint), **options)
    if weights.layout != "pytorch-safetensors":
        raise CheckpointFormatError(
            f"{checkpoint!r} holds {weights.layout} weights ({Path(weights.files[0]).name});"
            " KerasHub reads PyTorch-named safetensors only. Fix: a revision with"
            " model.safetensors (refs/pr/N on the hub), or load it on the TF engine and"
            " write it with tf_classes.save_pretrained, which writes that file."
        )
    return Path(config_file).parent, config


class _Reader:
    """The checkpoint's tensors by name, for KerasHub's converters (their ``loader``) and
    for the head: a name may be given without the model prefix (``bert.``), or with the
    family's ``prefix`` where the file's names lack it (a base model saved alone, as
    sentence-transformers' are, which transformers also loads); every name read is kept,
    a missing one of ``optional`` is skipped and kept apart, and the names ending in one of
    ``derived`` are listed apart (``Head.derived``)."""

    def __init__(self, folder: Path, optional: tuple = (), prefix: str = "", derived: tuple = ()):
        from tpu_helpers.data.hub import open_safetensors

        index = folder / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        else:
            with open_safetensors(folder / "model.safetensors") as archive:
                where = dict.fromkeys(archive.keys(), "model.safetensors")
        self.folder, self.where, self.optional = folder, where, optional
        # tensors no training changes (Head.derived): not read, copied when saving
        self.derived = sorted(n for n in where if n.rsplit(".", 1)[-1] in derived)
        # the file's names lack the family's prefix: a name asked with it is read without
        self.unprefixed = f"{prefix}." if prefix and not _under(where, prefix) else ""
        self.read, self.skipped, self._open = set(), [], {}
        self.ported: list[tuple] = []  # (variable, name asked for, hook_fn), in order

    def find(self, name: str) -> str | None:
        if name in self.where:
            return name
        found = sorted((k for k in self.where if k.endswith("." + name)), key=len)
        if found:
            return found[0]
        bare = name.removeprefix(self.unprefixed) if self.unprefixed else None
        return bare if bare in self.where else None

    def _full(self, name: str) -> str:
        full = self.find(name)
        if full is None:
            raise CheckpointFormatError(
                f"{self.folder}: no tensor {name!r}, which KerasHub's"
                " converter reads for this family: the file lacks a weight the encoder"
                " needs (another architecture than config.json names, or a dropped tensor)."
                " Fix: a checkpoint whose weights match its config.json."
            )
        return full

    def _archive(self, full: str):
        from tpu_helpers.data.hub import open_safetensors

        file = self.where[full]
        if file not in self._open:
            self._open[file] = open_safetensors(self.folder / file)
        return self._open[file]

    def shape(self, name: str) -> list[int]:
        """A tensor's shape, from the file's header (the tensor itself is not read)."""
        full = self._full(name)
        return self._archive(full).get_slice(full).get_shape()

    def get_tensor(self, name: str) -> np.ndarray:
        full = self._full(name)
        self.read.add(full)
        return self._archive(full).get_tensor(full)

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        self.ported.append((keras_variable, hf_weight_key, hook_fn))
        optional = any(f".{name}" in f".{hf_weight_key}" for name in self.optional)
        if optional and self.find(hf_weight_key) is None:
            self.skipped.append(hf_weight_key)
            return
        tensor = self.get_tensor(hf_weight_key)
        if hook_fn:
            tensor = hook_fn(tensor, list(keras_variable.shape))
        keras_variable.assign(tensor)

    def unread(self) -> list[str]:
        return sorted(set(self.where) - self.read - set(self.derived))


@dataclass(frozen=True, eq=False)
class HubSource:
    """Where a ``classifier`` came from, and how each weight was read: enough to write the
    trained model back in the hub's layout (``save_hub_layout``)."""

    folder: Path
    config: dict
    head: Head
    reader: _Reader
    layers: list
    mlm: MlmHead | None = None  # a masked_lm: its head's recipe
    head_calls: tuple = ()  # a classifier: its head's layers in the order they are called
    backbone: object = None  # KerasHub's backbone inside the model


def _under(names, prefix: str) -> bool:
    return any(name.startswith(f"{prefix}.") for name in names)


def _compute_as_configured(keras, backbone, config: dict) -> None:
    """Make the backbone compute what ``config`` says where KerasHub's backbones fix it:
    the layer-norm epsilon (BERT's is 1e-12, RoBERTa's 1e-5, ViT's 1e-6 in KerasHub,
    whatever the checkpoint's config) and the feed-forward GELU (KerasHub's BERT uses the
    tanh approximation; ``hidden_act: gelu`` is the exact one)."""
    from tpu_helpers.keras3.internals import sublayers

    epsilon = config.get("layer_norm_eps", config.get("layer_norm_epsilon"))
    activation = _activation(keras, config.get("hidden_act", config.get("activation")))
    for layer in sublayers(backbone):
        if epsilon is not None and isinstance(layer, keras.layers.LayerNormalization):
            layer.epsilon = float(epsilon)
        if activation and isinstance(layer, keras.layers.Dense):
            if getattr(layer.activation, "__name__", "") in ("gelu", "gelu_approximate", "relu"):
                layer.activation = activation


def _activation(keras, name: str | None):
    """The Keras function of a transformers activation name (``hidden_act``), ``None`` for
    ``None``; refused with the fix when this engine does not map it."""

    def gelu_approximate(x):  # the tanh approximation, under KerasHub's name for it
        return keras.activations.gelu(x, approximate=True)

    activations = {
        "gelu": keras.activations.gelu,  # exact: approximate=False
        "gelu_new": gelu_approximate,
        "gelu_pytorch_tanh": gelu_approximate,
        "relu": keras.activations.relu,
    }
    if name is None:
        return None
    if name not in activations:
        raise EngineError(
            f"the checkpoint's config asks for the activation {name!r}, which this engine does"
            f" not map onto KerasHub's layers (it maps {sorted(activations)}). Fix:"
            f" {KERAS3_OTHER_FAMILY_FIX}"
        )
    return activations[name]


def _rate(config: dict, fields: tuple) -> float:
    for name in fields:
        if config.get(name) is not None:
            return float(config[name])
    return 0.0


def classifier(
    checkpoint: str,
    num_labels: int | None = None,
    *,
    ignore_mismatched_sizes: bool = False,
    seed: int = 0,
    verbose: bool = True,
    **options,
):
    """A ``keras.Model`` that classifies what ``checkpoint`` (folder or hub name) reads:
    its features are our pipelines' (``input_ids``, ``attention_mask``, and
    ``token_type_ids`` for pairs: zeros when absent; ``pixel_values`` ``[B, 3, H, W]`` for
    images), its output float32 logits; ``model.network`` is the functional model inside.

    The encoder's weights all come from the file (KerasHub's converter of the family; a
    missing one is refused); the head is read from the file when it holds one of
    ``num_labels`` classes (a fine-tuned checkpoint), or starts as transformers starts one
    (a base checkpoint, or another number of labels with ``ignore_mismatched_sizes``).
    Under a ``mixed_bfloat16`` policy the model computes in bfloat16. ``options`` go to
    the hub (``revision``, ``cache_dir``, ``token``).
    """
    keras = _keras()
    folder, config = checkpoint_folder(checkpoint, **options)
    head = HEADS[config["model_type"]]
    num_labels = num_labels or len(config.get("id2label") or {}) or 2
    keras.utils.set_random_seed(seed)
    backbone, reader = _backbone(keras, folder, config, head)
    if isinstance(backbone.input, dict):
        inputs = {ours: keras.Input((None,), dtype="int32", name=ours) for ours in head.inputs}
        x = backbone({theirs: inputs[ours] for ours, theirs in head.inputs.items()})
    else:  # images: ours are channels first, as transformers' image processors give them
        height, width, channels = backbone.input.shape[1:]
        inputs = {"pixel_values": keras.Input((channels, height, width), name="pixel_values")}
        x = backbone(keras.ops.transpose(inputs["pixel_values"], (0, 2, 3, 1)))
    head = _chosen_head(head, reader, num_labels, ignore_mismatched_sizes)
    logits, layers, called = _head(keras, x, head, config, num_labels, seed)
    network = keras.Model(inputs, logits, name=f"{config['model_type']}_classifier")
    loaded = _load_head(layers, reader, num_labels, ignore_mismatched_sizes, checkpoint)
    if verbose:
        _say_what_was_read(checkpoint, reader, layers, loaded)
    model = _model_class(keras)(network)
    model.hub_source = HubSource(
        folder, config, head, reader, layers, head_calls=tuple(called), backbone=backbone
    )
    return model


def masked_lm(checkpoint: str, *, seed: int = 0, verbose: bool = True, **options):
    """A ``keras.Model`` that predicts hidden tokens as ``checkpoint`` (folder or hub name)
    was pretrained to: its features are ``input_ids`` (``attention_mask`` too; all ones
    when absent, as in packed blocks), its output float32 logits over the vocabulary at
    every position; ``model.network`` is the functional model inside.

    KerasHub's backbone of the family with the checkpoint's weights, and the family's
    masked-LM head as transformers defines it (``families.MlmHead``: a dense layer, its
    activation, a layer norm, then the token embeddings transposed plus a bias per token),
    read from the file when it holds one (a masked-LM save, as most base checkpoints on
    the hub are), else new. ``options`` go to the hub."""
    keras = _keras()
    folder, config = checkpoint_folder(checkpoint, **options)
    family = config["model_type"]
    recipe = FAMILIES[family].mlm
    if recipe is None:
        why = (
            " (pretrained by replaced-token detection: its discriminator checkpoints hold no"
            " masked-LM head to continue, and the engine does not build a generator's)"
            if family in DISCRIMINATORS
            else ""
        )
        raise EngineError(
            f"{checkpoint!r} is a {family!r} checkpoint{why}; the Keras 3 engine builds the"
            f" masked-LM head of {', '.join(MLM)}. Fix: continue pretraining a checkpoint"
            " of one of those families, or add this family's head (``MlmHead``) to its"
            " entry in tpu_helpers/core/families.py."
        )
    head = HEADS[family]
    keras.utils.set_random_seed(seed)
    backbone, reader = _backbone(keras, folder, config, head)
    inputs = {ours: keras.Input((None,), dtype="int32", name=ours) for ours in head.inputs}
    hidden = backbone({theirs: inputs[ours] for ours, theirs in head.inputs.items()})
    if isinstance(hidden, dict):
        hidden = hidden["sequence_output"]
    logits, layers = _mlm_head(keras, hidden, backbone, recipe, config, seed)
    network = keras.Model(inputs, logits, name=f"{family}_masked_lm")
    loaded = _load_mlm_head(layers, reader)
    if verbose:
        _say_what_was_read(checkpoint, reader, layers, loaded)
    model = _model_class(keras)(network)
    model.hub_source = HubSource(folder, config, head, reader, layers, recipe, backbone=backbone)
    return model


def _mlm_head(keras, x, backbone, recipe: MlmHead, config: dict, seed: int):
    """The masked-LM head's layers on the hidden states ``x``, initialised as transformers
    initialises a new head; the logits in float32. Returns them and ``[(name, layer)]``."""
    init = keras.initializers.TruncatedNormal(
        stddev=config.get("initializer_range", 0.02), seed=seed
    )
    act = next((config[f] for f in recipe.activation if config.get(f)), recipe.default_activation)
    eps = next(
        (float(config[f]) for f in recipe.epsilon if config.get(f) is not None),
        recipe.default_epsilon,
    )
    dense = keras.layers.Dense(
        x.shape[-1], _activation(keras, act), kernel_initializer=init, name="mlm_dense"
    )
    norm = keras.layers.LayerNormalization(epsilon=eps, name="mlm_layer_norm")
    tokens = backbone.token_embedding(norm(dense(x)), reverse=True)  # tied: embeddings^T
    bias = _token_bias_class(keras)(name="mlm_bias", dtype="float32")
    return bias(tokens), [(recipe.dense, dense), (recipe.norm, norm), (recipe.bias, bias)]


def _token_bias_class(keras):
    class TokenBias(keras.layers.Layer):
        """A bias per token added to the logits (in this layer's dtype: float32)."""

        def build(self, shape):
            self.bias = self.add_weight(shape=(shape[-1],), initializer="zeros", name="bias")

        def call(self, x):
            return x + self.bias

    return TokenBias


def _load_mlm_head(layers, reader) -> bool:
    """Read the masked-LM head's weights when the file holds them all; False: a new head."""
    (dense_name, dense), (norm_name, norm), (bias_name, bias) = layers
    names = [f"{dense_name}.weight", f"{dense_name}.bias", f"{norm_name}.weight", bias_name]
    if not all(reader.find(name) for name in names):
        return False
    dense.set_weights(
        [reader.get_tensor(f"{dense_name}.weight").T, reader.get_tensor(f"{dense_name}.bias")]
    )
    norm.set_weights(
        [reader.get_tensor(f"{norm_name}.weight"), reader.get_tensor(f"{norm_name}.bias")]
    )
    bias.set_weights([reader.get_tensor(bias_name)])
    return True


def _backbone(keras, folder: Path, config: dict, head: Head):
    """KerasHub's backbone of the family with the checkpoint's weights (read by KerasHub's
    converter, or by ours: ``converters.CONVERTERS``), computing what the config says; and
    the reader that read them."""
    try:
        import keras_hub

        from tpu_helpers.keras3.internals import hub_converter
    except ImportError as error:
        raise EngineError(
            f"KerasHub does not import ({error}). Fix: python -m tpu_helpers install --engine"
            " keras3 on Colab or Kaggle (the main track's install cell), or pip install --no-deps"
            f" {KERAS_HUB_PIN} next to Keras 3 and JAX."
        ) from error
    refused = [meaning for field, value, meaning in head.refused if config.get(field) == value]
    if refused:
        raise EngineError(
            f"this {config['model_type']} checkpoint has {', '.join(refused)}, which KerasHub's"
            f" backbone of the family does not compute. Fix: {KERAS3_OTHER_FAMILY_FIX}"
        )
    reader = _Reader(folder, head.optional, head.prefix, head.derived)
    ours = CONVERTERS.get(config["model_type"])
    if ours:  # a family KerasHub builds and does not read from the hub's files
        backbone = ours.build(keras_hub, config)
        ours.convert(backbone, reader, config)
    else:
        settings = {arg: config[field] for arg, field in head.backbone if field in config}
        backbone = keras_hub.models.Backbone.from_preset(
            str(folder), load_weights=False, **settings
        )
        hub_converter(config["model_type"]).convert_weights(backbone, reader, config)
    _compute_as_configured(keras, backbone, config)
    if head.fold_token_type and reader.find("embeddings.token_type_embeddings.weight"):
        positions = backbone.embeddings.position_embedding.position_embeddings
        types = reader.get_tensor("embeddings.token_type_embeddings.weight")
        positions.assign(positions + types[0])
    return backbone, reader


def _chosen_head(head: Head, reader, num_labels: int, ignore_mismatched: bool) -> Head:
    """``head``, or its ``alternative`` where the file holds that head's dense layers (a
    distilled DeiT's two), unless they are of other labels and ``ignore_mismatched``
    starts a new head: then ``head`` (``DeiTForImageClassification``'s one; transformers'
    ``WithTeacher`` class has no training loss, so a fine-tune trains one head)."""
    other = head.alternative
    names = [f"{step[1]}.weight" for step in other.steps if step[0] == "dense"] if other else []
    if not names or not all(reader.find(name) for name in names):
        return head
    if ignore_mismatched and reader.shape(names[-1])[0] != num_labels:
        return head
    return other


def _take(keras, x, take: str):
    """What the head reads of the backbone's output ``x`` (``Head.take``)."""
    if take == "pooled":
        return x["pooled_output"]
    if isinstance(x, dict):  # a backbone with a pooler the head does not read (ELECTRA's)
        x = x["sequence_output"]
    if take == "mean":  # [B, tokens, hidden] (Swin's, after its last layer norm)
        return keras.ops.mean(x, axis=1)
    return x[:, 0, :] if take == "first" else x  # first_two: both tokens, in _head


def _head(keras, x, head: Head, config: dict, num_labels: int, seed: int):
    """The head's layers on the backbone's output ``x``, initialised as transformers
    initialises a new head (truncated normal of the config's ``initializer_range``, zero
    biases); each dropout with a seed of its own. Returns the logits,
    ``[(checkpoint name, Dense)]`` and every layer in the order it is called."""
    dense = [s for s in head.steps if s[0] == "dense"]
    init = keras.initializers.TruncatedNormal(
        stddev=config.get("initializer_range", 0.02), seed=seed
    )
    x = _take(keras, x, head.take)
    if head.take == "first_two":  # a dense on each token, the logits averaged
        layers = [
            (
                name,
                keras.layers.Dense(num_labels, kernel_initializer=init, name=name, dtype="float32"),
            )
            for _, name, _ in dense
        ]
        logits = [layer(x[:, i, :]) for i, (_, layer) in enumerate(layers)]
        return (logits[0] + logits[1]) / 2, layers, [layer for _, layer in layers]
    layers, called = [], []
    for index, step in enumerate(head.steps):
        if step[0] == "dropout":
            called.append(keras.layers.Dropout(_rate(config, step[1]), seed=seed + index))
            x = called[-1](x)
            continue
        _, name, activation = step
        if isinstance(activation, tuple):  # (config field, transformers' default)
            activation = _activation(keras, config.get(activation[0]) or activation[1])
        last = step is dense[-1]
        layer = keras.layers.Dense(
            num_labels if last else x.shape[-1],
            activation,
            kernel_initializer=init,
            name=name.replace(".", "_"),
            dtype="float32" if last else None,  # float32 logits under mixed_bfloat16
        )
        x = layer(x)
        layers.append((name, layer))
        called.append(layer)
    return x, layers, called


def _model_class(keras):
    class Classifier(keras.Model):
        """``network`` (functional), also given features without ``token_type_ids`` (a
        single sentence's are all zeros, as transformers fills them) or without
        ``attention_mask`` (all ones: every position a token, as in packed blocks)."""

        def __init__(self, network, **kwargs):
            super().__init__(name=network.name, **kwargs)
            self.network = network
            self.takes = list(network.input) if isinstance(network.input, dict) else []
            self.built = True

        def call(self, features, training=None):
            features = dict(features)
            if "token_type_ids" in self.takes and "token_type_ids" not in features:
                features["token_type_ids"] = keras.ops.zeros_like(features["input_ids"])
            if "attention_mask" in self.takes and "attention_mask" not in features:
                features["attention_mask"] = keras.ops.ones_like(features["input_ids"])
            return self.network({k: features[k] for k in self.takes}, training=training)

    return Classifier


def _load_head(layers, reader, num_labels, ignore_mismatched, checkpoint) -> bool:
    """Read the head's weights when the file holds a head of ``num_labels`` classes; True if
    it did, False for a new head (a base checkpoint, or other labels and
    ``ignore_mismatched``)."""
    if not all(reader.find(f"{name}.weight") for name, _ in layers):
        return False
    saved = reader.shape(layers[-1][0] + ".weight")[0]
    if saved != num_labels:
        if ignore_mismatched:
            return False
        raise CheckpointFormatError(
            f"{checkpoint!r} has a classifier for {saved} labels, and {num_labels} were asked"
            " for. Fix: pass ignore_mismatched_sizes=True to start a new head, or num_labels"
            " equal to the checkpoint's."
        )
    for name, layer in layers:
        kernel = reader.get_tensor(f"{name}.weight").T  # PyTorch: [out, in]; Keras: [in, out]
        layer.set_weights([kernel, reader.get_tensor(f"{name}.bias")])
    return True


def _say_what_was_read(checkpoint, reader, layers, head_loaded: bool) -> None:
    if reader.skipped:
        say(f"[keras3] {checkpoint}: not in the file, so newly initialised: {reader.skipped}")
    if not head_loaded:
        say(f"[keras3] {checkpoint}: a new head, newly initialised: {[n for n, _ in layers]}")
    unread = reader.unread()
    if unread:
        shown = ", ".join(unread[:4]) + (" ..." if len(unread) > 4 else "")
        say(f"[keras3] {checkpoint}: {len(unread)} tensor(s) of the file not used: {shown}")


def compile_classifier(
    model, learning_rate: float, *, steps_per_execution: int = 1, optimizer=None
):
    """Compile as the TF notebooks do: Adam, cross-entropy on the logits, and accuracy
    weighted by the batches' weights (weight-0 filler rows count for nothing). A
    ``packed_classifier`` (logits per slot) averages its loss over the weighted slots, as
    the TF engine's ``tf_engine.packed_classes.packed_loss`` does: the count of examples varies by batch."""
    keras = _keras()
    if optimizer is None:
        check_learning_rate(learning_rate)
    per_slot = len(model.network.outputs[0].shape) == 3
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True,
            reduction="mean_with_sample_weight" if per_slot else "sum_over_batch_size",
        ),
        weighted_metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model
