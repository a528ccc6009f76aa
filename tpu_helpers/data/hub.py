"""The hub's files, for both engines: where a checkpoint's weights are, and its tokenizer.

Nearly every checkpoint on the hub holds ``model.safetensors`` written by PyTorch (weight
names like ``distilbert.embeddings.word_embeddings.weight``, metadata ``format: pt``), alone
or sharded (``model.safetensors.index.json``), sometimes beside a ``tf_model.h5``.
``find_weights`` says which layout a folder or hub repository holds (a ``pytorch_model.bin``
alone is refused: a pickle needs PyTorch to read), ``open_safetensors`` reads one file
without PyTorch, ``checkpoint_fingerprint`` names the weights a run started from, and
``write_hub_weights`` writes PyTorch-named tensors back as the hub serves them (sharded with
an index when large). ``load_tokenizer`` also reads tokenizer files written by transformers
5, whose ``tokenizer_class`` (``TokenizersBackend``) transformers 4 does not know. Loading
into a model is each engine's: ``keras3.classifier`` (KerasHub), ``tf_classes.from_pretrained``
(transformers' TF classes).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.errors import CheckpointFormatError

__all__ = [
    "CheckpointFormatError",
    "HUB_OPTIONS",
    "hub_options",
    "resolve_file",
    "check_folder_exists",
    "Weights",
    "find_weights",
    "open_safetensors",
    "checkpoint_fingerprint",
    "load_tokenizer",
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


def hub_options(kwargs: dict) -> dict:
    """The entries of ``kwargs`` that say where the hub's files come from (``HUB_OPTIONS``)."""
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


def resolve_file(checkpoint: str, filename: str, options: dict) -> str | None:
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
        single = resolve_file(checkpoint, name, options)
        listed = None if single else resolve_file(checkpoint, index, options)
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
        found = resolve_file(checkpoint, name, options)
        if found:
            return Weights("pytorch-pickle", (found,), name.endswith(".json"))
    raise CheckpointFormatError(
        f"{checkpoint!r} has no model weights: none of {SAFETENSORS}, {SAFETENSORS_INDEX},"
        f" {TF_H5} or {TORCH_PICKLES[0]} (a folder must hold them, a hub name must be a"
        " model repository, spelled as on its page). Fix: check the name, the revision and"
        " the subfolder, and that the runtime reaches the hub (or HF_HUB_OFFLINE is unset)."
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
        config = AutoConfig.from_pretrained(checkpoint, **hub_options(kwargs))
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


def write_hub_weights(tensors: dict, folder, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``tensors`` (PyTorch name -> array in PyTorch's layout) to ``folder`` as the
    hub serves them: ``model.safetensors`` (metadata ``format: pt``), or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``. Returns the files written."""
    import numpy as np
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
        # safetensors (0.8) writes an array's buffer as it lies, strides ignored: a
        # transposed view would be written as its untransposed self
        shard = {key: np.ascontiguousarray(array) for key, array in shard.items()}
        save_file(shard, str(folder / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(int(a.nbytes) for a in tensors.values())},
            "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in s},
        }
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        names.append(SAFETENSORS_INDEX)
    return names


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
