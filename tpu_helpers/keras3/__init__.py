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
``fit_resumable``      ``engine.fit_with``, the one loop of both engines, with this
                       engine's ``JaxTrainer`` (compiled steps: ``jax_steps``)
``evaluate``           the compiled metrics over a ``Batches``
``predict_classes``    ``engine.predict_with``: labels, predictions and weights
``compilations``       how often each step was compiled (once per width)
``save_hub_layout``    the trained classifier in the hub's layout
``packed_classifier``  a classifier run on packed rows (``packing.packed_batches``)
=====================  ===============================================================

>>> from tpu_helpers import keras3  # doctest: +SKIP
>>> distribution = keras3.connect()
>>> model = keras3.classifier("distilbert-base-cased", num_labels=2)
"""

from __future__ import annotations

import io
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.engine import (
    check_same_run,
    fit_options,
    fit_with,
    predict_with,
    require_engine_model,
)
from tpu_helpers.core.errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    EngineError,
    InputError,
    InputTypeError,
)
from tpu_helpers.core.families import FAMILIES, KERAS3, MLM, Head, MlmHead
from tpu_helpers.core.messages import say
from tpu_helpers.core.pipeline import require_batches
from tpu_helpers.core.validate import check_learning_rate, check_positive
from tpu_helpers.core.versions import KERAS_HUB_PIN, WRITTEN_FOR, installed
from tpu_helpers.data.hub import HUB_OPTIONS, find_weights, resolve_file

__all__ = [
    "EngineError",
    "Head",
    "HEADS",
    "devices",
    "simulation_env",
    "connect",
    "replicas",
    "checkpoint_folder",
    "classifier",
    "compile_classifier",
    "masked_lm",
    "compile_masked_lm",
    "packed_classifier",
    "packed_attention",
    "packed_positions",
    "HubSource",
    "save_hub_layout",
    "ResumePoint",
    "RunSaves",
    "JaxTrainer",
    "fit_resumable",
    "evaluate",
    "predict_classes",
    "compilations",
    "input_bound_check",
]


def _warn_of_releases_not_written_for() -> None:
    """A warning per installed Keras or KerasHub release the engine was not written for:
    its private names and converters may have moved (``versions``)."""
    for name, (version, known) in installed().items():
        if not known:
            warnings.warn(
                f"{name} {version}: the Keras 3 engine is written for {name}"
                f" {' and '.join(WRITTEN_FOR[name])}. Fix: tpu_helpers.install(engine='keras3')"
                " installs those; with this release, expect an EngineError naming what moved.",
                stacklevel=3,
            )


_warn_of_releases_not_written_for()


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
    before JAX's backend started (its first ``jax.devices()``, not ``import jax``); this
    sets ``simulation_env``, which a started backend no longer reads, and sets Keras'
    backend to JAX when Keras has not been imported yet. On a pod slice (several hosts),
    call ``jax.distributed.initialize()`` on every host first: the devices are then every
    host's (``simulated_replicas``, off a TPU, counts each process's own).
    """
    if simulated_replicas:  # read when JAX's backend starts: at the first jax.devices()
        for name, value in simulation_env(simulated_replicas, os.environ).items():
            os.environ[name] = value
    _keras()
    import jax

    found = jax.devices()  # of every process: a pod slice's hosts each feed their own
    if simulated_replicas and found[0].platform == "cpu" and jax.process_count() == 1:
        if len(found) < simulated_replicas:
            raise EngineError(
                f"simulated_replicas={simulated_replicas}, but JAX started with"
                f" {len(found)} CPU device(s). Fix: restart the session and set"
                f" XLA_FLAGS=--xla_force_host_platform_device_count={simulated_replicas}"
                " before JAX is imported (keras3.devices does it when it runs first)."
            )
        found = found[:simulated_replicas]
    say(f"[keras3] {len(found)} {found[0].platform.upper()} device(s), JAX {jax.__version__}")
    return found


def simulation_env(devices: int, environ=None) -> dict[str, str]:
    """The environment variables to set (on top of ``environ``, the process's own unless
    given) for ``devices`` simulated CPU devices, read when JAX's backend starts:
    ``XLA_FLAGS`` with the device count, and ``PJRT_NPROC``, the threads of the pool that
    runs each device's share of a program, two per device.

    With the default pool (one thread per device where the machine has fewer cores), a
    loop that dispatches steps with an all-reduce faster than they run can leave some
    devices without a thread to reach it, and the others wait for them for good: XLA ends
    the process 10 s (jaxlib 0.7.2) or 40 s (0.10.2) later ("Termination timeout for `all
    reduce RendezvousKey...`"). On 2 cores at 8 devices a loop of small steps did so on
    both within seconds, and a notebook's kernel died or hung in CI; with two threads per
    device, none did. A TPU does not run this code.

    >>> simulation_env(8, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})["XLA_FLAGS"]
    '--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8'
    >>> simulation_env(8, {})["PJRT_NPROC"]
    '16'
    """
    environ = os.environ if environ is None else environ
    flags, count = environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count"
    if count not in flags:
        flags = f"{flags} {count}={devices}".strip()
    threads = max(2 * devices, int(environ.get("PJRT_NPROC") or 0))
    return {"XLA_FLAGS": flags, "PJRT_NPROC": str(threads)}


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


def is_writer() -> bool:
    """Whether this process writes a run's files: the only one, or the first of several
    JAX processes (a pod slice's hosts, started with ``jax.distributed.initialize()``)."""
    import jax

    return jax.process_index() == 0


def first_process_says(flag: bool) -> bool:
    """The first JAX process's ``flag``, in every process (a clock or a write that only the
    first one has); ``flag`` itself with one process."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    return flag if hosts is None else bool(hosts.broadcast_one_to_all(np.asarray(flag)))


def summed_over_processes(values) -> list[int]:
    """Whole numbers (this process's counts) summed over every JAX process: the counts of
    the global batches when each host reads its own rows; ``values`` with one process."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    if hosts is None:
        return [int(v) for v in values]
    found = np.asarray(hosts.process_allgather(np.asarray(values, np.int64)))
    return [int(v) for v in found.reshape(-1, len(values)).sum(axis=0)]


def same_on_every_process(value, what: str) -> None:
    """Refuse, in every JAX process, a ``value`` (numbers) that differs between them."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    if hosts is None:
        return
    found = np.asarray(hosts.process_allgather(np.asarray(value)))
    if not (found == found[0]).all():
        raise EngineError(
            f"the hosts disagree on {what}: {found.tolist()} (one row per host). Fix: a save"
            " folder every host reads alike (gs://), and the same code and data on each."
        )


def all_processes_reach(name: str) -> None:
    """Wait here until every JAX process has reached the point ``name`` (nothing with one
    process): a host reads a save only after the one that writes it has."""
    from tpu_helpers.keras3.steps import multihost

    hosts = multihost()
    if hosts is not None:
        hosts.sync_global_devices(name)


# ----------------------------------------------------------------------------- heads


#: What a checkpoint this engine cannot train can do instead, on any runtime: the main
#: track runs here, on Colab's and Kaggle's TPUs, which have no TensorFlow for the TF engine.
OTHER_FAMILY_FIX = (
    "a checkpoint of one of those families (distilbert-base-cased, bert-base-cased,"
    " roberta-base, xlm-roberta-base, albert-base-v2; google/vit-base-patch16-224 for"
    " images), or add its family to the table in tpu_helpers/core/families.py (CONTRIBUTING.md"
    " says how). The TF engine (notebooks/tf/) trains more families where tensorflow-tpu"
    " runs: a TPU VM, not Colab's or Kaggle's TPU runtime."
)
#: The Keras 3 engine's head of each family it trains (``families.KERAS3``).
HEADS = {name: FAMILIES[name].keras3 for name in KERAS3}


def checkpoint_folder(checkpoint: str, **options) -> tuple[Path, dict]:
    """The local folder of ``checkpoint`` (a folder, or a hub name fetched into the cache)
    and its ``config.json``, refused with the fix unless the engine can read it: PyTorch-
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
            f" {', '.join(KERAS3)}. Fix: {OTHER_FAMILY_FIX}"
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
    and a missing one of ``optional`` is skipped and kept apart."""

    def __init__(self, folder: Path, optional: tuple = (), prefix: str = ""):
        from tpu_helpers.data.hub import open_safetensors

        index = folder / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        else:
            with open_safetensors(folder / "model.safetensors") as archive:
                where = dict.fromkeys(archive.keys(), "model.safetensors")
        self.folder, self.where, self.optional = folder, where, optional
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
        return sorted(set(self.where) - self.read)


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
            f" {OTHER_FAMILY_FIX}"
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
    x = x["pooled_output"] if head.take == "pooled" else x[:, 0, :]
    logits, layers, called = _head(keras, x, head, config, num_labels, seed)
    network = keras.Model(inputs, logits, name=f"{config['model_type']}_classifier")
    loaded = _load_head(layers, reader, num_labels, ignore_mismatched_sizes, checkpoint)
    if verbose:
        _say_what_was_read(checkpoint, reader, layers, loaded)
    model = _model_class(keras)(network)
    model.hub_source = HubSource(folder, config, head, reader, layers, head_calls=tuple(called))
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
        raise EngineError(
            f"{checkpoint!r} is a {family!r} checkpoint; the Keras 3 engine builds the"
            f" masked-LM head of {', '.join(MLM)}. Fix: pretrain it on the TF engine"
            " (notebook tf/06)."
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
    model.hub_source = HubSource(folder, config, head, reader, layers, recipe)
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


def compile_masked_lm(model, learning_rate: float, *, steps_per_execution: int = 1, optimizer=None):
    """Compile a ``masked_lm`` as transformers trains one: the cross-entropy averaged over
    the masked tokens only (the batches' weights: 1 where a token was masked), and the
    masked tokens' accuracy; AdamW unless ``optimizer`` is given."""
    keras = _keras()
    if optimizer is None:
        check_learning_rate(learning_rate)
    model.compile(
        optimizer=optimizer or keras.optimizers.AdamW(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="mlm_accuracy")],
        steps_per_execution=steps_per_execution,
    )
    return model


def _backbone(keras, folder: Path, config: dict, head: Head):
    """KerasHub's backbone of the family with the checkpoint's weights, computing what the
    config says; and the reader that read them."""
    try:
        import keras_hub

        from tpu_helpers.keras3.internals import hub_converter
    except ImportError as error:
        raise EngineError(
            f"KerasHub does not import ({error}). Fix: python -m tpu_helpers install --engine"
            " keras3 on Colab or Kaggle (the main track's install cell), or pip install --no-deps"
            f" {KERAS_HUB_PIN} next to Keras 3 and JAX."
        ) from error
    settings = {arg: config[field] for arg, field in head.backbone if field in config}
    backbone = keras_hub.models.Backbone.from_preset(str(folder), load_weights=False, **settings)
    reader = _Reader(folder, head.optional, head.prefix)
    hub_converter(folder, config).convert_weights(backbone, reader, config)
    _compute_as_configured(keras, backbone, config)
    if head.fold_token_type and reader.find("embeddings.token_type_embeddings.weight"):
        positions = backbone.embeddings.position_embedding.position_embeddings
        types = reader.get_tensor("embeddings.token_type_embeddings.weight")
        positions.assign(positions + types[0])
    return backbone, reader


def _head(keras, x, head: Head, config: dict, num_labels: int, seed: int):
    """The head's layers on ``x``, initialised as transformers initialises a new head
    (truncated normal of the config's ``initializer_range``, zero biases); each dropout
    with a seed of its own. Returns the logits, ``[(checkpoint name, Dense)]`` and every
    layer in the order it is called."""
    dense = [s for s in head.steps if s[0] == "dense"]
    init = keras.initializers.TruncatedNormal(
        stddev=config.get("initializer_range", 0.02), seed=seed
    )
    layers, called = [], []
    for index, step in enumerate(head.steps):
        if step[0] == "dropout":
            called.append(keras.layers.Dropout(_rate(config, step[1]), seed=seed + index))
            x = called[-1](x)
            continue
        _, name, activation = step
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
    the TF engine's ``tf_engine.packed_model.packed_loss`` does: the count of examples varies by batch."""
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


# ------------------------------------------------------------------------- packed


def packed_classifier(model):
    """A ``keras.Model`` that runs ``model`` (a text ``classifier``) on packed rows
    (``packing.packed_batches``): features ``input_ids``, ``segment_ids`` (1, 2, ... per
    example, 0 on padding) and ``starts`` ``[rows, slots]`` (``token_type_ids`` for
    sentence pairs), logits ``[rows, slots, labels]``, one per example at its first token
    (an empty slot's are the row's first example's: give it weight 0).

    The same layers and weights as ``model``, called otherwise: each of KerasHub's encoder
    layers with a mask per query and key (``packed_attention``: a token sees its own
    example only), each position embedding with the positions of each token inside its
    example (``packed_positions``, restarting at 0), the pooler or the first-token head at
    every example's first token. Training it trains ``model``, which evaluates, predicts
    and saves (``save_hub_layout``) unpacked as usual. Compile it with
    ``compile_classifier``: the loss is averaged over the weighted slots."""
    keras = _keras()
    from tpu_helpers.core.families import KERAS3_PACKED

    source = getattr(model, "hub_source", None)
    family = source.config["model_type"] if isinstance(source, HubSource) else None
    if family not in KERAS3_PACKED or source.mlm is not None:
        raise EngineError(
            f"packed_classifier takes a keras3.classifier of {', '.join(KERAS3_PACKED)}, not"
            f" {type(model).__name__} ({family or 'not made by keras3.classifier'}). Fix:"
            " model = keras3.classifier(checkpoint, num_labels), then packed_classifier(model);"
            " other families train unpacked (text.text_batches)."
        )
    names = ["input_ids", "segment_ids", "starts"]
    names += ["token_type_ids"] if "token_type_ids" in source.head.inputs else []
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in names}
    import keras_hub

    layers = model.network.layers
    backbone = next(layer for layer in layers if isinstance(layer, keras_hub.models.Backbone))
    hidden = _packed_encoder(keras, backbone, inputs, source.head)
    x = keras.ops.take_along_axis(hidden, keras.ops.expand_dims(inputs["starts"], -1), axis=1)
    if source.head.take == "pooled":
        x = backbone.pooled_dense(x)
    for layer in source.head_calls:  # the head's own layers, in order
        x = layer(x)
    packed = _model_class(keras)(keras.Model(inputs, x, name=f"{family}_packed_classifier"))
    packed.hub_source = source
    return packed


def packed_attention(segment_ids):
    """``[rows, T, T]`` booleans, in ``keras.ops``: query token ``i`` may attend to key
    token ``j`` (both of one example; ``j`` not padding, segment 0)."""
    ops = _keras().ops
    same = ops.equal(ops.expand_dims(segment_ids, 2), ops.expand_dims(segment_ids, 1))
    return ops.logical_and(same, ops.expand_dims(segment_ids > 0, 1))


def packed_positions(segment_ids):
    """``[rows, T]`` int32, in ``keras.ops``: each token's position inside its own example
    (0 at its first token; 0 on padding): the tokens of its example before it."""
    ops = _keras().ops
    index = ops.cumsum(ops.ones_like(segment_ids), axis=1)
    before = ops.expand_dims(index, 1) < ops.expand_dims(index, 2)  # [rows, query, key]
    seen = ops.logical_and(packed_attention(segment_ids), before)
    return ops.where(segment_ids > 0, ops.sum(ops.cast(seen, "int32"), axis=-1), 0)


def _packed_encoder(keras, backbone, inputs: dict, head: Head):
    """The backbone's sequence output on packed ``inputs``: its own graph of layers run
    again (``keras.models.clone_model`` sharing every layer), the positions and the mask
    given to the layers that take them, and the segment ids where the padding mask was."""
    import keras_hub

    ours = {**inputs, "attention_mask": inputs["segment_ids"]}
    segments = inputs["segment_ids"]
    allowed, positions = packed_attention(segments), packed_positions(segments)
    embeddings = (keras_hub.layers.PositionEmbedding, keras_hub.layers.TokenAndPositionEmbedding)
    seen = {"positions": 0, "attention": 0}

    def call(layer, *args, **kwargs):
        if isinstance(layer, embeddings):
            kwargs["positions"], seen["positions"] = positions, seen["positions"] + 1
        elif isinstance(layer, keras_hub.layers.TransformerEncoder):
            kwargs.update(padding_mask=None, attention_mask=allowed)
            seen["attention"] += 1
        elif "padding_mask" in kwargs:
            raise EngineError(_KERASHUB_CHANGED.format(f"{type(layer).__name__} takes the mask"))
        return layer(*args, **kwargs)

    with warnings.catch_warnings():  # our inputs' names are not the backbone's: meant so
        warnings.filterwarnings("ignore", "When providing `inputs` as a dict")
        clone = keras.models.clone_model(
            backbone,
            input_tensors={theirs: ours[name] for name, theirs in head.inputs.items()},
            clone_function=lambda layer: layer,  # the same layers: the same weights
            call_function=call,
        )
    calls = backbone.num_layers * getattr(backbone, "num_inner_repetitions", 1)  # ALBERT's
    if seen["positions"] != 1 or seen["attention"] != calls:
        raise EngineError(_KERASHUB_CHANGED.format(f"{seen} in {type(backbone).__name__}"))
    output = clone.output
    return output["sequence_output"] if isinstance(output, dict) else output


_KERASHUB_CHANGED = (
    "packing expects one position embedding and one TransformerEncoder call per layer in"
    " KerasHub's backbone, and found otherwise ({}): this KerasHub builds its encoders"
    f" differently. Fix: {KERAS_HUB_PIN} (tpu_helpers.install(engine='keras3')), or train"
    " unpacked."
)


# ------------------------------------------------------------------ the hub's layout


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


def save_hub_layout(
    model, folder, *, id2label: dict | None = None, max_shard_bytes: int | None = None
) -> list[str]:
    """Write ``model`` (a ``classifier`` or a ``masked_lm``, trained or not) to ``folder`` (local or ``gs://``) as the hub
    serves a fine-tuned checkpoint: PyTorch-named ``model.safetensors`` (or shards), the
    ``config.json`` of a ``*ForSequenceClassification`` (``*ForImageClassification``) with
    its number of labels (``id2label`` names them), and the checkpoint's tokenizer or
    processor files. ``classifier``, KerasHub's ``from_preset``, the TF engine
    (``tf_classes.from_pretrained``) and PyTorch load it back with the same logits. Returns the
    files written.

    Each encoder weight goes back through the inverse of the layout change KerasHub's
    converter made when reading it (transposes, reshapes, rows taken), starting from the
    checkpoint's own tensor for what the engine does not hold (XLM-RoBERTa's two padding
    positions); the token-type row folded into the positions is taken out again.
    """
    from tpu_helpers.data.hub import write_hub_weights

    source = getattr(model, "hub_source", None)
    if not isinstance(source, HubSource):
        raise EngineError(
            f"{type(model).__name__} was not made by keras3.classifier, so the hub's names"
            " of its weights are unknown. Fix: build it with keras3.classifier(checkpoint),"
            " or save it in the Keras format with model.save('model.keras')."
        )
    if "://" not in str(folder) and Path(folder).resolve() == source.folder.resolve():
        raise InputError(
            f"{folder} is the folder the model was read from; writing there would replace"
            " the checkpoint it still reads. Fix: another folder, e.g. f'{output_dir}/model'."
        )
    if "://" in str(folder):  # a bucket: written here, then copied
        import tempfile

        with tempfile.TemporaryDirectory() as local:
            names = save_hub_layout(
                model, local, id2label=id2label, max_shard_bytes=max_shard_bytes
            )
            gfile, target = _gfile(), str(folder).rstrip("/")
            gfile.makedirs(target)
            for name in names:
                gfile.copy(f"{local}/{name}", f"{target}/{name}", overwrite=True)
        return names
    folder = Path(folder)
    tensors = _hub_tensors(source)
    names = write_hub_weights(tensors, folder, max_shard_bytes)
    if source.mlm is not None:  # a masked_lm: no labels
        config = {**_float32_config(source.config), "architectures": [source.mlm.architecture]}
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        return [*names, "config.json", *_copy_preprocessing_files(source.folder, folder)]
    labels = int(source.layers[-1][1].units)
    named = source.config.get("id2label") or {}
    if len(named) != labels:  # a new head of another size: the checkpoint's names are not its
        named = {}
    id2label = {int(k): v for k, v in (id2label or {}).items()} or {
        i: named.get(str(i), f"LABEL_{i}") for i in range(labels)
    }
    if sorted(id2label) != list(range(labels)):
        raise InputError(
            f"id2label={id2label!r} must name each of the {labels} classes 0..{labels - 1}."
            f" Fix: {{0: 'negative', 1: 'positive'}} for two classes."
        )
    config = {
        **_float32_config(source.config),
        "architectures": [source.head.architecture],
        "id2label": {str(i): name for i, name in sorted(id2label.items())},
        "label2id": {name: i for i, name in sorted(id2label.items())},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    copied = _copy_preprocessing_files(source.folder, folder)
    return [*names, "config.json", *copied]


def _hub_tensors(source: HubSource) -> dict:
    """PyTorch name -> array of every weight the classifier holds."""
    reader, prefix = source.reader, _prefix(source.reader)
    type_row = None
    if source.head.folded and reader.find("embeddings.token_type_embeddings.weight"):
        type_row = reader.get_tensor("embeddings.token_type_embeddings.weight")[0]
    tensors = {}
    for variable, name, hook in reader.ported:
        full = reader.find(name) or prefix + name
        value = np.asarray(variable.value, np.float32)
        if type_row is not None and full.endswith("embeddings.position_embeddings.weight"):
            value = value - type_row
        original = reader.get_tensor(full) if full in reader.where else None
        tensors[_hub_name(reader, full)] = _unconvert(value, hook, original, full)
    for full in sorted(reader.read - set(reader.find(n) for _, n, _ in reader.ported)):
        tensors[_hub_name(reader, full)] = _as_float32(reader.get_tensor(full))  # token types
    for name, layer in source.layers:
        weights = [np.asarray(w, np.float32) for w in layer.get_weights()]
        if len(weights) == 1:  # the masked-LM head's bias per token: named in full
            tensors[name] = weights[0]
            continue
        kernel, bias = weights  # a dense layer's, or a layer norm's scale and offset
        tensors[f"{name}.weight"] = np.ascontiguousarray(kernel.T)  # PyTorch: [out, in]
        tensors[f"{name}.bias"] = bias
    return tensors


def _hub_name(reader: _Reader, full: str) -> str:
    """The name a classifier of the hub gives the file's tensor ``full``: with the model
    prefix the file's names lacked, if they did (transformers would otherwise take the
    saved classifier for a base model and drop its head)."""
    return reader.unprefixed + full if reader.unprefixed and full in reader.where else full


def _float32_config(config: dict) -> dict:
    """``config`` saying float32 where it names a dtype (transformers 4's ``torch_dtype``,
    5's ``dtype``): the weights written are float32, whatever the checkpoint read held."""
    return {**config, **{k: "float32" for k in ("torch_dtype", "dtype") if config.get(k)}}


def _as_float32(array: np.ndarray) -> np.ndarray:
    """A floating tensor in float32 (what the engine trains and saves), others as they are."""
    floating = array.dtype.name.startswith(("float", "bfloat"))  # bfloat16: ml_dtypes'
    return array.astype(np.float32) if floating else array


def _prefix(reader: _Reader) -> str:
    """The model prefix of the checkpoint's names (``bert.``), or ``""``."""
    for _, name, _ in reader.ported:
        full = reader.find(name)
        if full and full != name and full.endswith(name):
            return full[: -len(name)]
    return ""


def _unconvert(value: np.ndarray, hook, original, name: str) -> np.ndarray:
    """``value`` (Keras' layout) in the checkpoint's layout: the inverse of ``hook`` (a
    converter's function of the checkpoint's tensor), found by passing it the positions of
    that tensor's elements and writing ``value`` back at the positions it took."""
    if hook is None:
        return np.ascontiguousarray(
            value.reshape(original.shape if original is not None else value.shape)
        )
    shapes = [original.shape] if original is not None else [value.shape, value.shape[::-1]]
    for shape in shapes:
        positions = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
        taken = np.asarray(hook(positions, list(value.shape)))
        if taken.shape != value.shape:
            continue
        flat = taken.reshape(-1)
        exact = np.array_equal(flat, np.round(flat)) and len(np.unique(flat)) == flat.size
        whole = original is not None or flat.size == positions.size
        if not (exact and whole):
            break
        # float32 throughout: a bfloat16 or float16 checkpoint's own dtype would round away
        # the fine-tuning of every weight written back through it
        out = (
            original.astype(value.dtype) if original is not None else np.zeros(shape, value.dtype)
        ).reshape(-1)
        out[flat.astype(np.int64)] = value.reshape(-1)
        return out.reshape(shape).astype(value.dtype)
    raise EngineError(
        f"{name}: KerasHub's converter changed this weight in a way that is not a"
        " rearrangement of its elements, so it cannot be written back in the hub's layout."
        " Fix: save it in the Keras format (model.save('model.keras'))."
    )


def _copy_preprocessing_files(source: Path, target: Path) -> list[str]:
    """The checkpoint's tokenizer / processor files (every file but the weights and the
    config), copied into ``target``."""
    import shutil

    weights = (".safetensors", ".bin", ".h5", ".msgpack", ".ckpt", ".index.json", ".pt")
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(weights):
            shutil.copy(path, target / path.name)
            copied.append(path.name)
    return copied


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


class RunSaves:
    """A run's saves in ``directory`` (local or ``gs://``): ``state-<epoch>-<step>.npz``
    and ``latest.json`` naming the newest, written
    after it, so a save that stops half-way is never the one resumed. The two newest
    states are kept. Of several JAX processes (a pod slice's hosts), the first writes and
    every one waits for it (``save``), and every one reads (``restore``): the folder must
    be one they share (``gs://``). ``fit_resumable`` saves through it; so can a loop of one's own
    (``save(model, ResumePoint(epoch, step), values)`` with the values of the model's
    trainable, non-trainable and optimizer variables, in that order; ``restore(model)``)."""

    def __init__(self, directory: str, run: dict, log=say):
        self.directory, self.run, self.gfile = directory.rstrip("/"), run, _gfile()
        self.log, self.writer = log, is_writer()
        if self.writer:
            self.gfile.makedirs(self.directory)
        all_processes_reach(f"folder {self.directory}")  # it exists for every host

    def _write(self, name: str, data: bytes) -> None:
        partial = f"{self.directory}/{name}.partial"
        with self.gfile.GFile(partial, "wb") as f:
            f.write(data)
        self.gfile.rename(partial, f"{self.directory}/{name}", True)

    def latest(self) -> dict | None:
        path = f"{self.directory}/latest.json"
        if not self.gfile.exists(path):
            return None
        with self.gfile.GFile(path) as f:
            return json.load(f)

    def save(self, model, point: ResumePoint, values=None) -> None:
        """Save ``values`` (in the order of ``_state(model)``; the variables' own values
        when ``None``) as the state at ``point``."""
        failed = None
        if self.writer:  # one host of a pod slice writes; the others wait for it
            try:
                self._save(model, point, values)
            except Exception as error:  # told to every host, then raised on each
                failed = error
        if not first_process_says(failed is None):
            raise failed or EngineError(
                f"the first host could not write the save at {point} in {self.directory}"
                " (its log says why). Fix: a folder every host can write to (gs://)."
            )

    def _save(self, model, point: ResumePoint, values) -> None:
        variables = _state(model)
        if values is None:
            values = [np.asarray(v.value) for v in variables]
        buffer = io.BytesIO()
        np.savez(buffer, *values)
        name = f"state-{point.epoch}-{point.step}.npz"
        self._write(name, buffer.getvalue())
        before = self.latest()
        latest = {
            "file": name,
            "epoch": point.epoch,
            "step": point.step,
            "run": self.run,
            "variables": [[v.path, list(v.shape)] for v in variables],
            # a save of the same name (after a fall-back) keeps the one before it
            "previous": (before or {}).get(
                "previous" if before and before["file"] == name else "file"
            ),
        }
        self._write("latest.json", json.dumps(latest).encode())
        old = before and before.get("previous")
        keep = (name, latest["previous"])
        if old and old not in keep and self.gfile.exists(f"{self.directory}/{old}"):
            self.gfile.remove(f"{self.directory}/{old}")

    def restore(self, model) -> ResumePoint:
        """The point to resume from (``(0, 0)`` for a new run), with the saved state put
        into ``model`` and its optimizer."""
        latest = self.latest()
        if latest is None:
            return ResumePoint(0, 0)
        check_same_run(self.directory, latest["run"], self.run)
        variables = _state(model)
        have = [[v.path, list(v.shape)] for v in variables]
        saved = latest["variables"]
        # shapes in order: a model and optimizer made again have other layer numbers
        differ = next(
            (i for i, (h, w) in enumerate(zip(have, saved, strict=False)) if h[1] != w[1]),
            None if len(have) == len(saved) else min(len(have), len(saved)),
        )
        if differ is not None:
            raise CheckpointMismatchError(
                f"{self.directory}: the saved state does not fit this model: {len(have)}"
                f" variables here, {len(saved)} saved, the first difference at"
                f" #{differ} ({have[differ] if differ < len(have) else '-'} here,"
                f" {saved[differ] if differ < len(saved) else '-'}"
                " saved): another checkpoint, head or optimizer. Fix: a new directory."
            )
        for name in (latest["file"], latest.get("previous")):  # the newest whole one
            arrays = self._read(name, len(variables)) if name else None
            if arrays is not None:
                for variable, array in zip(variables, arrays, strict=True):
                    variable.assign(array)
                epoch, step = (int(n) for n in name[len("state-") : -len(".npz")].split("-"))
                return ResumePoint(epoch, step)
        raise CheckpointMismatchError(
            f"{self.directory}: no save of this run can be read ({latest['file']} and"
            f" {latest.get('previous') or 'no earlier one'}; see above). Fix: copy the"
            " folder again if it was copied, or pass a new folder to start afresh."
        )

    def _read(self, name: str, count: int) -> list | None:
        """The ``count`` arrays of state file ``name``, or ``None`` (said) when it is
        missing or cannot be read whole."""
        path = f"{self.directory}/{name}"
        try:
            with self.gfile.GFile(path, "rb") as f:
                saved = np.load(io.BytesIO(f.read()))
                return [saved[f"arr_{i}"] for i in range(count)]
        except Exception as err:  # noqa: BLE001 - missing, truncated, not a zip, short
            self.log(
                f"[keras3] {path} cannot be read ({type(err).__name__}: {first_line(err)});"
                " trying the save before it"
            )
            return None


class JaxTrainer:
    """The Keras 3 engine's side of ``engine.fit_with`` (the one training loop of both
    engines): each epoch through the model's ``steps.Steps`` (each width compiled once,
    ``steps_per_execution`` steps fused, batches put on the devices ahead), the state in
    ``RunSaves``. Keras callbacks are called at the train's and the epochs' beginnings and
    ends, and at each call's end (``on_train_batch_end`` with the call's last step; batch
    logs are empty, so that no call waits for the devices; the epoch's logs are whole).
    The state is read from the model's variables at each epoch's start, after the
    callbacks (a learning rate they set counts), and written back at its end."""

    def __init__(self, model, *, log=say, verbose=2):
        self.model, self.log, self.verbose = model, log, verbose
        self.hooks = None
        self.writer = is_writer()

    agree = staticmethod(first_process_says)  # each host's clock may differ

    def steps_per_epoch(self, batches) -> int:
        from tpu_helpers.keras3.steps import hosts

        return batches.steps_on_hosts(hosts()[0], self.steps.devices)

    def model_config(self):
        """The checkpoint's config, with ``num_labels`` the head's outputs."""
        source = getattr(self.model, "hub_source", None)
        if not isinstance(source, HubSource):
            return None
        classes = int(self.model.network.outputs[0].shape[-1])
        return SimpleNamespace(**{**source.config, "num_labels": classes})

    def source_fingerprint(self) -> str | None:
        """The fingerprint of the checkpoint the model was loaded from (``hub``)."""
        from tpu_helpers.data.hub import checkpoint_fingerprint

        source = getattr(self.model, "hub_source", None)
        return checkpoint_fingerprint(source.folder) if isinstance(source, HubSource) else None

    def check(self, train, validation) -> None:
        if getattr(self.model, "optimizer", None) is None:
            raise EngineError(
                "the model is not compiled. Fix: keras3.compile_classifier(model,"
                " learning_rate) or model.compile(...) before fit_resumable."
            )
        self.steps = _steps_for(self.model, train, validation, where="fit_resumable")

    def open(self, directory: str, run: dict, epochs: int) -> tuple[int, int]:
        self.saves, self.epochs = RunSaves(directory, run, self.log), epochs
        new = self.saves.latest() is None
        point = self.saves.restore(self.model)
        same_on_every_process([new, point.epoch, point.step], "the save to resume from")
        if new:  # the start: what a re-run after an interrupt reads
            self.saves.save(self.model, ResumePoint(0, 0))
        self.first_epoch, self.compiled = point.epoch, sum(self.steps.compiles.values())
        return point.epoch, point.step

    def train_epoch(self, train, validation, epoch, first, after_call, callbacks) -> tuple:
        import keras

        steps, per_epoch = self.steps, self.steps_per_epoch(train)
        if self.hooks is None:
            self.hooks = keras.callbacks.CallbackList(
                list(callbacks), model=self.model, epochs=self.epochs, steps=per_epoch, verbose=0
            )
            self.hooks.on_train_begin()
        if first and self.verbose:
            self.log(f"[keras3] resuming epoch {epoch + 1} at step {first} of {per_epoch}")
        self.hooks.on_epoch_begin(epoch)
        self.state = steps.state()  # after the callbacks: a learning rate they set counts
        if epoch == self.first_epoch:  # in the first epoch's time, as a first epoch pays it
            _precompile(steps, self.state, (train, epoch, first), (validation, 0, 0))

        def called(state, done):
            self.state = state
            self.hooks.on_train_batch_end(first + done - 1, {})
            after_call(first + done)

        self.state, report = steps.train(self.state, *_epoch(train, steps, epoch, first), called)
        logs = steps.results(self.state[3])
        if validation is not None:
            result = steps.evaluate(self.state[:2], *_epoch(validation, steps))
            logs.update({f"val_{k}": v for k, v in result.items()})
        self.state = steps.write_back(self.state)
        self.hooks.on_epoch_end(epoch, logs)
        total = sum(steps.compiles.values())
        report.new_compiles, self.compiled = total - self.compiled, total
        # each host counted its own rows: the epoch's are every host's
        report.examples, report.real_tokens = summed_over_processes(
            [report.examples, report.real_tokens]
        )
        if self.verbose:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in logs.items())
            self.log(
                f"[keras3] epoch {epoch + 1}: {report.steps} steps in {report.calls} calls,"
                f" {report.examples:,} examples, {report.seconds:.1f} s, {report.rate()};"
                f" {shown}; compiled"
                f" {report.new_compiles} new step(s), {total} in all"
            )
        return logs, report.steps

    def loss(self) -> float | None:
        """The epoch's mean loss so far (from the state's metrics: read from the devices)."""
        return self.steps.results(self.state[3]).get("loss")

    def save(self, epoch: int, step: int) -> None:
        values = self.steps.saved_values(self.state) if self.writer else None
        self.saves.save(self.model, ResumePoint(epoch, step), values)

    def finish(self) -> None:
        if self.hooks is not None:
            self.hooks.on_train_end()

    def predict(self, batches, strategy=None):
        if strategy is not None:
            raise EngineError(
                "a strategy is TensorFlow's; this model runs on the Keras 3 engine, whose"
                " devices keras3.connect set. Fix: predict_classes(model, batches)."
            )
        steps = _steps_for(self.model, batches, where="predict_classes")
        dataset, count = _epoch(batches, steps)
        logits, labels, weights, read = steps.predict(steps.weights(), dataset, count)
        if read < count:  # the data ended before its steps
            raise batches.ran_out(read, "predict_classes")
        return labels, np.argmax(logits, axis=-1), weights


def _steps_for(model, *batches, where: str):
    """The model's ``steps.Steps``, built for ``batches`` (``pipeline.Batches``, or
    ``None``), each refused with the fix unless its global batch splits over the devices."""
    from tpu_helpers.keras3.steps import Steps

    given = [require_batches(b, where) for b in batches if b is not None]
    steps = Steps.of(model)
    for plan in given:
        plan.per_replica_batch(steps.devices)  # refused with the fix unless it splits
    steps.build(given[0].first_batch(where))
    return steps


def _epoch(batches, steps, epoch: int = 0, first: int = 0) -> tuple:
    """``(dataset, steps)``: what this process feeds of ``batches``' epoch ``epoch`` from
    step ``first`` on (its rows of each global batch: ``Batches.host_dataset``), and how
    many steps that is."""
    from tpu_helpers.keras3.steps import hosts

    processes, process = hosts()
    dataset = batches.host_dataset(
        epoch, skip_steps=first, hosts=processes, host=process, devices=steps.devices
    )
    return dataset, batches.steps_on_hosts(processes, steps.devices) - first


def _precompile(steps, state, train, validation) -> None:
    """Compile the train step (and the evaluation's) for every width of the pipelines before
    the first step; each is ``(batches, epoch, first step)``, whose first batch's width
    compiles first (the steps start on it while the other widths compile)."""
    for kind, (batches, epoch, first) in (("train", train), ("evaluate", validation)):
        if batches is not None and batches.widths:
            # a batch of the width the run starts on: a resume point past one host's steps
            # (the filler steps of several hosts reading their own shards) takes the last
            first = min(first, batches.steps_per_epoch - 1)
            dataset = batches.dataset(epoch, skip_steps=first).take(1)
            steps.precompile(kind, state, next(dataset.as_numpy_iterator()), batches.widths)


def compilations(model) -> dict:
    """How many times each step of ``model`` was compiled in this session, by kind and
    batch shape: ``{("train", "[0]['input_ids'][32, 64] ..."): 1, ...}``. Each is 1 when
    every width compiled once, whatever the epochs, calls and resumes."""
    steps = getattr(model, "_tpu_helpers_steps", None)
    return dict(steps.compiles) if steps is not None else {}


def fit_resumable(model, train, epochs: int, directory: str, *, verbose=2, log=say, **options):
    """Train a compiled Keras 3 ``model`` (``classifier``, ``masked_lm``, a KerasHub task) on
    ``train`` (a ``pipeline.Batches``) to ``epochs`` epochs, resuming from the newest save
    in ``directory``: ``engine.fit_with`` with ``JaxTrainer`` (what it saves, checks and
    refuses is said there). ``options``: ``validation``, ``every_steps``,
    ``every_minutes``, ``run``, ``callbacks``. Returns every epoch's history."""
    _keras()  # Keras 3 on another backend is refused, with the fix
    require_engine_model(model, "keras3", "fit_resumable")
    ours, others = fit_options(options)
    if others:
        raise InputTypeError(
            f"{sorted(others)}: not options of fit_resumable on the Keras 3 engine (tf-keras'"
            " fit takes them on the TF engine). Fix: leave them out; validation=,"
            " callbacks=, verbose= and the save cadence are fit_resumable's own."
        )
    return fit_with(JaxTrainer(model, log=log, verbose=verbose), train, epochs, directory, **ours)


def predict_classes(model, batches, strategy=None):
    """``(labels, predictions, weights)`` of one epoch of ``batches`` through a Keras 3
    ``model``, split over the devices as in ``fit_resumable``: ``engine.predict_with``
    (a TF ``strategy`` is refused, naming the fix: the devices are ``connect``'s)."""
    _keras()  # Keras 3 on another backend is refused, with the fix
    require_engine_model(model, "keras3", "predict_classes")
    return predict_with(JaxTrainer(model), batches, strategy)


def evaluate(model, batches) -> dict:
    """The compiled metrics of ``model`` (loss included) over one epoch of ``batches``,
    split over the devices as in ``fit_resumable``."""
    steps = _steps_for(model, batches, where="keras3.evaluate")
    return steps.evaluate(steps.weights(), *_epoch(batches, steps))


def input_bound_check(model, batches, *, steps: int = 30, cached_batches: int = 8):
    """Where a compiled model's training time goes on the Keras 3 engine, as
    ``observe.input_bound_check`` says it for the TF engine (an ``InputBoundReport``: its
    verdict and advice): batches per second of ``batches``' first epoch read and put on the
    devices alone, of the compiled training call alone on ``cached_batches`` batches kept on
    the devices, and of the two together as ``fit_resumable`` runs them. Every width is
    compiled first; the check trains ``steps`` steps three times over on copies of the
    state, and leaves the model's variables as they were."""
    from tpu_helpers.core.pipeline import InputBoundReport

    check_positive(steps=steps, cached_batches=cached_batches)
    if getattr(model, "optimizer", None) is None:
        raise EngineError(
            "the model is not compiled: the check runs its training step. Fix:"
            " model.compile(...) (or keras3.compile_classifier) first."
        )
    steps_ = _steps_for(model, batches, where="keras3.input_bound_check")
    _precompile(steps_, steps_.state(), (batches, 0, 0), (None, 0, 0))
    dataset, _ = _epoch(batches, steps_)
    alone, step, together = steps_.rates(dataset.repeat(), steps, cached_batches)
    return InputBoundReport(alone, step, together, steps)
