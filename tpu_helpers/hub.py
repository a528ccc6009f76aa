"""Checkpoints as the hub serves them, loaded into the TensorFlow classes of transformers.

Nearly every checkpoint on the hub holds ``model.safetensors`` written by PyTorch (weight
names like ``distilbert.embeddings.word_embeddings.weight``, metadata ``format: pt``), alone
or sharded (``model.safetensors.index.json``), sometimes beside a ``tf_model.h5``. The TF
classes of transformers 4.57.6, the last release that has them, prefer that file and then
fail reading it (``TypeError: 'builtins.safe_open' object is not iterable``, transformers
issue 40028). ``from_pretrained`` here reads every layout:

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
``load_tokenizer`` also reads tokenizer files written by transformers 5, whose
``tokenizer_class`` (``TokenizersBackend``) transformers 4 does not know.
``save_hub_layout`` writes a TF model back in the hub's layout (PyTorch names), the files
that transformers 5, PyTorch and KerasHub read.

>>> from transformers import TFAutoModelForSequenceClassification
>>> model = from_pretrained(TFAutoModelForSequenceClassification, "distilbert-base-cased",
...                         num_labels=2)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tpu_helpers.checks import first_line
from tpu_helpers.errors import CheckpointFormatError

__all__ = [
    "CheckpointFormatError",
    "check_folder_exists",
    "Weights",
    "find_weights",
    "float32_outputs",
    "from_pretrained",
    "load_tokenizer",
    "save_hub_layout",
    "write_hub_weights",
]

logger = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TF_H5 = "tf_model.h5"
TF_H5_INDEX = "tf_model.h5.index.json"
TORCH_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
HUB_OPTIONS = ("revision", "cache_dir", "token", "subfolder", "local_files_only")


@dataclass(frozen=True)
class Weights:
    """Where a checkpoint's weights are and how they are named.

    ``layout`` is ``"pytorch-safetensors"``, ``"tf-safetensors"``, ``"tf-h5"`` or
    ``"pytorch-pickle"``; ``files`` are local paths (shards in order), ``sharded`` whether
    an index lists them.
    """

    layout: str
    files: tuple[str, ...]
    sharded: bool = False


def _hub_options(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in HUB_OPTIONS if k in kwargs}


def check_folder_exists(checkpoint) -> str:
    """``checkpoint`` as the loaders take it (``~`` expanded), or refused if written as a
    path (``/``, ``./``, ``~``, or more than one ``/``: no hub name has two) that is no
    folder here, naming the working directory a relative path is read from: transformers
    would call it a malformed hub name."""
    name = str(checkpoint)
    if name.startswith("~"):
        name = str(Path(name).expanduser())
    path_like = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
    if "://" in name or not path_like or Path(name).is_dir():
        return name
    raise CheckpointFormatError(
        f"{name!r} is not a folder here (a relative path is read from {os.getcwd()}), and a"
        " hub name is 'name' or 'owner/name'. Fix: the folder's absolute path, or the"
        " model's name as its hub page spells it."
    )


def _resolve(checkpoint: str, filename: str, options: dict) -> str | None:
    """The local path of ``filename`` in a folder or hub repository, or None if it has none."""
    from transformers.utils import cached_file

    checkpoint = check_folder_exists(checkpoint)

    return cached_file(
        checkpoint,
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **options,
    )


def _shards(checkpoint: str, index: str, options: dict) -> tuple[str, ...]:
    from transformers.utils.hub import get_checkpoint_shard_files

    files, _ = get_checkpoint_shard_files(checkpoint, index, **options)
    return tuple(files)


def open_safetensors(path, framework: str = "np"):
    """``safetensors.safe_open(path)``; a missing, truncated or damaged file (an
    interrupted download, a shard left out of a copy) refused naming it and the fix."""
    from safetensors import SafetensorError, safe_open

    fix = (
        "Fix: download the checkpoint again, every file its index names (remove the"
        " folder, or its copy in the hub cache: hf cache delete), then load it again."
    )
    try:
        return safe_open(str(path), framework=framework)
    except FileNotFoundError as err:
        raise CheckpointFormatError(
            f"{path} is not there, though the checkpoint's index lists it. {fix}"
        ) from err
    except (SafetensorError, OSError) as err:
        raise CheckpointFormatError(
            f"{path} cannot be read ({first_line(err)}): a truncated or damaged file. {fix}"
        ) from err


def weights_fingerprint(files) -> str:
    """A short fingerprint of a checkpoint's weight files (local paths): a hash of each
    file's size and of its first and last MiB (the header, the first and the last
    tensors), so two checkpoints with the same shapes and other values differ, read in
    milliseconds whatever the size."""
    import hashlib

    digest, chunk = hashlib.sha256(), 1 << 20
    for path in sorted(str(f) for f in files):
        size = Path(path).stat().st_size
        with open(path, "rb") as file:
            digest.update(str(size).encode())
            digest.update(file.read(chunk))
            file.seek(max(0, size - chunk))
            digest.update(file.read(chunk))
    return f"weights {digest.hexdigest()[:16]}"


def checkpoint_fingerprint(checkpoint) -> str | None:
    """``weights_fingerprint`` of the files ``checkpoint`` (a folder or a hub name already
    in the cache) loads from, or ``None`` where they cannot be found without the network."""
    try:
        files = find_weights(str(checkpoint), local_files_only=True).files
        return weights_fingerprint(files)
    except (OSError, ValueError, CheckpointFormatError):
        return None


def _safetensors_format(path: str) -> str | None:
    with open_safetensors(path) as archive:
        return (archive.metadata() or {}).get("format")


def find_weights(checkpoint: str, **options) -> Weights:
    """Which of the hub's weight layouts ``checkpoint`` (a folder or a hub name) has.

    Safetensors come first, as in ``from_pretrained``; a file without a ``format`` in its
    metadata is taken to hold PyTorch names (what ``safetensors.torch`` writes by default).
    ``options``: ``revision``, ``cache_dir``, ``token``, ``subfolder``, ``local_files_only``.
    """
    checkpoint = check_folder_exists(checkpoint)
    for name, index in ((SAFETENSORS, SAFETENSORS_INDEX), (TF_H5, TF_H5_INDEX)):
        single = _resolve(checkpoint, name, options)
        listed = None if single else _resolve(checkpoint, index, options)
        if not (single or listed):
            continue
        try:
            files = (single,) if single else _shards(checkpoint, listed, options)
        except OSError as err:  # a shard the index lists is not there
            raise CheckpointFormatError(
                f"{checkpoint!r}: {first_line(err)} Fix: download the checkpoint again,"
                f" every file {index} names (remove the folder, or its copy in the hub"
                " cache: hf cache delete), then load it again."
            ) from err
        if name == TF_H5:
            return Weights("tf-h5", files, bool(listed))
        named = "tf" if _safetensors_format(files[0]) == "tf" else "pytorch"
        return Weights(f"{named}-safetensors", files, bool(listed))
    for name in TORCH_PICKLES:
        found = _resolve(checkpoint, name, options)
        if found:
            return Weights("pytorch-pickle", (found,), name.endswith(".json"))
    raise CheckpointFormatError(
        f"{checkpoint!r} has no model weights: none of {SAFETENSORS}, {SAFETENSORS_INDEX},"
        f" {TF_H5} or {TORCH_PICKLES[0]} (a folder must hold them, a hub name must be a"
        " model repository, spelled as on its page). Fix: check the name, the revision and"
        " the subfolder, and that the runtime reaches the hub (or HF_HUB_OFFLINE is unset)."
    )


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
    weights = find_weights(checkpoint, **_hub_options(kwargs))
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
    from transformers.modeling_tf_pytorch_utils import (
        _log_key_warnings,
        load_pytorch_state_dict_in_tf2_model,
    )

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
    infos = []
    for shard in weights.files:
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
        infos.append(info)
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


def load_tokenizer(checkpoint, **kwargs):
    """``AutoTokenizer.from_pretrained(checkpoint)``, also for files saved by transformers 5.

    Those name the class ``TokenizersBackend`` (or another class transformers 4 lacks); the
    tokenizer is then the fast class of the checkpoint's model type, read from its
    ``tokenizer.json``, which holds the whole tokenizer (vocabulary, pre-tokenizer,
    templates).
    """
    from transformers import AutoConfig, AutoTokenizer

    checkpoint = check_folder_exists(checkpoint)
    try:  # a tokenizer alone (no config.json) is a tokenizer still
        config = AutoConfig.from_pretrained(checkpoint, **_hub_options(kwargs))
    except (OSError, ValueError):
        config = None
    try:
        return _with_token_types(AutoTokenizer.from_pretrained(checkpoint, **kwargs), config)
    except ValueError as error:
        if "does not exist or is not currently imported" not in str(error):
            raise
        if config is None:
            raise
        unknown = error
    model_type = config.model_type
    logger.info("%s: tokenizer files of another transformers; read as %s's", checkpoint, model_type)
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, tokenizer_type=model_type, **kwargs)
        return _with_token_types(tokenizer, config)
    except ValueError as error:
        raise CheckpointFormatError(
            f"{checkpoint!r}: its tokenizer_config.json names a tokenizer class this"
            f" transformers does not have ({unknown}), and its model type {model_type!r} has"
            f" no tokenizer here either ({error}). Fix: pass a tokenizer of the same"
            " vocabulary, or PreTrainedTokenizerFast(tokenizer_file=.../tokenizer.json)."
        ) from error


def _with_token_types(tokenizer, config):
    """``tokenizer``, giving ``token_type_ids`` when the model has token types to take.

    transformers 5 reads tokenizer files that name ``TokenizersBackend`` as a class that
    gives only ``input_ids`` and ``attention_mask``; a BERT or ALBERT would then see both
    sentences of a pair as the first one. The files' template (``tokenizer.json``) still
    numbers the segments, so asking for them is enough.
    """
    names = list(tokenizer.model_input_names)
    if getattr(config, "type_vocab_size", 0) > 1 and "token_type_ids" not in names:
        tokenizer.model_input_names = [*names, "token_type_ids"]
    return tokenizer


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


def write_hub_weights(tensors: dict, folder, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``tensors`` (PyTorch name -> array in PyTorch's layout) to ``folder`` as the
    hub serves them: ``model.safetensors`` (metadata ``format: pt``), or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``. Returns the files written."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [
        folder / SAFETENSORS,
        folder / SAFETENSORS_INDEX,
        *folder.glob("model-*-of-*.safetensors"),
    ]:
        old.unlink(missing_ok=True)  # an earlier save of the other layout would be read first
    shards = _split(tensors, max_shard_bytes)
    names = (
        [SAFETENSORS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(int(a.nbytes) for a in tensors.values())},
            "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in s},
        }
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        names.append(SAFETENSORS_INDEX)
    return names


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


def _split(tensors: dict, max_bytes: int | None) -> list[dict]:
    """Consecutive shards of at most ``max_bytes`` each (a larger tensor alone in one)."""
    shards, size = [{}], 0
    for name, array in tensors.items():
        if max_bytes and shards[-1] and size + array.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    return shards
