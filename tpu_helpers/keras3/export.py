"""A trained Keras 3 classifier or masked LM written back in the hub's layout
(``config.json``, PyTorch-named safetensors, the tokenizer's files).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tpu_helpers.core import storage
from tpu_helpers.core.errors import (
    EngineError,
    InputError,
)
from tpu_helpers.keras3.models import HubSource, _Reader

__all__ = [
    "save_hub_layout",
]


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

    source = _exportable_source(model, folder)
    if "://" in str(folder):  # a bucket: written here, then copied
        import tempfile

        with tempfile.TemporaryDirectory() as local:
            names = save_hub_layout(
                model, local, id2label=id2label, max_shard_bytes=max_shard_bytes
            )
            storage.copy_tree(local, str(folder))
        return names
    folder = Path(folder)
    if source.mlm is not None:  # a masked_lm: no labels
        config = {**_float32_config(source.config), "architectures": [source.mlm.architecture]}
    else:  # checked before any file is written: a refused save leaves nothing half done
        config = _classifier_config(source, id2label)
    names = write_hub_weights(_hub_tensors(source), folder, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return [*names, "config.json", *_copy_preprocessing_files(source.folder, folder)]


def _exportable_source(model, folder) -> HubSource:
    """The ``HubSource`` of a model that ``keras3.classifier`` (or ``masked_lm``) made, or
    an error when it has none or ``folder`` is the folder it was read from."""
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
    return source


def _classifier_config(source: HubSource, id2label: dict | None) -> dict:
    """The ``config.json`` of the classifier: the checkpoint's (in float32) with the head's
    architecture and a name for each class, from ``id2label``, the checkpoint's names
    when its head has as many classes, or ``LABEL_i``."""
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
    return {
        **_float32_config(source.config),
        "architectures": [source.head.architecture],
        "id2label": {str(i): name for i, name in sorted(id2label.items())},
        "label2id": {name: i for i, name in sorted(id2label.items())},
    }


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
    for full in reader.derived:  # computed, not trained (Swin's relative position index)
        tensors[_hub_name(reader, full)] = reader.get_tensor(full)
    fused = _FUSED.get(source.config.get("model_type"))
    if fused:  # weights the converter fused into one: split again, as trained
        for name, value in fused(source.backbone).items():
            tensors[_hub_name(reader, reader.find(name) or prefix + name)] = value
    for name, layer in source.layers:
        weights = [np.asarray(w, np.float32) for w in layer.get_weights()]
        if len(weights) == 1:  # the masked-LM head's bias per token: named in full
            tensors[name] = weights[0]
            continue
        kernel, bias = weights  # a dense layer's, or a layer norm's scale and offset
        tensors[f"{name}.weight"] = np.ascontiguousarray(kernel.T)  # PyTorch: [out, in]
        tensors[f"{name}.bias"] = bias
    return tensors


def _swin_qkv(backbone) -> dict:
    """Swin's query, key and value of every block, by their names as KerasHub's converter
    reads them: the converter concatenates the three into one dense layer (``attn.qkv``,
    assigned, not ported), which a step trains as one."""
    tensors = {}
    for i, stage in enumerate(backbone.stages):
        for j, block in enumerate(stage.blocks):
            kernel = np.asarray(block.attn.qkv.kernel.value, np.float32).T  # [3 x out, in]
            bias = block.attn.qkv.bias
            bias = np.asarray(bias.value, np.float32) if bias is not None else None
            for k, part in enumerate(("query", "key", "value")):
                name = f"encoder.layers.{i}.blocks.{j}.attention.self.{part}"
                rows = slice(k * kernel.shape[0] // 3, (k + 1) * kernel.shape[0] // 3)
                tensors[f"{name}.weight"] = np.ascontiguousarray(kernel[rows])
                if bias is not None:
                    tensors[f"{name}.bias"] = bias[rows]
    return tensors


#: Families whose converter fuses the file's tensors into one weight: how to split it.
_FUSED = {"swin": _swin_qkv}


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
