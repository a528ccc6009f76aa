"""Decoders read from the hub's files by KerasHub (notebook 10), against a forward pass
written here in NumPy from the same files; packed rows, the merged export and the helpers
of ``tpu_helpers.llm.decoders``. Keras 3 stacks only (skipped where KerasHub is absent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("STACK") in ("keras3", "colab"):
    import keras_hub
else:
    keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402

from tpu_helpers.core.errors import ExistingFileError, InputError  # noqa: E402
from tpu_helpers.data.hub import open_safetensors  # noqa: E402
from tpu_helpers.keras3.internals import sublayers  # noqa: E402
from tpu_helpers.llm import decoders  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("tiny-qwen3", "tiny-llama3", "tiny-gemma3")
#: How close KerasHub's float32 logits must be to the reference's, relative to the largest:
#: 3e-7 was seen; an RMSNorm epsilon of KerasHub's own instead of the config's moves them
#: by 8e-6 (Qwen 3's query and key norms) and 2.4e-5 (Llama 3's norms) on these checkpoints.
TOLERANCE = 1e-6


def hub_tensors(folder: Path) -> dict:
    """Every tensor of a checkpoint in the hub's layout (one file or shards), by name."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open_safetensors(path) as archive:
            tensors.update({k: archive.get_tensor(k) for k in archive.keys()})
    return tensors


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
    """Rotary embeddings as the hub's Qwen, Llama and Gemma apply them: each head's two
    halves rotated by angles position / theta^(2i/d)."""
    half = x.shape[-1] // 2
    angles = positions[:, None] / theta ** (np.arange(half) * 2.0 / x.shape[-1])
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _layer_kinds(c: dict) -> list[tuple]:
    """Per layer, (rotary base, position scale, sliding window or None), as transformers
    reads a config: Gemma 3's layer_types (or every sliding_window_pattern-th layer global),
    its local base for the sliding layers and its linear scaling for the global ones."""
    n = c["num_hidden_layers"]
    if c["model_type"] != "gemma3_text":
        return [(c["rope_theta"], 1.0, None)] * n
    pattern = c.get("sliding_window_pattern", 6)
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
    ]
    factor = (c.get("rope_scaling") or {}).get("factor", 1.0)
    local = (c["rope_local_base_freq"], 1.0, c["sliding_window"])
    return [local if t == "sliding_attention" else (c["rope_theta"], factor, None) for t in types]


def _attention(c, w, p, h, positions, allowed, kind):
    """One layer's grouped-query attention of ``h`` (normed), its output projection applied."""
    heads, kv, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    d = c.get("head_dim") or c["hidden_size"] // heads
    n, gemma = len(h), c["model_type"] == "gemma3_text"
    q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d)
    if p + "self_attn.q_norm.weight" in w:
        qn, kn = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        q, k = _rms(q, qn + gemma, eps), _rms(k, kn + gemma, eps)  # Gemma scales by 1 + w
    theta, factor, window = kind
    q, k = _rope(q, positions / factor, theta), _rope(k, positions / factor, theta)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scale = c.get("query_pre_attn_scalar", d) if gemma else d
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(scale)
    if window:  # a key at most window - 1 tokens back
        allowed = allowed & (np.subtract.outer(np.arange(n), np.arange(n)) < window)
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * d)
    return attended @ w[p + "self_attn.o_proj.weight"].T


def reference_logits(folder: Path, ids, segments=None, positions=None) -> np.ndarray:
    """A decoder's logits for one row of ``ids``, in float64 NumPy, from ``config.json`` and
    the safetensors alone, as transformers computes Qwen 3, Llama and Gemma 3: RMSNorm (Gemma:
    scaled by 1 + w, around the attention and the MLP both before and after), grouped-query
    attention with RoPE (the per-head query and key norms of Qwen 3 and Gemma 3; Gemma 3's
    sliding window and local base), the gated MLP (SiLU; Gemma: tanh GELU). ``segments`` (one
    id per token) lets a token see only earlier tokens of its own segment; ``positions``
    default to 0, 1, 2 ..."""
    c = json.loads((folder / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in hub_tensors(folder).items()}
    gemma, eps = c["model_type"] == "gemma3_text", c["rms_norm_eps"]

    def norm(x, name):
        return _rms(x, w[name] + gemma, eps)

    n = len(ids)
    positions = np.arange(n) if positions is None else np.asarray(positions, np.float64)
    segments = np.zeros(n) if segments is None else np.asarray(segments)
    allowed = np.tril(np.ones((n, n), bool)) & (segments[:, None] == segments[None, :])
    x = w["model.embed_tokens.weight"][np.asarray(ids)] * (c["hidden_size"] ** 0.5 if gemma else 1)
    for i, kind in enumerate(_layer_kinds(c)):
        p = f"model.layers.{i}."
        out = _attention(c, w, p, norm(x, p + "input_layernorm.weight"), positions, allowed, kind)
        x = x + (norm(out, p + "post_attention_layernorm.weight") if gemma else out)
        h = norm(x, p + ("pre_feedforward" if gemma else "post_attention") + "_layernorm.weight")
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        act = _gelu_tanh(gate) if gemma else gate / (1 + np.exp(-gate))
        out = (act * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + (norm(out, p + "post_feedforward_layernorm.weight") if gemma else out)
    x = norm(x, "model.norm.weight")
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def load(folder: Path):
    """The notebook's load: KerasHub's CausalLM from the hub's files, its RMSNorms set to
    the config's epsilon (``decoders.match_config``)."""
    lm = keras_hub.models.CausalLM.from_preset(str(folder), preprocessor=None)
    decoders.match_config(lm.backbone, json.loads((folder / "config.json").read_text()))
    return lm


PAGE = ROOT / "notebooks" / "10_decoder_lora_fine_tuning.ipynb"


def page_cell(starts: str) -> str:
    """The source of notebook 10's code cell that starts with ``starts`` (run here as the
    page writes it, not a copy that could drift from it)."""
    from pages import page_cell as notebook_cell

    return notebook_cell(PAGE.name, starts)


def packed_model(causal_lm, folder: Path, width: int):
    """Notebook 10's packed model of ``causal_lm`` (read from ``folder``), built by the
    page's own cells: its ``allowed`` mask (the exercise's solution) and the model cell, for
    rows of ``width`` tokens. Takes ``token_ids`` and ``segment_ids`` (0 is padding); gives
    float32 logits."""
    config = json.loads((folder / "config.json").read_text())
    namespace = {"keras": keras, "np": np, "decoders": decoders, "config": config}
    namespace.update(causal_lm=causal_lm, sequence_length=width)
    namespace["gemma"] = config["model_type"] == "gemma3_text"
    exec(page_cell("# BEGIN EXERCISE: A causal mask"), namespace)
    exec(page_cell('segments_in = keras.Input((sequence_length,), dtype="int32"'), namespace)
    return namespace["packed_lm"]


def per_token_weights(ds):
    """Notebook 10's ``with_transform``: each row's weight on every one of its labels."""
    return ds.map(lambda x, y, w: (x, y, keras.ops.ones_like(y, "float32") * w[:, None]))


def notebook_layout(mesh, gemma: bool = False):
    """Notebook 10's layout map over ``mesh``, made by the page's own lines (those of its
    model cell before the distribution is set): heads and the MLP's inner units over
    ``model``, the heads' axis first in KerasHub's Gemma."""
    source = page_cell('by_heads = ("model", None, None) if gemma')
    namespace = {"keras": keras, "mesh": mesh, "gemma": gemma}
    exec(source.split("keras.distribution.set_distribution(")[0], namespace)
    return namespace["layout"]


def relative_gap(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("name", FAMILIES)
def test_kerashub_logits_equal_the_numpy_reference(fixtures_dir, name):
    folder = fixtures_dir / name
    lm = load(folder)
    ids = np.array([3, 17, 42, 99, 7, 250, 12, 64])
    got = lm({"token_ids": ids[None], "padding_mask": np.ones((1, len(ids)), bool)})[0]
    assert relative_gap(got, reference_logits(folder, ids)) < TOLERANCE


@pytest.mark.parametrize(
    "name, changed",
    [
        ("tiny-llama3", "transformer_layer_0/self_attention_layernorm: 1e-06 -> 1e-05"),
        ("tiny-qwen3", "transformer_layer_0/self_attention/query_dense_layernorm: 1e-05 -> 1e-06"),
    ],
)
def test_kerashub_alone_computes_other_norms_than_the_hub(fixtures_dir, name, changed):
    # KerasHub 0.32 leaves Llama 3's RMSNorms at 1e-6 (the config says 1e-5) and Qwen 3's
    # query and key norms at 1e-5 (1e-6): loaded as it is, the logits differ from the
    # reference; match_config says what it changes.
    folder = fixtures_dir / name
    stock = keras_hub.models.CausalLM.from_preset(str(folder), preprocessor=None)
    ids = np.array([3, 17, 42, 99, 7])
    got = stock({"token_ids": ids[None], "padding_mask": np.ones((1, 5), bool)})[0]
    assert relative_gap(got, reference_logits(folder, ids)) > 3 * TOLERANCE
    config = json.loads((folder / "config.json").read_text())
    assert changed in decoders.match_config(stock.backbone, config)
    assert decoders.match_config(stock.backbone, config) == []


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_rows_give_each_example_its_own_logits(fixtures_dir, name):
    folder = fixtures_dir / name
    lm = load(folder)
    examples = [[5, 9, 23, 40, 2], [7, 81, 30], [11, 12, 13, 14, 15, 16]]
    row = np.concatenate(examples)
    model = packed_model(lm, folder, len(row))
    segments = np.repeat(np.arange(1, len(examples) + 1), [len(e) for e in examples])
    packed = np.asarray(model({"token_ids": row[None], "segment_ids": segments[None]})[0])
    starts = np.cumsum([0] + [len(e) for e in examples])
    for e, start in zip(examples, starts, strict=False):
        alone = reference_logits(folder, np.asarray(e))
        assert relative_gap(packed[start : start + len(e)], alone) < TOLERANCE
    # the reference tells a mask that lets examples see each other apart
    leaky = np.asarray(model({"token_ids": row[None], "segment_ids": np.ones_like(row)[None]})[0])
    second = slice(starts[1], starts[2])
    assert relative_gap(leaky[second], reference_logits(folder, np.asarray(examples[1]))) > 1e-3
    if "gemma" in name:  # its blocks' own masks (a padding mask, a cache) are as they were
        one = {"token_ids": row[None, :5], "padding_mask": np.ones((1, 5), bool)}
        assert relative_gap(lm(one)[0], reference_logits(folder, row[:5])) < TOLERANCE
    # RoPE is relative: positions counted along the row give each example the same scores
    # as positions restarted per example (the mask does the separating)
    along = reference_logits(folder, row, segments, positions=np.arange(len(row)))
    restarted = reference_logits(
        folder, row, segments, positions=np.concatenate([np.arange(len(e)) for e in examples])
    )
    assert relative_gap(along, restarted) < 1e-9


@pytest.mark.parametrize("name", FAMILIES)
def test_the_merged_export_is_w_plus_scaled_a_b_and_loads_back(fixtures_dir, tmp_path, name):
    folder = fixtures_dir / name
    lm = load(folder)
    lm.backbone.enable_lora(4)
    rng = np.random.default_rng(0)
    for variable in lm.backbone.trainable_weights:  # as after some training
        variable.assign(0.05 * rng.standard_normal(variable.shape).astype("float32"))
    batch = {"token_ids": np.array([[3, 17, 42, 99, 7, 25]]), "padding_mask": np.ones((1, 6), bool)}
    tuned = np.asarray(lm(batch))
    decoders.save_merged(lm, folder, tmp_path / "merged")
    saved, base = hub_tensors(tmp_path / "merged"), hub_tensors(folder)
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in base.items()}
    assert {v.dtype for v in saved.values()} <= {v.dtype for v in base.values()}
    layer = next(x for x in sublayers(lm.backbone.transformer_layers[1]) if x.name == "query")
    a, b = (np.asarray(v, np.float64) for v in (layer.lora_kernel_a, layer.lora_kernel_b))
    # Keras' factors: A [hidden, heads, rank] (Gemma's heads first), B [rank, head size];
    # the hub's q_proj [out, in], its rows head by head
    kernel = np.matmul(a, b) * layer.lora_alpha / layer.lora_rank
    hidden = kernel.shape[1 if "gemma" in name else 0]
    if "gemma" in name:
        delta = kernel.transpose(0, 2, 1).reshape(-1, hidden)
    else:
        delta = kernel.reshape(hidden, -1).T
    want = base["model.layers.1.self_attn.q_proj.weight"] + delta
    assert np.abs(saved["model.layers.1.self_attn.q_proj.weight"] - want).max() < 1e-6
    assert np.array_equal(
        saved["model.layers.1.mlp.up_proj.weight"], base["model.layers.1.mlp.up_proj.weight"]
    )
    back = load(tmp_path / "merged")
    assert relative_gap(back(batch), tuned) < 1e-6
    assert (
        relative_gap(back(batch)[0], reference_logits(tmp_path / "merged", batch["token_ids"][0]))
        < TOLERANCE
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_loads_the_merged_export_with_the_tuned_models_logits(
    fixtures_dir, tmp_path, name
):
    """Where PyTorch is installed (transformers 5 loads no model without it; no test stack
    has it, so this ran by hand: docs/compatibility.md has the figures)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    lm = load(fixtures_dir / name)
    lm.backbone.enable_lora(4)
    rng = np.random.default_rng(0)
    for variable in lm.backbone.trainable_weights:  # as after some training
        variable.assign(0.05 * rng.standard_normal(variable.shape).astype("float32"))
    ids = np.array([[3, 17, 42, 99, 7, 25, 11, 5]])
    tuned = np.asarray(lm({"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}))
    decoders.save_merged(lm, fixtures_dir / name, tmp_path / "merged")
    hub_model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        loaded = hub_model(torch.tensor(ids)).logits.numpy()
    assert relative_gap(loaded, tuned) < 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_the_peft_adapter_adds_what_the_merged_export_added(fixtures_dir, tmp_path, name):
    """LoRA on every projection of the attention and the MLP: for each module, PEFT's
    ``lora_B @ lora_A`` times its pattern's ``alpha / r`` equals what ``save_merged`` added to
    the hub's weight (two ways to the same delta: Keras' factors reshaped here, the merged
    kernel through KerasHub's converter there); a model without LoRA is refused."""
    from safetensors.numpy import load_file

    folder = fixtures_dir / name
    lm = load(folder)
    with pytest.raises(InputError, match="no LoRA layers.*Fix"):
        decoders.save_adapter(lm, tmp_path / "none", "org/base")
    other = type("GemmaLike", (), {"backbone": keras.layers.Dense(2)})  # kernels laid out otherwise
    with pytest.raises(InputError, match="not of a Dense.*Fix: decoders.save_merged"):
        decoders.save_adapter(other, tmp_path / "none", "org/base")
    assert not (tmp_path / "none").exists()
    lm.backbone.enable_lora(3, target_layer_names=[*decoders.HUB_MODULES])
    rng = np.random.default_rng(1)
    for variable in lm.backbone.trainable_weights:  # as after some training
        variable.assign(0.05 * rng.standard_normal(variable.shape).astype("float32"))
    decoders.save_merged(lm, folder, tmp_path / "merged")
    names = decoders.save_adapter(lm, tmp_path / "adapter", "hf://org/base")
    assert names == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/base" and config["peft_type"] == "LORA"
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    merged, base = hub_tensors(tmp_path / "merged"), hub_tensors(folder)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert len(adapter) == 2 * 7 * layers
    for key in sorted(k for k in adapter if k.endswith("lora_A.weight")):
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        short = module.rsplit(".", 1)[1]
        a, b = adapter[key].astype(np.float64), adapter[key.replace("lora_A", "lora_B")]
        delta = b @ a * config["alpha_pattern"][short] / config["rank_pattern"][short]
        added = merged[f"{module}.weight"] - base[f"{module}.weight"]
        assert config["rank_pattern"][short] == a.shape[0] and b.shape[1] == a.shape[0]
        assert np.abs(delta - added).max() < 1e-5 * max(1.0, np.abs(added).max()), module


def test_a_gemma_block_that_makes_its_mask_otherwise_is_refused_by_name():
    """``accept_full_masks`` replaces a private method of KerasHub 0.32's Gemma 3 block; a
    release whose method takes other arguments is refused, not patched blindly."""
    from tpu_helpers.core.errors import EngineError
    from tpu_helpers.keras3.internals import take_full_masks

    class Block:
        def _compute_attention_mask(self, x, padding_mask, cache=None):
            return padding_mask

    with pytest.raises(EngineError, match=r"Block._compute_attention_mask .*keras-hub==0.32.0"):
        take_full_masks(Block())


def test_a_converter_step_other_than_a_rearrangement_is_refused():
    """The export inverts what KerasHub's converter did reading each tensor; one that
    computes (a scale, a shift) cannot be inverted that way and is named."""
    from tpu_helpers.core.errors import EngineError
    from tpu_helpers.llm.decoders import _to_hub_layout

    hub = np.arange(24, dtype=np.float32).reshape(6, 4)

    def heads_first(
        x, shape
    ):  # as the Gemma converter's query: [heads*d, hidden] -> [heads, hidden, d]
        return np.transpose(np.reshape(x, (shape[0], shape[2], shape[1])), (0, 2, 1))

    keras_side = heads_first(hub, [2, 4, 3])
    assert np.array_equal(_to_hub_layout(keras_side, heads_first, (6, 4), "q"), hub)
    assert np.array_equal(_to_hub_layout(hub.ravel(), None, (6, 4), "q"), hub)  # a reshape
    with pytest.raises(EngineError, match="q: "):  # no hook, and the sizes differ
        _to_hub_layout(hub[:5], None, (6, 4), "q")
    for hook in (lambda x, _: x.T * 2.0, lambda x, _: x.T + 1):
        with pytest.raises(EngineError, match="q: .*other than a reshape.*save_to_preset"):
            _to_hub_layout(hook(hub, None), hook, (6, 4), "q")


def test_an_export_into_another_models_folder_is_refused_and_loses_nothing(fixtures_dir, tmp_path):
    lm = load(fixtures_dir / "tiny-qwen3")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32}))
    with pytest.raises(ExistingFileError, match="llama model of 32 layers"):
        decoders.save_merged(lm, fixtures_dir / "tiny-qwen3", other)
    assert [p.name for p in other.iterdir()] == ["config.json"]
    with pytest.raises(InputError, match="read from"):
        decoders.save_merged(lm, fixtures_dir / "tiny-qwen3", fixtures_dir / "tiny-qwen3")


QWEN_06B = dict(params=600_000_000, hidden=1024, layers=28, heads=16, vocab=151_936)
LLAMA_8B = dict(params=8_000_000_000, hidden=4096, layers=32, heads=32, vocab=128_256)


def plan(model, **run):
    """``memory_plan`` of ``model``'s sizes, bfloat16, no LoRA, one row of 256 unless told."""
    defaults = {"dtype": "bfloat16", "lora_params": 0, "rows_per_chip": 1, "sequence_length": 256}
    return decoders.memory_plan(**{**defaults, **model, **run})


def test_the_memory_plan_counts_each_part_and_names_the_largest():
    small = plan(QWEN_06B, lora_params=2_000_000, rows_per_chip=4, sequence_length=512)
    assert small.weights == 2 * 1_200_000_000 and small.lora == 32_000_000
    assert small.logits == 2 * 2048 * 151_936 * 4  # float32 logits and their gradient
    # Korthikanti et al.'s s b h (34 + 5 a s / h) bytes a layer on one chip, 16 bits
    assert small.activations == 2048 * 1024 * 28 * (34 + 5 * 16 * 512 / 1024)
    assert small.fits
    with pytest.raises(InputError, match="largest part is activations.*rows_per_batch"):
        plan(QWEN_06B, rows_per_chip=8, sequence_length=1024).check()
    big = plan(LLAMA_8B, dtype="float32")
    with pytest.raises(InputError, match="largest part is weights.*bfloat16"):
        big.check()
    split = plan(LLAMA_8B, model_axis=8)
    assert split.weights == big.weights // 16 and split.fits
    assert split.logits == big.logits  # every chip of a model copy holds the logits whole
    with pytest.raises(InputError, match="dtype='float8'"):
        plan(QWEN_06B, dtype="float8")


def test_a_model_axis_must_divide_both_kinds_of_heads():
    config = {"num_attention_heads": 16, "num_key_value_heads": 8}
    for ok in (1, 2, 4, 8):
        decoders.check_model_axis(ok, config)
    with pytest.raises(
        InputError, match=r"model_axis=3 .* 16 query heads and 8 key-value.*\[1, 2, 4, 8\]"
    ):
        decoders.check_model_axis(3, config)
    with pytest.raises(InputError, match="model_axis=16"):
        decoders.check_model_axis(16, config)
    with pytest.raises(InputError, match=r"model_axis=4 does not divide the 2 devices.*\[1, 2\]"):
        decoders.check_model_axis(4, config, devices=2)
    decoders.check_model_axis(2, config, devices=8, rows_per_batch=8)
    with pytest.raises(InputError, match=r"rows_per_batch=6 .* data axis of 4 .* multiple of 4"):
        decoders.check_model_axis(2, config, devices=8, rows_per_batch=6)


def test_replicated_weights_names_what_a_layout_left_whole(fixtures_dir):
    from tpu_helpers import keras3

    devices = keras3.devices(8)
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
    layout = keras.distribution.LayoutMap(mesh)
    layout["token_embedding/embeddings"] = (None, "model")
    layout[".*query.*kernel"] = (None, "model", None)  # the rest left out
    before = keras.distribution.distribution()  # another module's tests may have set one
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    )
    try:
        lm = load(fixtures_dir / "tiny-qwen3")
    finally:
        keras.distribution.set_distribution(before)
    missed = decoders.replicated_weights(lm, min_elements=1000)
    assert "token_embedding/embeddings" not in missed
    assert not any("query" in path for path in missed)
    assert any("feedforward_gate_dense/kernel" in path for path in missed)
    assert "token_embedding/embeddings" in decoders.replicated_weights(
        load(fixtures_dir / "tiny-qwen3"), min_elements=1000
    )
    # one device (Colab's v5e-1): Keras places each weight on it whole, nothing to split
    one = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices[:1])
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras.distribution.LayoutMap(one), batch_dim_name="batch"
        )
    )
    try:
        assert decoders.replicated_weights(load(fixtures_dir / "tiny-qwen3"), min_elements=1) == []
    finally:
        keras.distribution.set_distribution(before)


@pytest.mark.parametrize("name, mlp", [("tiny-qwen3", False), ("tiny-gemma3", True)])
def test_the_lora_count_from_the_config_is_what_enable_lora_adds(fixtures_dir, name, mlp):
    folder = fixtures_dir / name
    lm = load(folder)
    config = json.loads((folder / "config.json").read_text())
    targets = decoders.lora_targets(config, mlp)
    lm.backbone.enable_lora(3, target_layer_names=targets)
    added = sum(int(np.prod(v.shape)) for v in lm.backbone.trainable_weights)
    assert decoders.lora_parameter_count(config, 3, targets) == added
    # every target found a layer: 2 factors on each, in every layer
    assert len(lm.backbone.trainable_weights) == 2 * len(targets) * config["num_hidden_layers"]
    for rank in (0, -4, 2.0):  # none adds weights: each is refused by its value
        with pytest.raises(InputError, match=f"lora_rank={rank!r} must be a positive whole"):
            decoders.lora_parameter_count(config, rank)


def test_a_checkpoint_the_notebook_cannot_take_is_refused_with_the_fix(fixtures_dir, tmp_path):
    with pytest.raises(InputError, match="'distilbert' model.*Qwen/Qwen3-0.6B"):
        decoders.hub_folder(str(fixtures_dir / "tiny-distilbert"))
    assert decoders.hub_folder(str(fixtures_dir / "tiny-qwen3")) == fixtures_dir / "tiny-qwen3"
    gemma = json.loads((fixtures_dir / "tiny-gemma3" / "config.json").read_text())
    for change, named in [
        ({"model_type": "gemma3"}, "vision tower.*Fix: google/gemma-3-1b-it"),
        ({"layer_types": ["full_attention"] * 6}, "layer_types.*Fix"),
        ({"rope_local_base_freq": 5e4}, r"rotary bases \(1000000.0, 50000.0\).*Fix"),
        ({"query_pre_attn_scalar": 12}, "query_pre_attn_scalar 12.*Fix"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'.*Fix"),
    ]:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**gemma, **change}))
        with pytest.raises(InputError, match=named):
            decoders.hub_folder(str(folder))
    # the hub's older configs: the pattern instead of the layer types, the same model
    older = {k: v for k, v in gemma.items() if k != "layer_types"}
    assert decoders.gemma3_differences({**older, "sliding_window_pattern": 6}) == []
    assert decoders.gemma3_differences({**older, "sliding_window_pattern": 2}) != []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixtures_dir / "tiny-qwen3")
    decoders.require_chat_template(tokenizer, "tiny-qwen3")
    tokenizer.chat_template = None
    with pytest.raises(InputError, match="no chat template.*instruction-tuned"):
        decoders.require_chat_template(tokenizer, "tiny-qwen3")


def test_a_gated_model_without_a_token_names_a_login_that_runs_as_written(monkeypatch):
    import re

    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def gated(name, **options):  # as the hub answers a download without an accepted token
        error = GatedRepoError.__new__(GatedRepoError)  # (its __init__ wants an HTTP reply)
        Exception.__init__(error, f"401: {name} is gated")
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(InputError, match="google/gemma-3-1b-it is gated.*Fix") as refused:
        decoders.hub_folder("google/gemma-3-1b-it")
    snippets = re.findall(r"`([^`]*login\([^`]*)`", str(refused.value))
    assert [s.split(";")[0].split()[-1] for s in snippets] == ["userdata", "UserSecretsClient"]
    for snippet in snippets:  # each one imports every name it calls: pasted alone, it runs
        assert "from huggingface_hub import login;" in snippet, snippet


@pytest.mark.parametrize("shape", [(8, 1), (2, 4)])
def test_the_notebooks_layout_splits_every_large_weight_and_keeps_the_logits(fixtures_dir, shape):
    from tpu_helpers import keras3

    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), keras3.devices(8))
    before = keras.distribution.distribution()
    try:
        for name in FAMILIES:
            gemma = "gemma" in name  # its query kernel [heads, hidden, head size]
            layout = notebook_layout(mesh, gemma)
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
            )
            lm = load(fixtures_dir / name)
            assert decoders.replicated_weights(lm, min_elements=512) == []
            if shape[1] > 1:  # the query kernel is cut by heads over the model axis
                query = next(w for w in lm.backbone.weights if w.path.endswith("/query/kernel"))
                heads = 0 if gemma else 1
                cut = query.value.sharding.shard_shape(query.shape)
                assert cut[heads] == query.shape[heads] // shape[1], (name, cut)
            ids = np.array([3, 17, 42, 99, 7, 250, 12, 64])
            x = {"token_ids": np.tile(ids, (8, 1)), "padding_mask": np.ones((8, 8), bool)}
            assert relative_gap(lm(x)[3], reference_logits(fixtures_dir / name, ids)) < TOLERANCE
    finally:
        keras.distribution.set_distribution(before)


def _tune(fixtures_dir, folder, kill_at=0):
    command = [
        sys.executable,
        "tests/decoder_worker.py",
        str(fixtures_dir),
        "--dir",
        str(folder / "run"),
    ]
    command += ["--out", str(folder / "lora.npz"), "--kill-at", str(kill_at)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_a_killed_sharded_lora_run_resumes_to_the_weights_of_one_never_stopped(
    fixtures_dir, tmp_path
):
    whole = _tune(fixtures_dir, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _tune(fixtures_dir, tmp_path / "killed", kill_at=5)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL between two saves
    resumed = _tune(fixtures_dir, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = np.load(tmp_path / "whole" / "lora.npz"), np.load(tmp_path / "killed" / "lora.npz")
    assert len(want.files) == len(got.files) == 8  # A and B of query and value, 2 layers
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key])
    for run in ("whole", "killed"):
        report = json.loads((tmp_path / run / "lora.json").read_text())
        assert report["replicated"] == [] and len(report["loss"]) == 2, report
    # the epoch line of the whole run counts the packed examples, 4 a row, not the tokens
    whole = json.loads((tmp_path / "whole" / "lora.json").read_text())
    assert whole["examples_per_epoch"] == [24 * 4, 24 * 4], whole
    # the saves leave out the frozen kernels and embeddings (1,024 elements or more: all
    # but the norms' scales), which the resumed run found as built
    assert whole["left_out"] == whole["large_frozen"] and len(whole["left_out"]) == 15, whole


def test_a_resume_onto_other_frozen_weights_is_refused_naming_them(fixtures_dir, tmp_path):
    """A LoRA run's saves hold the frozen weights' fingerprints, not their values: a model
    built again with one of them otherwise (another checkpoint) is refused, the save kept."""
    from tpu_helpers import keras3
    from tpu_helpers.core import pipeline
    from tpu_helpers.core.errors import CheckpointMismatchError

    def tuned(change=0.0):
        lm = load(fixtures_dir / "tiny-qwen3")
        keras.utils.set_random_seed(0)
        lm.backbone.enable_lora(2)
        path = "transformer_layer_1/self_attention/key/kernel"  # frozen; 1,024 elements
        kernel = next(w for w in lm.backbone.weights if w.path == path)
        kernel.assign(kernel + change)
        model = packed_model(lm, fixtures_dir / "tiny-qwen3", 16)
        model.compile(
            optimizer=keras.optimizers.SGD(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        ids = np.arange(128, dtype="int32").reshape(8, 16) % 200 + 5
        batches = pipeline.from_arrays(  # 8 rows: whatever devices the session has set
            {"token_ids": ids, "segment_ids": np.ones_like(ids)},
            np.roll(ids, -1, 1),
            global_batch=8,
        ).with_transform(per_token_weights)
        return keras3.fit_resumable(model, batches, 1, str(tmp_path / "run"), verbose=0)

    tuned()
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(
        CheckpointMismatchError,
        match=r"(?s)other values in 1 of.*layer_1/self_attention/key/kernel.*Fix",
    ):
        tuned(change=0.5)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


def test_a_save_over_an_earlier_one_leaves_no_stale_weights_and_keeps_other_files(
    fixtures_dir, tmp_path
):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(fixtures_dir / "tiny-qwen3", source)
    (source / "chat_template.jinja").write_text("{{ messages }}")  # a template kept apart
    lm = load(source)
    out = tmp_path / "merged"
    decoders.save_merged(lm, source, out, max_shard_bytes=16 * 1024)  # shards and an index
    assert (out / "model.safetensors.index.json").exists()
    (out / "notes.txt").write_text("mine")
    names = decoders.save_merged(lm, source, out)  # one file now
    assert "chat_template.jinja" in names and (out / "chat_template.jinja").exists()
    weights = sorted(p.name for p in out.glob("model*.safetensors*"))
    assert weights == ["model.safetensors"], weights
    assert (out / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "merged.partial").exists()


def test_a_save_into_a_bucket_writes_the_local_saves_files_and_no_stale_weights(
    fixtures_dir, tmp_path
):
    """``gs://`` output (here ``ram://``, another of TensorFlow's file systems): the files a
    local save writes, byte for byte; a one-file save over a sharded one leaves no shard of
    the first. (``ram://`` appends to a file copied over another, where a bucket replaces
    it: the bytes are compared on a save into an empty folder.)"""
    import tensorflow as tf

    source = fixtures_dir / "tiny-qwen3"
    lm = load(source)
    local = decoders.save_merged(lm, source, tmp_path / "here")
    names = decoders.save_merged(lm, source, "ram://exports/fresh")
    assert sorted(tf.io.gfile.listdir("ram://exports/fresh")) == sorted(names) == sorted(local)
    for name in local:
        with tf.io.gfile.GFile(f"ram://exports/fresh/{name}", "rb") as there:
            assert there.read() == (tmp_path / "here" / name).read_bytes(), name
    decoders.save_merged(lm, source, "ram://exports/again", max_shard_bytes=16 * 1024)
    assert any(".index.json" in name for name in tf.io.gfile.listdir("ram://exports/again"))
    decoders.save_merged(lm, source, "ram://exports/again")
    assert sorted(tf.io.gfile.listdir("ram://exports/again")) == sorted(local)
