"""Decoder LLMs (KerasHub's ``CausalLM`` from the hub's files): what notebook 10 plugs in
beside its page, where the stock way has no answer.

==========================  ==============================================================
``hub_folder``              a decoder checkpoint's local folder (fetched once from the hub),
                            a family the notebook's export and tests cover, or the fix
``gemma3_differences``      what KerasHub's Gemma 3 computes otherwise than a config says
``require_chat_template``   a tokenizer that has a chat template, or the fix
``lora_targets``            the family's names of the layers LoRA goes on
``lora_parameter_count``    the weights ``enable_lora`` adds, from the config alone
``memory_plan``             whether a decoder's weights, its LoRA state and a batch fit a
                            chip's memory, from sizes alone, before anything is loaded
``match_config``            every RMSNorm computing with the checkpoint's epsilon (KerasHub
                            0.32 leaves some at its own defaults)
``check_model_axis``        a model axis that divides the query and key-value heads
``accept_full_masks``       Gemma 3's decoder blocks taking a packed row's whole mask
``replicated_weights``      large weights a layout map left whole on every device
``save_merged``             a LoRA-tuned ``CausalLM`` back in the hub's layout, LoRA merged
``save_adapter``            its LoRA factors alone, as a PEFT adapter of the base checkpoint
==========================  ==============================================================

>>> plan = memory_plan(params=600_000_000, dtype="bfloat16", lora_params=2_000_000,
...                    rows_per_chip=4, sequence_length=512, hidden=1024, layers=28,
...                    heads=16, vocab=151_936)
>>> plan.fits
True
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpu_helpers.core.errors import EngineError, ExistingFileError, InputError

__all__ = [
    "DECODER_FAMILIES",
    "hub_folder",
    "gemma3_differences",
    "require_chat_template",
    "LORA_ATTENTION",
    "LORA_MLP",
    "lora_targets",
    "lora_parameter_count",
    "V5E_CHIP_BYTES",
    "MemoryPlan",
    "memory_plan",
    "match_config",
    "check_model_axis",
    "accept_full_masks",
    "replicated_weights",
    "save_merged",
    "save_adapter",
]

#: The families of ``model_type`` whose KerasHub converter, merged export and NumPy reference
#: (``tests/test_decoders.py``) are held equal here: Qwen 3, Llama 3 and Gemma 3's text models.
DECODER_FAMILIES = ("qwen3", "llama", "gemma3_text")
#: KerasHub's names of the layers LoRA goes on: the attention's query and value (its
#: default, in every family), and the gated MLP's three projections (gate, up, down), which
#: KerasHub's Gemma names otherwise.
LORA_ATTENTION = ("query", "value")
LORA_MLP = ("feedforward_gate_dense", "feedforward_intermediate_dense", "feedforward_output_dense")
GEMMA_MLP = ("ffw_gating", "ffw_gating_2", "ffw_linear")
#: Each of those layers' module in the hub's (transformers') models of these families.
HUB_MODULES = {
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "attention_output": "self_attn.o_proj",
    **{
        name: f"mlp.{proj}_proj"
        for names in (LORA_MLP, GEMMA_MLP)
        for name, proj in zip(names, ("gate", "up", "down"), strict=True)
    },
}

#: High-bandwidth memory of one TPU v5e chip (Colab's v5e-1, Kaggle's v5e-8).
V5E_CHIP_BYTES = 16 * 1024**3
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one chip holds while training: the model's weights (its share of them over the
    model axis) twice (the model's variables, and the copy the engine's step carries), the LoRA weights with Adam's two moments and their gradients (float32), the
    activations kept for the backward pass and the float32 logits with their gradient."""

    weights: int
    lora: int
    activations: int
    logits: int
    chip_bytes: int

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations + self.logits

    @property
    def fits(self) -> bool:
        return self.total <= 0.9 * self.chip_bytes  # XLA's own buffers take the rest

    def __str__(self) -> str:
        gib = 1024**3
        parts = ", ".join(
            f"{name} {getattr(self, name) / gib:.2f}"
            for name in ("weights", "lora", "activations", "logits")
        )
        verdict = "fits" if self.fits else "does not fit"
        return f"per chip: {parts} = {self.total / gib:.2f} GiB of {self.chip_bytes / gib:.0f}: {verdict}"

    def check(self) -> None:
        """Raise ``InputError`` naming the largest part and what shrinks it, when it does not fit."""
        if self.fits:
            return
        fixes = {
            "weights": "a smaller checkpoint, dtype='bfloat16', or more chips on the model axis",
            "lora": "a lower lora_rank, or LoRA on the attention only",
            "activations": "a smaller rows_per_batch or sequence_length, or more chips",
            "logits": "a smaller rows_per_batch or sequence_length, or more chips on the data axis",
        }
        largest = max(fixes, key=lambda name: getattr(self, name))
        raise InputError(
            f"The run does not fit: {self}. The largest part is {largest}. Fix: {fixes[largest]}."
        )


def memory_plan(
    *,
    params: int,
    dtype: str,
    lora_params: int,
    rows_per_chip: int,
    sequence_length: int,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    model_axis: int = 1,
    chip_bytes: int = V5E_CHIP_BYTES,
) -> MemoryPlan:
    """The ``MemoryPlan`` of training ``params`` weights held in ``dtype``, sharded over a
    model axis of ``model_axis`` chips, with ``lora_params`` LoRA weights, on
    ``rows_per_chip`` rows of ``sequence_length`` tokens a step (the rows of a batch over
    the data axis). The activations of a layer without recomputation, split over ``t`` chips
    by heads and MLP units, are s b h (10 + 24 / t + 5 a s / (h t)) bytes in 16 bits
    (Korthikanti et al. 2022: s tokens, b rows, h hidden, a heads; the last term is the
    attention's scores), twice that in float32."""
    if dtype not in _BYTES:
        raise InputError(
            f"dtype={dtype!r} is not one of {sorted(_BYTES)}. Fix: 'bfloat16' on a TPU."
        )
    width, t = _BYTES[dtype], max(model_axis, 1)
    tokens = rows_per_chip * sequence_length
    per_token = 10 + 24 / t + 5 * heads * sequence_length / (hidden * t)
    return MemoryPlan(
        weights=2 * params * width // t,  # the model's variables and the step's state
        lora=lora_params * 4 * 4,  # weights, gradients and two Adam moments, float32
        activations=int(tokens * hidden * layers * per_token * width / 2),
        logits=2 * tokens * vocab * 4,
        chip_bytes=chip_bytes,
    )


def match_config(backbone, config: dict) -> list[str]:
    """Set the epsilon of every RMSNorm in ``backbone`` (a KerasHub decoder backbone) to
    ``config["rms_norm_eps"]`` (the checkpoint's ``config.json``), before its first call.
    KerasHub 0.32's Llama 3 converter does not read the epsilon (its backbone keeps 1e-6,
    Llama 3's is 1e-5), and its Qwen 3 layers give the per-head query and key norms their
    own 1e-5 (Qwen 3's is 1e-6). Returns what it changed, as ``"path: old -> new"``."""
    from tpu_helpers.keras3.internals import sublayers

    epsilon = float(config["rms_norm_eps"])
    changed = []
    for layer in sublayers(backbone):
        old = getattr(layer, "epsilon", None)
        if old is not None and type(layer).__name__.endswith(("LayerNorm", "RMSNormalization")):
            if old != epsilon:
                changed.append(f"{layer.path}: {old:g} -> {epsilon:g}")
                layer.epsilon = epsilon
    return changed


def hub_folder(checkpoint: str) -> Path:
    """The local folder of ``checkpoint``: a folder in the hub's layout, or a hub name
    (``Qwen/Qwen3-0.6B``, or ``hf://Qwen/Qwen3-0.6B`` as KerasHub spells it) fetched once
    into the hub's cache (its config, tokenizer and safetensors). A gated model without a
    token, an unknown name and a family outside ``DECODER_FAMILIES`` are refused with the fix."""
    local = Path(checkpoint)
    if not local.is_dir():
        local = _download(checkpoint.removeprefix("hf://"))
    config_file = local / "config.json"
    if not config_file.exists():
        raise InputError(
            f"{checkpoint!r} has no config.json. Fix: a folder in the hub's layout, or a hub name."
        )
    config = json.loads(config_file.read_text())
    family = config.get("model_type")
    if family == "gemma3":
        raise InputError(
            f"{checkpoint!r} is Gemma 3 with its vision tower (model_type 'gemma3'); this notebook"
            " tunes text models. Fix: google/gemma-3-1b-it or google/gemma-3-270m-it (text"
            " only), or Qwen/Qwen3-4B for a larger ungated model."
        )
    if family not in DECODER_FAMILIES:
        raise InputError(
            f"{checkpoint!r} is a {family!r} model; this notebook's layout map, export and tests"
            f" cover {', '.join(DECODER_FAMILIES)}. Fix: a Qwen 3 checkpoint (Qwen/Qwen3-0.6B,"
            " ungated), a Llama 3 one (meta-llama/Llama-3.2-1B-Instruct, gated) or a Gemma 3"
            " one (google/gemma-3-1b-it, gated)."
        )
    if family == "gemma3_text" and (otherwise := gemma3_differences(config)):
        raise InputError(
            f"{checkpoint!r}: KerasHub 0.32's Gemma 3 would compute this model otherwise than"
            f" its config says: {'; '.join(otherwise)}. Fix: a Gemma 3 checkpoint of Google's"
            " (google/gemma-3-1b-it), whose configs it follows."
        )
    return local


def gemma3_differences(config: dict) -> list[str]:
    """What KerasHub 0.32's Gemma 3 computes otherwise than a ``gemma3_text`` ``config``
    says, which it does not read: every sixth layer global and the others on the sliding
    window (``layer_types``), rotary bases of 1,000,000 (global) and 10,000 (sliding), a
    linear scaling of the global positions only, the query scaled by ``head_dim`` or
    ``hidden_size / num_attention_heads`` (``query_pre_attn_scalar``)."""
    layers = config["num_hidden_layers"]
    pattern = config.get("sliding_window_pattern", 6)
    given = config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    kerashub = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(layers)]
    rope = config.get("rope_parameters") or {}
    bases = (
        rope.get("full_attention", {}).get("rope_theta", config.get("rope_theta", 1e6)),
        rope.get("sliding_attention", {}).get(
            "rope_theta", config.get("rope_local_base_freq", 1e4)
        ),
    )
    scaling = config.get("rope_scaling") or rope.get("full_attention") or {}
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    scalar = config.get("query_pre_attn_scalar", head_dim)
    checks = {
        f"layer_types {given} (KerasHub: {kerashub})": given == kerashub,
        f"rotary bases {bases} (KerasHub: (1000000.0, 10000.0))": bases == (1e6, 1e4),
        f"rope type {scaling.get('rope_type')!r} (KerasHub: linear)": scaling.get(
            "rope_type", "linear"
        )
        in ("linear", "default"),
        f"query_pre_attn_scalar {scalar} (KerasHub: {head_dim} or"
        f" {config['hidden_size'] // heads})": scalar in (head_dim, config["hidden_size"] // heads),
    }
    return [what for what, holds in checks.items() if not holds]


def _download(name: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        files = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
        return Path(snapshot_download(name, allow_patterns=files))
    except GatedRepoError as error:
        raise InputError(
            f"{name} is gated: its page asks you to accept its terms, and the download a token"
            " of an account that did. Fix: accept them on https://huggingface.co/" + name + ","
            " then on Colab add the token as the secret HF_TOKEN (the key icon on the left) and"
            " run `from google.colab import userdata; from huggingface_hub import login;"
            " login(userdata.get('HF_TOKEN'))`; on Kaggle add it under Add-ons -> Secrets and run"
            " `from kaggle_secrets import UserSecretsClient; from huggingface_hub import login;"
            " login(UserSecretsClient().get_secret('HF_TOKEN'))`. Or take an ungated model:"
            " Qwen/Qwen3-0.6B."
        ) from error
    except RepositoryNotFoundError as error:
        raise InputError(
            f"No model {name!r} on the hub (or it is private). Fix: the name as its page spells"
            " it, e.g. Qwen/Qwen3-0.6B."
        ) from error


def require_chat_template(tokenizer, checkpoint: str) -> None:
    """Refuse a tokenizer without a chat template (a base model's): the examples are
    written in the chat format the model will be served with."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            f"{checkpoint}: its tokenizer has no chat template (tokenizer_config.json or"
            " chat_template.jinja), as base models often lack one. Fix: the instruction-tuned"
            " checkpoint of the same model (Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B-Instruct),"
            " or set tokenizer.chat_template to the template the model will be served with."
        )


def lora_targets(config: dict, mlp: bool = False) -> list[str]:
    """KerasHub's names of the layers LoRA goes on in a decoder of ``config``: the
    attention's query and value, and with ``mlp`` the MLP's three projections."""
    gemma = config["model_type"].startswith("gemma")
    return [*LORA_ATTENTION, *((GEMMA_MLP if gemma else LORA_MLP) if mlp else ())]


def lora_parameter_count(config: dict, rank: int, targets=LORA_ATTENTION) -> int:
    """The weights ``backbone.enable_lora(rank, target_layer_names=targets)`` adds to a
    decoder of ``config``: per targeted kernel of shape ``(*inner, out)``, Keras' factors
    ``A (*inner, rank)`` and ``B (rank, out)`` (KerasHub's Gemma lays the query, key and
    value kernels out heads first, ``(heads, hidden, head_dim)``: the same count)."""
    if not isinstance(rank, int) or rank < 1:
        raise InputError(f"lora_rank={rank!r} must be a positive whole number. Fix: 8 or 16.")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    d = config.get("head_dim") or hidden // heads
    inner = config["intermediate_size"]
    mlp = ((hidden, inner), (hidden, inner), (inner, hidden))
    kernels = {
        "query": (hidden, heads, d),
        "key": (hidden, kv, d),
        "value": (hidden, kv, d),
        "attention_output": (heads, d, hidden),
        **dict(zip(LORA_MLP, mlp, strict=True)),
        **dict(zip(GEMMA_MLP, mlp, strict=True)),
    }
    unknown = sorted(set(targets) - set(kernels))
    if unknown:
        raise InputError(f"No LoRA target {unknown}. Fix: names among {sorted(kernels)}.")
    per_layer = sum(int(np.prod(kernels[t][:-1])) * rank + rank * kernels[t][-1] for t in targets)
    return per_layer * config["num_hidden_layers"]


def check_model_axis(
    model_axis: int, config: dict, devices: int | None = None, rows_per_batch: int | None = None
) -> None:
    """Refuse a model axis that does not divide the query heads and the key-value heads of
    ``config`` (a ``config.json``), which the layout shards over it, or the ``devices``; and
    a batch of ``rows_per_batch`` rows that the data axis (the other devices) cannot split."""
    if devices is not None and (model_axis < 1 or devices % model_axis):
        axes = [n for n in range(1, devices + 1) if devices % n == 0]
        raise InputError(
            f"model_axis={model_axis} does not divide the {devices} devices into a (data,"
            f" model) mesh. Fix: one of {axes}."
        )
    if (
        devices is not None
        and rows_per_batch is not None
        and rows_per_batch % (devices // model_axis)
    ):
        data = devices // model_axis
        raise InputError(
            f"rows_per_batch={rows_per_batch} does not split over the data axis of {data} device"
            f" groups ({devices} devices / model_axis {model_axis}). Fix: a multiple of {data},"
            " or a larger model_axis."
        )
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    if model_axis < 1 or heads % model_axis or kv_heads % model_axis:
        fits = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise InputError(
            f"model_axis={model_axis} does not divide the model's {heads} query heads and"
            f" {kv_heads} key-value heads, which the layout shards over it. Fix: one of {fits}"
            " (the data axis takes the other devices)."
        )


def accept_full_masks(backbone) -> None:
    """Let each of Gemma 3's decoder blocks in ``backbone`` take a packed row's whole mask
    ``[rows, T, T]`` (which key each query may see) as its ``padding_mask``, as Qwen's and
    Llama's layers take one as ``decoder_attention_mask``, and-combined with the block's
    causal mask as theirs is: KerasHub 0.32's block builds its mask from a padding mask
    only (``internals.take_full_masks`` replaces the method that does). The sliding window
    of its local layers still applies on top. A padding mask of one row per token, and
    generation (with a cache), go on as before. Other families' layers are left as they are."""
    from tpu_helpers.keras3.internals import take_full_masks

    for block in backbone.transformer_layers:
        if type(block).__name__ == "Gemma3DecoderBlock":
            take_full_masks(block)


def replicated_weights(model, axis: str = "model", min_elements: int = 1 << 16) -> list[str]:
    """The paths of ``model``'s weights of at least ``min_elements`` elements that no
    layout splits over the mesh's ``axis`` (each device of it would hold them whole): what
    a layout map missed. Every large weight when no ``ModelParallel`` layout was set; none
    when the distribution's mesh is one device (Keras then places each weight on it whole,
    without a layout: there is nothing to split)."""
    import keras

    mesh = getattr(keras.distribution.distribution(), "device_mesh", None)
    if mesh is not None and np.size(mesh.devices) == 1:
        return []
    missed = []
    for variable in model.weights:
        if int(np.prod(variable.shape)) < min_elements:
            continue
        spec = getattr(getattr(variable.value, "sharding", None), "spec", None) or ()
        named = {name for part in spec for name in (part if isinstance(part, tuple) else (part,))}
        if axis not in named:
            missed.append(variable.path)
    return missed


def save_merged(causal_lm, source, folder, max_shard_bytes: int = 2 * 1024**3) -> list[str]:
    """Write ``causal_lm`` (a KerasHub ``CausalLM`` read from the hub's files in ``source``,
    LoRA enabled or not) into ``folder`` as the hub serves the family: each LoRA layer's
    kernel merged (``W + alpha / rank * A @ B``, as Keras computes it), every weight back
    under its hub name and layout (the inverse of what KerasHub's converter did reading
    it), float32 safetensors in shards of at most ``max_shard_bytes`` with their index,
    ``config.json`` and the tokenizer and generation files copied from ``source``. Returns
    the files written. ``from_preset(folder)`` and transformers read it back.

    A ``folder`` that holds another model is refused. The files are written beside it
    first and moved in at the end (an earlier save's weight files removed, any other file
    left), so a stopped save leaves the folder as it was.
    """
    from tpu_helpers.data.hub import write_hub_weights
    from tpu_helpers.keras3.internals import hub_converter

    if "://" in str(folder):  # a bucket: written here, then copied
        return _save_to_bucket(causal_lm, source, str(folder), max_shard_bytes)
    source, folder = Path(source), Path(folder)
    config = _config_of(source)
    _refuse_other_model(folder, config, source)
    recorder = _Recorder(source)
    hub_converter(config["model_type"]).convert_weights(causal_lm.backbone, recorder, config)
    tensors = {}
    for variable, name, hook in recorder.ported:
        # a LoRA layer's ``kernel`` (what the converter ports to) is its merged kernel, a
        # tensor; any other is the variable itself
        full = recorder.find(name) or name
        value = np.asarray(getattr(variable, "value", variable), np.float32)
        tensors[full] = _to_hub_layout(value, hook, tuple(recorder.shape(full)), full)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    names = write_hub_weights(tensors, staging, max_shard_bytes)
    config = {**config, **{k: "float32" for k in ("torch_dtype", "dtype") if config.get(k)}}
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    names.append("config.json")
    for path in sorted(source.iterdir()):
        if path.is_file() and (
            path.name.startswith(("tokenizer", "generation_config", "special_tokens"))
            or path.name in ("vocab.json", "merges.txt")
            or path.name.endswith(".jinja")  # a chat template kept beside the tokenizer
        ):
            shutil.copy(path, staging / path.name)
            names.append(path.name)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("model*.safetensors*"):  # an earlier save's weights
        stale.unlink()
    for name in names:
        (staging / name).replace(folder / name)
    staging.rmdir()
    return names


def _save_to_bucket(causal_lm, source, folder: str, max_shard_bytes: int) -> list[str]:
    """``save_merged`` into a bucket: refused as a local folder would be, written here,
    the earlier save's weight files removed there, then copied."""
    import tempfile

    from tpu_helpers.core import storage

    gfile, target = storage.gfile(), folder.rstrip("/")
    with tempfile.TemporaryDirectory() as local:
        if gfile.exists(f"{target}/config.json"):
            gfile.copy(f"{target}/config.json", f"{local}/config.json")
        _refuse_other_model(Path(local), _config_of(source), Path(source), shown=target)
        names = save_merged(causal_lm, source, Path(local) / "model", max_shard_bytes)
        for stale in gfile.glob(f"{target}/model*.safetensors*"):
            gfile.remove(stale)
        storage.copy_tree(f"{local}/model", target)
    return names


def _config_of(source) -> dict:
    return json.loads((Path(source) / "config.json").read_text())


def _refuse_other_model(folder: Path, config: dict, source: Path, shown: str = "") -> None:
    """Refuse a ``folder`` (named ``shown`` where it stands for a bucket's) that is
    ``source`` or holds another model's ``config.json``."""
    if not shown and folder.resolve() == source.resolve():
        raise InputError(
            f"{folder} is the folder the model was read from. Fix: another folder, e.g."
            " f'{output_dir}/merged'."
        )
    saved = folder / "config.json"
    if not folder.exists() or not any(folder.iterdir()):
        return
    same = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    if saved.exists():
        other = json.loads(saved.read_text())
        if all(other.get(k) == config.get(k) for k in same):
            return  # an earlier save of this model: replaced
        what = f"a {other.get('model_type')} model of {other.get('num_hidden_layers')} layers"
    else:
        what = (
            f"files of something else ({', '.join(sorted(p.name for p in folder.iterdir())[:3])})"
        )
    raise ExistingFileError(
        f"{shown or folder} holds {what}, not an earlier save of this {config['model_type']} model;"
        " nothing was written. Fix: another folder, or remove that one first."
    )


class _Recorder:
    """A loader for KerasHub's converter that notes each ``port_weight`` call (variable, hub
    name, hook) and assigns nothing; names resolve as the hub's files name them."""

    def __init__(self, folder: Path):
        from tpu_helpers.keras3.models import _Reader

        self._reader = _Reader(folder)
        self.ported: list[tuple] = []

    def find(self, name: str) -> str | None:
        return self._reader.find(name)

    def shape(self, name: str) -> list[int]:
        return self._reader.shape(name)

    def get_tensor(self, name: str):  # converters read a few tensors directly
        return self._reader.get_tensor(name)

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        self.ported.append((keras_variable, hf_weight_key, hook_fn))


def _to_hub_layout(value: np.ndarray, hook, shape: tuple, name: str) -> np.ndarray:
    """``value`` (Keras' layout) in the hub's ``shape``: the inverse of ``hook``, the
    converter's function from the hub's tensor to Keras' (a reshape, a transpose, or both).
    The hook applied to the hub's element numbers says where each element went; a hook that
    computes more than a rearrangement is refused (its result is checked)."""
    if hook is None and value.size == int(np.prod(shape)):
        return np.ascontiguousarray(value.reshape(shape))
    numbers = np.arange(int(np.prod(shape))).reshape(shape)
    moved = np.asarray(hook(numbers, list(value.shape))) if hook else numbers
    if moved.shape == value.shape and np.array_equal(np.sort(moved, axis=None), numbers.ravel()):
        hub = np.empty(numbers.size, value.dtype)
        hub[moved.ravel()] = value.ravel()
        hub = hub.reshape(shape)
        if np.array_equal(np.asarray(hook(hub, list(value.shape))), value):
            return hub
    raise EngineError(
        f"{name}: KerasHub's converter changed this weight in a way other than a reshape or a"
        " transpose, so it cannot be written back in the hub's layout. Fix: save the model in"
        " the Keras format (causal_lm.save_to_preset(folder))."
    )


def save_adapter(causal_lm, folder, base_model: str) -> list[str]:
    """Write the LoRA factors of ``causal_lm`` (KerasHub's, after ``enable_lora`` and
    training) into ``folder`` (local or ``gs://``) as a PEFT adapter of ``base_model`` (the
    hub name of the checkpoint it was read from): ``adapter_model.safetensors`` and
    ``adapter_config.json``, which PEFT, and servers that take PEFT adapters, load onto the
    base model. Returns the files written.

    Keras factors a kernel of the attention's query, key or value, ``[hidden, heads,
    head_dim]``, as ``A [hidden, heads, rank] @ B [rank, head_dim]``: a rank of its own for
    each head, sharing ``B``. In PEFT's form, ``B' @ A'`` on the flattened weight, that is
    a rank of ``heads * rank`` with a block-diagonal ``B'``; the config's ``rank_pattern``
    and ``alpha_pattern`` give each module its rank and the scale Keras used
    (``lora_alpha / rank``). Every other kernel's factors are PEFT's, transposed."""
    from safetensors.numpy import save_file

    tensors, ranks, alphas = _adapter_tensors(causal_lm)
    if not tensors:
        raise InputError(
            "The model has no LoRA layers. Fix: causal_lm.backbone.enable_lora(rank) before"
            " training, or decoders.save_merged for a model tuned whole."
        )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model.removeprefix("hf://"),
        "r": min(ranks.values()),
        "lora_alpha": alphas[min(ranks, key=ranks.get)],
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "target_modules": sorted(ranks),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    return _write_files(
        str(folder),
        lambda local: save_file(
            tensors, str(local / "adapter_model.safetensors"), {"format": "pt"}
        ),
        {"adapter_config.json": json.dumps(config, indent=2, sort_keys=True)},
    )


def _adapter_tensors(causal_lm) -> tuple[dict, dict, dict]:
    """PEFT's tensors of ``causal_lm``'s LoRA layers, and each module's rank and alpha."""
    kind = type(causal_lm.backbone).__name__
    if not kind.startswith(("Qwen3", "Llama", "Gemma3")):  # others lay kernels out otherwise
        raise InputError(
            f"save_adapter writes the adapters of Qwen 3, Llama and Gemma 3 models, not of a"
            f" {kind}. Fix: decoders.save_merged writes the tuned model whole."
        )
    heads_first = kind.startswith("Gemma3")  # query, key, value [heads, hidden, head_dim]
    tensors, ranks, alphas = {}, {}, {}
    for layer in causal_lm.backbone._flatten_layers(include_self=False):
        if not getattr(layer, "lora_enabled", False):
            continue
        path = layer.path.split("/")
        if path[-1] not in HUB_MODULES:
            raise InputError(
                f"LoRA on {layer.path}, whose module in the hub's model is not known here"
                f" (LoRA layers: {', '.join(HUB_MODULES)}). Fix: enable_lora on those."
            )
        module = f"model.layers.{path[0].rsplit('_', 1)[1]}.{HUB_MODULES[path[-1]]}"
        a, b = (np.asarray(w.value, np.float32) for w in (layer.lora_kernel_a, layer.lora_kernel_b))
        if heads_first and path[-1] in ("query", "key", "value"):
            a = a.transpose(1, 0, 2)  # as Qwen's: [hidden, heads, rank]
        a_hub, b_hub = _peft_factors(path[-1], a, b)
        # safetensors writes an array's buffer as it lies: a transposed view needs a copy
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a_hub)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b_hub)
        name = HUB_MODULES[path[-1]].split(".")[1]
        ranks[name] = int(a_hub.shape[0])
        alphas[name] = float(layer.lora_alpha / layer.lora_rank * a_hub.shape[0])
    return tensors, ranks, alphas


def _peft_factors(kind: str, a, b):
    """PEFT's ``(lora_A [rank', in], lora_B [out, rank'])`` of Keras' factors ``a``, ``b``
    of the layer ``kind``, in transformers' layout of its weight (``[out, in]``)."""
    if kind in ("query", "key", "value"):  # a [hidden, heads, r], b [r, head_dim]
        hidden, heads, rank = a.shape
        a_hub = a.transpose(1, 2, 0).reshape(heads * rank, hidden)  # rows (head, r)
        return a_hub, np.kron(np.eye(heads, dtype=np.float32), b.T)  # [heads*head_dim, heads*r]
    return a.reshape(-1, a.shape[-1]).T, b.T  # inputs first, then the output axis


def _write_files(folder: str, write_weights, texts: dict) -> list[str]:
    """Write into ``folder`` (local, or a bucket through a local copy) the weights that
    ``write_weights(local folder)`` writes and the ``texts``; returns the names."""
    import tempfile

    from tpu_helpers.core import storage

    with tempfile.TemporaryDirectory() as local:
        write_weights(Path(local))
        for name, text in texts.items():
            (Path(local) / name).write_text(text)
        names = sorted(p.name for p in Path(local).iterdir())
        storage.copy_tree(local, folder)
    return names
