"""Checkpoints as the hub serves them, loaded into the TensorFlow classes of transformers.

The TF classes of transformers 4.57.6, the last release that has them, prefer a checkpoint's
``model.safetensors`` and then fail reading it when PyTorch wrote it (``TypeError:
'builtins.safe_open' object is not iterable``, transformers issue 40028).
``from_pretrained`` here reads every layout ``hub.find_weights`` finds:

=====================================================  ==========================================
files (local folder or hub repository)                 how they load
=====================================================  ==========================================
``model.safetensors`` with PyTorch names               PyTorch names mapped onto the TF weights
``model-0000N-of-0000M.safetensors`` + index           the same, shard by shard
safetensors written by a TF class (``format: tf``)     transformers' own loader
``tf_model.h5`` (or sharded) and no safetensors        transformers' own loader
``pytorch_model.bin`` only                             refused: a pickle needs PyTorch to read
=====================================================  ==========================================

Under the ``mixed_bfloat16`` policy the model computes in bfloat16 and returns float32
outputs (``float32_outputs``), so that losses and metrics are computed in float32.
Every weight of the model's encoder must come from the file; a new head (a classifier for
other labels) starts at random, and transformers says which weights it initialised.
``save_hub_layout`` writes a TF model back in the hub's layout (PyTorch names), the files
that transformers 5, PyTorch and KerasHub read.

>>> from transformers import TFAutoModelForSequenceClassification
>>> model = from_pretrained(TFAutoModelForSequenceClassification, "distilbert-base-cased",
...                         num_labels=2)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tpu_helpers.core.errors import CheckpointFormatError, InputTypeError
from tpu_helpers.core.storage import copy_tree, is_remote
from tpu_helpers.data.hub import (
    HUB_OPTIONS,
    SAFETENSORS,
    Weights,
    check_folder_exists,
    find_weights,
    hub_options,
    open_safetensors,
    write_hub_weights,
)

__all__ = ["from_pretrained", "float32_outputs", "save_hub_layout", "save_pretrained"]


def from_pretrained(model_class, checkpoint, **kwargs):
    """``model_class.from_pretrained(checkpoint, **kwargs)`` for every layout the hub serves.

    ``model_class`` is a TF class of transformers (``TFAutoModelForSequenceClassification``,
    ``TFAutoModelForMaskedLM`` ...); ``kwargs`` are ``from_pretrained``'s (``num_labels``,
    ``id2label``, ``ignore_mismatched_sizes``, ``revision``, ``config`` ...). Create the
    model inside ``strategy.scope()`` as usual. Raises ``CheckpointFormatError`` for a
    checkpoint with PyTorch pickles only, or whose weights do not fit ``model_class``'s
    encoder.
    """
    checkpoint = check_folder_exists(checkpoint)
    if kwargs.get("from_pt"):  # the caller has PyTorch and asks for its pickles
        return model_class.from_pretrained(checkpoint, **kwargs)
    kwargs.pop("use_safetensors", None)  # the files found decide it
    weights = find_weights(checkpoint, **hub_options(kwargs))
    if weights.layout == "pytorch-pickle":
        raise CheckpointFormatError(
            f"{checkpoint!r} holds its weights only as {Path(weights.files[0]).name}, a"
            " PyTorch pickle, which TensorFlow cannot read. Fix: pick a revision of it that"
            f" has {SAFETENSORS} (many repositories have one in a pull request opened by the"
            " hub's safetensors conversion, revision='refs/pr/N'), or convert it where PyTorch"
            " is installed: torch.load the file and safetensors.torch.save_file it as"
            f" {SAFETENSORS}; or install torch and pass from_pt=True."
        )
    if weights.layout != "pytorch-safetensors":
        use_safetensors = weights.layout == "tf-safetensors"
        loaded = model_class.from_pretrained(checkpoint, use_safetensors=use_safetensors, **kwargs)
    else:
        loaded = _from_pytorch_names(model_class, checkpoint, weights, kwargs)
    float32_outputs(loaded[0] if isinstance(loaded, tuple) else loaded)
    return loaded


def float32_outputs(model):
    """Make ``model`` (a transformers TF model) return its floating outputs (logits, hidden
    states) in float32 when it computes in another dtype, as under ``mixed_bfloat16``:
    Keras' rule for mixed precision (the model's outputs in float32), so that every loss and
    metric on them is computed in float32. The layers still compute in bfloat16; the
    variables stay float32. Does nothing to a float32 model. Returns ``model``."""
    import functools

    import tensorflow as tf

    if model.compute_dtype == "float32" or getattr(model, "_float32_outputs", False):
        return model
    call = model.call

    @functools.wraps(call)
    def call_with_float32_outputs(*args, **kwargs):
        outputs = call(*args, **kwargs)
        items = outputs.items() if hasattr(outputs, "items") else ()
        for name, value in list(items):
            if tf.is_tensor(value) and value.dtype.is_floating and value.dtype != tf.float32:
                outputs[name] = tf.cast(value, tf.float32)
        if tf.is_tensor(outputs) and outputs.dtype.is_floating:
            outputs = tf.cast(outputs, tf.float32)
        return outputs

    model.call = call_with_float32_outputs
    model._float32_outputs = True
    return model


def _from_pytorch_names(model_class, checkpoint: str, weights: Weights, kwargs: dict):
    """A TF model built from its config, its weights read from PyTorch-named safetensors."""
    from transformers import AutoConfig
    from transformers.modeling_tf_pytorch_utils import _log_key_warnings

    kwargs = dict(kwargs)
    ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
    with_info = kwargs.pop("output_loading_info", False)
    config = kwargs.pop("config", None)
    options = {k: kwargs.pop(k) for k in HUB_OPTIONS if k in kwargs}
    if config is None:
        config, kwargs = AutoConfig.from_pretrained(
            checkpoint, return_unused_kwargs=True, **options, **kwargs
        )
    config.name_or_path = checkpoint
    model = model_class.from_config(config, **kwargs)
    model.build_in_name_scope()
    infos = [
        _shard_loading_info(model, shard, checkpoint, ignore_mismatched) for shard in weights.files
    ]
    info = {  # missing if no shard had it; unexpected or mismatched if one shard said so
        "missing_keys": sorted(set.intersection(*(set(i["missing_keys"]) for i in infos))),
        "unexpected_keys": sorted({k for i in infos for k in i["unexpected_keys"]}),
        "mismatched_keys": [k for i in infos for k in i["mismatched_keys"]],
    }
    _require_encoder_loaded(model, checkpoint, info["missing_keys"])
    _log_key_warnings(
        info["missing_keys"],
        info["unexpected_keys"],
        info["mismatched_keys"],
        class_name=type(model).__name__,
    )
    return (model, info) if with_info else model


def _shard_loading_info(model, shard: str, checkpoint: str, ignore_mismatched: bool) -> dict:
    """The loading info (missing, unexpected and mismatched keys) of one safetensors
    ``shard`` of ``checkpoint`` read into ``model``; a weight of another shape than the
    model makes is a ``CheckpointFormatError`` that says how to fix it."""
    from transformers.modeling_tf_pytorch_utils import load_pytorch_state_dict_in_tf2_model

    with _PyTorchTensors(shard) as tensors:
        try:
            _, info = load_pytorch_state_dict_in_tf2_model(
                model,
                tensors,
                tf_inputs=False,
                allow_missing_keys=True,
                output_loading_info=True,
                ignore_mismatched_sizes=ignore_mismatched,
                tf_to_pt_weight_rename=getattr(model, "tf_to_pt_weight_rename", None),
                skip_logger_warnings=True,
            )
        except TypeError as error:  # its own InvalidArgumentError(message) is malformed
            if "InvalidArgumentError" not in str(error):
                raise
            raise CheckpointFormatError(
                f"A weight in {checkpoint!r} has another shape than {type(model).__name__}"
                " makes for this config (a head for another number of labels, most"
                " often). Fix: pass ignore_mismatched_sizes=True to start those weights"
                " new (transformers names them), or the config the checkpoint was"
                " trained with."
            ) from None
    return info


class _PyTorchTensors(Mapping):
    """One safetensors file as the name -> tensor mapping transformers' converter iterates
    (the open archive itself has ``keys()`` but no ``__iter__``: the bug this avoids).
    Tensors are read one at a time, in TensorFlow's format (bfloat16 files included)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self._context = open_safetensors(self.path, framework="tf")
        self._archive = self._context.__enter__()
        self._keys = list(self._archive.keys())
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def __getitem__(self, key):
        return self._archive.get_tensor(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


def _encoder_pytorch_names(model) -> dict[str, str]:
    """PyTorch name -> TF name of every weight of ``model``'s encoder (its main layer), in
    both namings a checkpoint may use (with the base model's prefix, or without)."""
    from transformers.modeling_tf_pytorch_utils import convert_tf_weight_name_to_pt_weight_name

    main = getattr(model, model.base_model_prefix, None)
    if main is None:
        return {}
    names = {}
    for weight in main.weights:
        for prefix in ("", model.base_model_prefix + "."):
            name, _ = convert_tf_weight_name_to_pt_weight_name(
                weight.name, start_prefix_to_remove=prefix, tf_weight_shape=weight.shape
            )
            names[name] = weight.name
    return names


# Weights an encoder checkpoint may lack without being the wrong file: the pooler (masked-LM
# checkpoints are saved without one) is new, like a head.
_MAY_BE_NEW = ("pooler",)


def _require_encoder_loaded(model, checkpoint: str, missing: list[str]) -> None:
    """Refuse a load that would leave part of the encoder at random (a file of another
    family, or names this converter does not know)."""
    encoder = _encoder_pytorch_names(model)
    lost = [k for k in missing if k in encoder and not any(p in k for p in _MAY_BE_NEW)]
    if lost:
        raise CheckpointFormatError(
            f"{len(lost)} weights of {type(model).__name__}'s encoder are not in {checkpoint!r}"
            f" (first: {lost[0]}), so they would start at random. The checkpoint holds another"
            f" architecture than its config's model_type {model.config.model_type!r}, or"
            " names this TF class does not know. Fix: load it with the model class its"
            " config.json names under 'architectures', or use a checkpoint of this family."
        )


def save_hub_layout(model, folder, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``model``'s weights (a TF class of transformers) to ``folder`` as the hub
    serves them: PyTorch names and layouts in ``model.safetensors`` (metadata
    ``format: pt``), or in shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``; and its ``config.json``. Returns the files written.

    These are the files PyTorch, transformers 5 and KerasHub load; ``from_pretrained``
    above loads them back into the TF class.
    """
    import numpy as np

    names = write_hub_weights(_pytorch_tensors(model, np), folder, max_shard_bytes)
    model.config.save_pretrained(folder)
    return [*names, "config.json"]


def _pytorch_tensors(model, np) -> dict:
    """PyTorch name -> array (in PyTorch's layout) of every weight of a TF model."""
    from transformers.modeling_tf_pytorch_utils import (
        TransposeType,
        convert_tf_weight_name_to_pt_weight_name,
    )

    to_pytorch = {  # the inverse of each transpose transformers applies when loading
        TransposeType.NO: lambda a: a,
        TransposeType.SIMPLE: lambda a: a.T,
        TransposeType.CONV1D: lambda a: np.transpose(a, (2, 1, 0)),
        TransposeType.CONV2D: lambda a: np.transpose(a, (3, 2, 0, 1)),
    }
    tensors = {}
    for weight in model.trainable_weights + model.non_trainable_weights:
        name, transpose = convert_tf_weight_name_to_pt_weight_name(
            weight.name, tf_weight_shape=weight.shape
        )
        if name in tensors:
            raise CheckpointFormatError(f"two weights of the model map to {name}")
        tensors[name] = np.ascontiguousarray(to_pytorch[transpose](weight.numpy()))
    return tensors


def save_pretrained(output_dir: str, *objects) -> list[str]:
    """``obj.save_pretrained`` for each object (model, tokenizer, processor) into
    ``output_dir``, local or remote. Returns the files written.

    A TF model is written as ``distilbert-base-cased`` is on the hub: ``tf_model.h5`` and,
    beside it, PyTorch-named ``model.safetensors`` (``save_hub_layout``), which
    PyTorch, transformers 5 and KerasHub load too."""
    unsavable = [type(o).__name__ for o in objects if not hasattr(o, "save_pretrained")]
    if not objects or unsavable:
        raise InputTypeError(
            f"save_pretrained saves objects that have .save_pretrained (models, tokenizers,"
            f" processors); got {unsavable or 'nothing'}. Fix:"
            " save_pretrained(output_dir, model, tokenizer)."
        )
    if not is_remote(output_dir):
        os.makedirs(output_dir, exist_ok=True)
        for obj in objects:
            _save(obj, output_dir)
        return sorted(os.path.join(output_dir, f) for f in os.listdir(output_dir))
    with tempfile.TemporaryDirectory() as staging:
        for obj in objects:
            _save(obj, staging)
        return copy_tree(staging, output_dir)


def _save(obj, folder: str) -> None:
    if hasattr(obj, "trainable_weights") and hasattr(obj, "config"):  # a TF model
        obj.save_pretrained(folder, safe_serialization=False)
        save_hub_layout(obj, folder)
    else:
        obj.save_pretrained(folder)
