"""The Keras 3 engine: hub checkpoints fine-tuned with Keras 3 on JAX, through KerasHub.

Colab's and Kaggle's TPU images ship JAX (with the TPU's libtpu) and Keras 3, and no
``tensorflow-tpu``; transformers 5 has no TF classes. This engine trains there without
replacing anything: KerasHub builds the encoder from a checkpoint in the hub's layout
(``config.json`` and PyTorch-named safetensors, one file or shards), the classification
head of the checkpoint's family is rebuilt here (``HEADS``) and read from the same files
when they hold it, ``keras.distribution.DataParallel`` splits each global batch over the
devices JAX finds, and every ``tpu_helpers`` pipeline (a ``pipeline.Batches``) feeds
``fit`` as it feeds the TF engine: the features keep their names, the labels and weights
their places.

=====================  ===============================================================
``devices``            the devices a batch is split over (simulated CPU devices too)
``connect``            ``keras.distribution.DataParallel`` over them, made global
``classifier``         encoder + head from a checkpoint, as ``keras.Model``
``compile_classifier`` the optimizer, loss and weighted accuracy of the TF notebooks
``fit_resumable``      one ``fit`` per epoch, saved every few steps, resumed mid-epoch
=====================  ===============================================================

>>> from tpu_helpers import keras3                                   # doctest: +SKIP
>>> distribution = keras3.connect()
>>> model = keras3.classifier("distilbert-base-cased", num_labels=2)
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpu_helpers.hub import CheckpointFormatError, _resolve, find_weights
from tpu_helpers.pipeline import require_batches
from tpu_helpers.runtime import KERAS3_FAMILIES

__all__ = [
    "EngineError",
    "Head",
    "HEADS",
    "devices",
    "connect",
    "replicas",
    "checkpoint_folder",
    "classifier",
    "compile_classifier",
    "ResumePoint",
    "fit_resumable",
    "predict_classes",
]


class EngineError(RuntimeError):
    """The Keras 3 engine cannot run here as asked (backend, devices, family)."""


# ---------------------------------------------------------------------------- devices


def _keras():
    """Keras on the JAX backend (set before Keras is first imported)."""
    loaded = sys.modules.get("keras")
    if loaded is None:
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if keras.backend.backend() != "jax":
        raise EngineError(
            f"Keras was imported with the {keras.backend.backend()!r} backend; this engine"
            " runs on JAX. Fix: restart the session and import tpu_helpers.keras3 (or set"
            " os.environ['KERAS_BACKEND'] = 'jax') before anything imports keras."
        )
    return keras


def devices(simulated_replicas: int = 0) -> list:
    """The devices to split batches over: every chip JAX finds on a TPU (one on Colab's free
    v5e-1, eight on Kaggle's v5e-8), or ``simulated_replicas`` CPU devices off a TPU.

    CPU devices exist only if ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` was set
    before JAX started; this sets it when JAX has not started yet, and Keras' backend to
    JAX when Keras has not been imported yet.
    """
    if simulated_replicas and "jax" not in sys.modules:
        flag = f"--xla_force_host_platform_device_count={simulated_replicas}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    _keras()
    import jax

    found = jax.devices()
    if simulated_replicas and found[0].platform == "cpu":
        if len(found) < simulated_replicas:
            raise EngineError(
                f"simulated_replicas={simulated_replicas}, but JAX started with"
                f" {len(found)} CPU device(s). Fix: restart the session and set"
                f" XLA_FLAGS=--xla_force_host_platform_device_count={simulated_replicas}"
                " before JAX is imported (keras3.devices does it when it runs first)."
            )
        found = found[:simulated_replicas]
    print(f"[keras3] {len(found)} {found[0].platform.upper()} device(s), JAX {jax.__version__}")
    return found


def connect(simulated_replicas: int = 0):
    """Split every batch over ``devices(simulated_replicas)``: returns the
    ``keras.distribution.DataParallel`` it made the global distribution (weights copied to
    every device, each global batch split along its first axis, one slice per device)."""
    found = devices(simulated_replicas)
    keras = _keras()
    distribution = keras.distribution.DataParallel(devices=found)
    keras.distribution.set_distribution(distribution)
    return distribution


def replicas(distribution) -> int:
    """How many devices ``distribution`` splits a batch over."""
    return int(np.asarray(distribution.device_mesh.devices).size)


# ----------------------------------------------------------------------------- heads


@dataclass(frozen=True)
class Head:
    """How a family's ``*ForSequenceClassification`` (or ``*ForImageClassification``)
    classifies, as a recipe over KerasHub's backbone of that family.

    Attributes:
        take: ``"pooled"`` (the backbone's pooled output, its pooler included) or
            ``"first"`` (the first token of its last hidden states).
        steps: in order, ``("dropout", config fields)`` (the first field the config sets
            gives the rate) or ``("dense", checkpoint name, activation)``; the last dense is
            the classifier itself.
        inputs: our pipelines' feature names -> the backbone's input names.
        optional: checkpoint names a base checkpoint may lack (a masked-LM save has no
            pooler): left as initialised, and said so.
        backbone: backbone arguments -> the config field that sets them, where KerasHub's
            converter leaves the backbone's default (BERT's dropout is 0.1 and ViT's layer
            norm epsilon 1e-6, whatever the config says).
        fold_token_type: add the token-type embedding of type 0 to the position embeddings,
            as transformers adds it to every token (KerasHub's RoBERTa converter drops it;
            its XLM-RoBERTa one folds it so).
    """

    take: str
    steps: tuple
    inputs: dict
    optional: tuple = ()
    backbone: tuple = ()
    fold_token_type: bool = False


_TEXT = {"input_ids": "token_ids", "attention_mask": "padding_mask"}
_PAIRS = {**_TEXT, "token_type_ids": "segment_ids"}
_ROBERTA_STEPS = (
    ("dropout", ("classifier_dropout", "hidden_dropout_prob")),
    ("dense", "classifier.dense", "tanh"),
    ("dropout", ("classifier_dropout", "hidden_dropout_prob")),
    ("dense", "classifier.out_proj", None),
)
#: The families the engine trains (``runtime.KERAS3_FAMILIES``), each as transformers
#: defines its classification head.
HEADS = {
    "bert": Head(
        "pooled",
        (("dropout", ("classifier_dropout", "hidden_dropout_prob")), ("dense", "classifier", None)),
        _PAIRS,
        ("pooler.",),
        (("dropout", "hidden_dropout_prob"),),
    ),
    "albert": Head(
        "pooled",
        (("dropout", ("classifier_dropout_prob",)), ("dense", "classifier", None)),
        _PAIRS,
        ("pooler.",),
    ),
    "distilbert": Head(
        "first",
        (
            ("dense", "pre_classifier", "relu"),
            ("dropout", ("seq_classif_dropout",)),
            ("dense", "classifier", None),
        ),
        _TEXT,
    ),
    "roberta": Head("first", _ROBERTA_STEPS, _TEXT, fold_token_type=True),
    "xlm-roberta": Head("first", _ROBERTA_STEPS, _TEXT, (), (("dropout", "hidden_dropout_prob"),)),
    "vit": Head(
        "first",
        (("dense", "classifier", None),),
        {"pixel_values": "images"},
        backbone=(("layer_norm_epsilon", "layer_norm_eps"),),
    ),
}


def checkpoint_folder(checkpoint: str, **options) -> tuple[Path, dict]:
    """The local folder of ``checkpoint`` (a folder, or a hub name fetched into the cache)
    and its ``config.json``, refused with the fix unless the engine can read it: PyTorch-
    named safetensors of a family in ``HEADS``."""
    config_file = _resolve(str(checkpoint), "config.json", options)
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
            f" {', '.join(KERAS3_FAMILIES)}. Fix: train it on the TF engine (notebooks 01-04)."
        )
    weights = find_weights(str(checkpoint), **options)
    if weights.layout != "pytorch-safetensors":
        raise CheckpointFormatError(
            f"{checkpoint!r} holds {weights.layout} weights ({Path(weights.files[0]).name});"
            " KerasHub reads PyTorch-named safetensors only. Fix: a revision with"
            " model.safetensors (refs/pr/N on the hub), or load it on the TF engine and"
            " write it with storage.save_pretrained, which writes that file."
        )
    return Path(config_file).parent, config


class _Reader:
    """The checkpoint's tensors by name, for KerasHub's converters (their ``loader``) and
    for the head: a name may be given without the model prefix (``bert.``); every name
    read is kept, and a missing one of ``optional`` is skipped and kept apart."""

    def __init__(self, folder: Path, optional: tuple = ()):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(folder / "model.safetensors", framework="np") as archive:
                where = dict.fromkeys(archive.keys(), "model.safetensors")
        self.folder, self.where, self.optional = folder, where, optional
        self.read, self.skipped, self._open = set(), [], {}

    def find(self, name: str) -> str | None:
        if name in self.where:
            return name
        found = sorted((k for k in self.where if k.endswith("." + name)), key=len)
        return found[0] if found else None

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
        from safetensors import safe_open

        file = self.where[full]
        if file not in self._open:
            self._open[file] = safe_open(self.folder / file, framework="np")
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
        if self.find(hf_weight_key) is None and hf_weight_key.startswith(self.optional):
            self.skipped.append(hf_weight_key)
            return
        tensor = self.get_tensor(hf_weight_key)
        if hook_fn:
            tensor = hook_fn(tensor, list(keras_variable.shape))
        keras_variable.assign(tensor)

    def unread(self) -> list[str]:
        return sorted(set(self.where) - self.read)


def _compute_as_configured(keras, backbone, config: dict) -> None:
    """Make the backbone compute what ``config`` says where KerasHub's backbones fix it:
    the layer-norm epsilon (BERT's is 1e-12, RoBERTa's 1e-5, ViT's 1e-6 in KerasHub,
    whatever the checkpoint's config) and the feed-forward GELU (KerasHub's BERT uses the
    tanh approximation; ``hidden_act: gelu`` is the exact one)."""
    epsilon = config.get("layer_norm_eps", config.get("layer_norm_epsilon"))
    from keras_hub.src.utils.keras_utils import gelu_approximate

    act = config.get("hidden_act", config.get("activation"))
    activation = {
        "gelu": keras.activations.gelu,  # exact: approximate=False
        "gelu_new": gelu_approximate,
        "gelu_pytorch_tanh": gelu_approximate,
    }.get(act)
    for layer in backbone._flatten_layers(include_self=False, recursive=True):
        if epsilon is not None and isinstance(layer, keras.layers.LayerNormalization):
            layer.epsilon = float(epsilon)
        if activation and isinstance(layer, keras.layers.Dense):
            if "gelu" in getattr(layer.activation, "__name__", ""):
                layer.activation = activation


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
    its features are our pipelines' (``input_ids``, ``attention_mask``, ``token_type_ids``
    for pairs; ``pixel_values`` ``[B, 3, H, W]`` for images), its output float32 logits.

    The encoder's weights all come from the file (KerasHub's converter of the family; a
    missing one is refused); the head is read from the file when it holds one of
    ``num_labels`` classes (a fine-tuned checkpoint), or starts at random from ``seed``
    (a base checkpoint, or another number of labels with ``ignore_mismatched_sizes``).
    Under a ``mixed_bfloat16`` policy the model computes in bfloat16. ``options`` go to
    the hub (``revision``, ``cache_dir``, ``token``).
    """
    keras = _keras()
    import keras_hub
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader

    folder, config = checkpoint_folder(checkpoint, **options)
    family = config["model_type"]
    head = HEADS[family]
    saved_labels = len(config.get("id2label") or {}) or None
    num_labels = num_labels or saved_labels or 2
    keras.utils.set_random_seed(seed)
    settings = {arg: config[field] for arg, field in head.backbone if field in config}
    backbone = keras_hub.models.Backbone.from_preset(str(folder), load_weights=False, **settings)
    reader = _Reader(folder, head.optional)
    TransformersPresetLoader(str(folder), config).converter.convert_weights(
        backbone, reader, config
    )
    _compute_as_configured(keras, backbone, config)
    if head.fold_token_type and reader.find("embeddings.token_type_embeddings.weight"):
        positions = backbone.embeddings.position_embedding.position_embeddings
        positions.assign(
            positions + reader.get_tensor("embeddings.token_type_embeddings.weight")[0]
        )

    if isinstance(backbone.input, dict):
        inputs = {ours: keras.Input((None,), dtype="int32", name=ours) for ours in head.inputs}
        x = backbone({theirs: inputs[ours] for ours, theirs in head.inputs.items()})
    else:  # images: ours are channels first, as transformers' image processors give them
        height, width, channels = backbone.input.shape[1:]
        inputs = {"pixel_values": keras.Input((channels, height, width), name="pixel_values")}
        x = backbone(keras.ops.transpose(inputs["pixel_values"], (0, 2, 3, 1)))
    x = x["pooled_output"] if head.take == "pooled" else x[:, 0, :]
    dense = [s for s in head.steps if s[0] == "dense"]
    layers = []
    for step in head.steps:
        if step[0] == "dropout":
            x = keras.layers.Dropout(_rate(config, step[1]), seed=seed)(x)
            continue
        _, name, activation = step
        last = step is dense[-1]
        units = num_labels if last else x.shape[-1]
        layer = keras.layers.Dense(
            units, activation, name=name.replace(".", "_"), dtype="float32" if last else None
        )
        x = layer(x)
        layers.append((name, layer))
    model = keras.Model(inputs, x, name=f"{family}_classifier")
    loaded = _load_head(model, layers, reader, num_labels, ignore_mismatched_sizes, checkpoint)
    if verbose:
        _say_what_was_read(checkpoint, reader, layers, loaded)
    return model


def _load_head(model, layers, reader, num_labels, ignore_mismatched, checkpoint) -> bool:
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
        print(f"[keras3] {checkpoint}: not in the file, so newly initialised: {reader.skipped}")
    if not head_loaded:
        print(f"[keras3] {checkpoint}: a new head, newly initialised: {[n for n, _ in layers]}")
    unread = reader.unread()
    if unread:
        shown = ", ".join(unread[:4]) + (" ..." if len(unread) > 4 else "")
        print(f"[keras3] {checkpoint}: {len(unread)} tensor(s) of the file not used: {shown}")


def compile_classifier(
    model, learning_rate: float, *, steps_per_execution: int = 1, optimizer=None
):
    """Compile as the TF notebooks do: Adam, cross-entropy on the logits, and accuracy
    weighted by the batches' weights (weight-0 filler rows count for nothing)."""
    keras = _keras()
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


# --------------------------------------------------------------------- resumable fit


@dataclass(frozen=True)
class ResumePoint:
    """Where a run stands: ``epoch`` (0-based) and the ``step`` of it to train next."""

    epoch: int
    step: int


def _gfile():
    import tensorflow as tf

    return tf.io.gfile


def _state(model) -> list:
    """Every variable a resumed run needs, in a fixed order: the model's (trainable, then
    the rest, the dropout layers' seed states among them) and the optimizer's."""
    return [*model.trainable_variables, *model.non_trainable_variables, *model.optimizer.variables]


class _Saves:
    """A run's saves in ``directory`` (local or ``gs://``): ``state-<epoch>-<step>.npz``
    and ``latest.json`` naming the newest, written after it, so a save that stops half-way
    is never the one resumed. The two newest are kept."""

    def __init__(self, directory: str, run: dict):
        self.directory, self.run, self.gfile = directory.rstrip("/"), run, _gfile()
        self.gfile.makedirs(self.directory)

    def latest(self) -> dict | None:
        path = f"{self.directory}/latest.json"
        if not self.gfile.exists(path):
            return None
        with self.gfile.GFile(path) as f:
            return json.load(f)

    def save(self, model, point: ResumePoint) -> None:
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()  # fit keeps the newest values outside the variables
        variables = _state(model)
        buffer = io.BytesIO()
        np.savez(buffer, *[np.asarray(v.value) for v in variables])
        name = f"state-{point.epoch}-{point.step}.npz"
        with self.gfile.GFile(f"{self.directory}/{name}.partial", "wb") as f:
            f.write(buffer.getvalue())
        self.gfile.rename(f"{self.directory}/{name}.partial", f"{self.directory}/{name}", True)
        before = self.latest()
        latest = {
            "file": name,
            "epoch": point.epoch,
            "step": point.step,
            "run": self.run,
            "shapes": [list(v.shape) for v in variables],
            "previous": before["file"] if before else None,
        }
        with self.gfile.GFile(f"{self.directory}/latest.json.partial", "w") as f:
            json.dump(latest, f)
        self.gfile.rename(
            f"{self.directory}/latest.json.partial", f"{self.directory}/latest.json", True
        )
        old = before and before.get("previous")
        if old and old != name and self.gfile.exists(f"{self.directory}/{old}"):
            self.gfile.remove(f"{self.directory}/{old}")

    def restore(self, model) -> ResumePoint:
        latest = self.latest()
        if latest is None:
            return ResumePoint(0, 0)
        if latest["run"] != self.run:
            raise EngineError(
                f"{self.directory} holds a run of {latest['run']}, not of {self.run}. Fix: a"
                " new directory for a new run, or delete this one to start over."
            )
        variables = _state(model)
        shapes = [list(v.shape) for v in variables]
        if shapes != latest["shapes"]:
            raise EngineError(
                f"{self.directory}: the saved state does not fit this model (another"
                " checkpoint, head or optimizer). Fix: a new directory for a new model."
            )
        with self.gfile.GFile(f"{self.directory}/{latest['file']}", "rb") as f:
            arrays = np.load(io.BytesIO(f.read()))
            for i, variable in enumerate(variables):
                variable.assign(arrays[f"arr_{i}"])
        return ResumePoint(latest["epoch"], latest["step"])


def _saver_callback(keras, saves: _Saves, model, epoch, first_step, every_steps, every_minutes):
    class Saver(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.last_step, self.last_time = first_step, time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            step = first_step + batch + 1
            due_steps = every_steps and step - self.last_step >= every_steps
            due_time = every_minutes and time.monotonic() - self.last_time >= 60 * every_minutes
            if due_steps or due_time:
                saves.save(model, ResumePoint(epoch, step))
                self.last_step, self.last_time = step, time.monotonic()

    return Saver()


def fit_resumable(
    model,
    train,
    epochs: int,
    directory: str,
    *,
    validation=None,
    every_steps: int | None = None,
    every_minutes: float | None = 10.0,
    run: dict | None = None,
    callbacks: Iterable = (),
    verbose: int = 2,
) -> dict:
    """Train ``model`` (compiled) on ``train`` (a ``pipeline.Batches``) for ``epochs``,
    one ``fit`` per epoch on that epoch's own shuffle, saving the whole state to
    ``directory`` every ``every_steps`` steps or ``every_minutes`` minutes and at each
    epoch's end. Run again after the runtime was lost, it resumes from the newest save
    and reads on from the batch it had reached (``skip_steps``), so the weights at the end
    equal an uninterrupted run's. ``validation`` (a ``Batches``) is evaluated after each
    epoch. Returns the history: per epoch, the logs of its ``fit`` (a resumed epoch's
    metrics cover the steps after the resume) and ``val_`` ones.
    """
    keras = _keras()
    require_batches(train, "keras3.fit_resumable")
    saves = _Saves(directory, run or {})
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    point = saves.restore(model)
    history: dict[str, list] = {}
    steps = train.steps_per_epoch
    for epoch in range(point.epoch, epochs):
        first = point.step if epoch == point.epoch else 0
        if first < steps:
            if first and verbose:
                print(f"[keras3] resuming epoch {epoch} at step {first} of {steps}")
            saver = _saver_callback(keras, saves, model, epoch, first, every_steps, every_minutes)
            logs = model.fit(
                train.dataset(epoch, skip_steps=first),
                steps_per_epoch=steps - first,
                epochs=1,
                verbose=verbose,
                shuffle=False,  # each epoch's batches come shuffled by the pipeline's seed
                callbacks=[saver, *callbacks],
            ).history
            for key, values in logs.items():
                history.setdefault(key, []).append(values[-1])
        saves.save(model, ResumePoint(epoch + 1, 0))
        if validation is not None:
            require_batches(validation, "keras3.fit_resumable(validation=)")
            result = model.evaluate(
                validation.dataset(0), steps=validation.steps_per_epoch, verbose=0, return_dict=True
            )
            for key, value in result.items():
                history.setdefault(f"val_{key}", []).append(value)
    return history


def predict_classes(model, batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One epoch of ``batches`` through ``model``, split over the devices as in ``fit``:
    ``(labels, predictions, weights)`` as flat arrays, as ``metrics.predict_classes``
    gives them on the TF engine (weight 0 marks the fillers of a last batch)."""
    batches = require_batches(batches, "keras3.predict_classes")
    labels, predictions, weights = [], [], []
    for features, y, w in batches.dataset(0).take(batches.steps_per_epoch).as_numpy_iterator():
        predictions.append(np.argmax(np.asarray(model.predict_on_batch(features)), axis=-1))
        labels.append(y)
        weights.append(w)
    return np.concatenate(labels), np.concatenate(predictions), np.concatenate(weights)
