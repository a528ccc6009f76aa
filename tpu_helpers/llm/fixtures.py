"""Tiny decoder checkpoints and a tiny instruction set, laid out as the hub serves them.

Notebook 10 fine-tunes a decoder (Qwen 3, Llama 3 or Gemma 3) on instructions. On a TPU it reads the
hub's files (``hf://Qwen/Qwen3-0.6B``) and an instruction set (``databricks/databricks-dolly-15k``);
on a CPU, these stand-ins, through the same calls:

* ``DIR/tiny-qwen3``, ``DIR/tiny-llama3``, ``DIR/tiny-gemma3``: ``config.json``, PyTorch-named safetensors in
  shards with their index, a byte-level BPE ``tokenizer.json`` trained here with the family's
  special tokens, and ``tokenizer_config.json`` holding the family's chat template; written from
  a table of the hub's weight names, without PyTorch or TensorFlow;
* ``DIR/instructions``: rows with Dolly's columns (``instruction``, ``context``, ``response``,
  ``category``), loadable with ``load_dataset(DIR/instructions)``.

>>> sorted(decoder_weight_shapes(tiny_decoder_config("qwen3", 300)))[:2]
['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tpu_helpers.core.errors import InputError

__all__ = [
    "DECODER_FAMILIES",
    "tiny_decoder_config",
    "decoder_weight_shapes",
    "chat_tokenizer",
    "write_tiny_decoder",
    "make_instructions",
    "write_instructions",
]

# Per family: the special tokens of its tokenizer (the end of a turn first), the chat template
# its instruction-tuned checkpoints ship (the same markup, written here), and its config's
# fields beyond the shapes. Qwen 3 normalizes queries and keys per head (q_norm, k_norm).
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA3_CHAT = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_GEMMA_CHAT = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
DECODER_FAMILIES = {
    "qwen3": {
        "specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        "tokens": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        "template": _CHATML,
        "architecture": "Qwen3ForCausalLM",
        "config": {
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    },
    "llama": {
        "specials": (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        # no padding token, as Meta's instruction-tuned Llama 3 checkpoints have none
        "tokens": {"eos_token": "<|eot_id|>", "pad_token": None, "bos_token": "<|begin_of_text|>"},
        "template": _LLAMA3_CHAT,
        "architecture": "LlamaForCausalLM",
        "config": {
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_theta": 500_000.0,
            "rope_scaling": None,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    },
    # Gemma 3's text models (1B, 270M): every 6th layer attends globally, the others to a
    # sliding window (4 here, so that 8 tokens feel it); norms before and after each block,
    # query and key norms. Its tokenizer's end token is <eos>, but a turn ends with
    # <end_of_turn>: the generation config names both as the tokens generation stops at.
    "gemma3_text": {
        "specials": ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        "tokens": {"eos_token": "<eos>", "pad_token": "<pad>", "bos_token": "<bos>"},
        "stops": ("<eos>", "<end_of_turn>"),
        "template": _GEMMA_CHAT,
        "architecture": "Gemma3ForCausalLM",
        "config": {
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "num_hidden_layers": 6,
            "sliding_window": 4,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": None,
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    },
}


def _family(model_type: str) -> dict:
    if model_type not in DECODER_FAMILIES:
        raise InputError(
            f"No tiny decoder recipe for model_type {model_type!r}. Fix: one of"
            f" {sorted(DECODER_FAMILIES)}."
        )
    return DECODER_FAMILIES[model_type]


def tiny_decoder_config(model_type: str, vocab_size: int, **overrides) -> dict:
    """``config.json`` of a tiny ``model_type`` decoder: 2 layers, 8 query heads sharing 4
    key-value heads (grouped-query attention, as every such checkpoint on the hub; a model
    axis of 4 splits both), head size 8 (Qwen 3's and Gemma 3's are their own) or 4 (Llama's:
    hidden / heads); Gemma 3's 6 layers (the sixth attends globally, the first that does)."""
    family = _family(model_type)
    config = {
        "model_type": model_type,
        "architectures": [family["architecture"]],
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "transformers_version": "4.57.6",
        **family["config"],
        **overrides,
    }
    if model_type == "llama":  # Llama's head size is hidden / heads, whatever is asked
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def decoder_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The hub's weight names and PyTorch shapes (out, in) of a ``qwen3``, ``llama`` or
    ``gemma3_text`` ``config``: embeddings, per layer the norms (Gemma 3's four), q/k/v/o
    projections (the per-head q_norm and k_norm of Qwen 3 and Gemma 3) and the gated MLP, the
    final norm, and ``lm_head`` unless tied."""
    hidden, heads, kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim = config.get("head_dim") or hidden // heads
    inner = config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv * head_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv * head_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if config["model_type"] in ("qwen3", "gemma3_text"):
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if config["model_type"] == "gemma3_text":
            shapes[p + "pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[p + "post_feedforward_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inner, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inner, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inner)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _untrained(config: dict, seed: int) -> dict:
    """Weights drawn as the hub's initializers do (normal of ``initializer_range``), but
    the embeddings wider; the norms' scales drawn around 1 so that a reference that skipped
    one would differ (Gemma's around 0: it scales by ``1 + weight``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in decoder_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            centre = 0.0 if config["model_type"] == "gemma3_text" else 1.0
            tensors[name] = (centre + 0.1 * rng.standard_normal(shape)).astype("float32")
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            # as a trained model's are: large enough for confident logits after the final
            # norm (at 0.02 a LoRA-tuned tiny model could not leave the uniform guess)
            tensors[name] = (0.5 * rng.standard_normal(shape)).astype("float32")
        else:
            tensors[name] = (config["initializer_range"] * rng.standard_normal(shape)).astype(
                "float32"
            )
    return tensors


def chat_tokenizer(model_type: str, corpus: list[str], vocab_size: int = 400):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on ``corpus`` with
    ``model_type``'s special tokens, and the ``tokenizer_config.json`` settings (chat template,
    special tokens) its hub checkpoints carry: ``(tokenizer, settings)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    family = _family(model_type)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family["specials"]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    settings = {
        "chat_template": family["template"],
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **family["tokens"],
    }
    return tok, settings


def write_tiny_decoder(
    out: Path,
    model_type: str,
    corpus: list[str],
    seed: int = 0,
    shard_bytes: int = 48 * 1024,
    **overrides,
) -> dict:
    """Write a tiny untrained ``model_type`` decoder and its chat tokenizer into ``out`` as
    the hub serves them (sharded safetensors with their index, ``config.json``,
    ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``). Returns the
    config; ``overrides`` change its sizes (``hidden_size``, ``num_hidden_layers`` ...)."""
    from tpu_helpers.data import hub

    tok, settings = chat_tokenizer(model_type, corpus)
    specials = DECODER_FAMILIES[model_type]["tokens"]
    ids = {name: tok.token_to_id(token) for name, token in specials.items() if token}
    # the hub's embeddings have rows to a multiple of 64 beyond the tokenizer's last id
    # (Qwen 3: 151,936 rows for 151,669 tokens), so that they shard evenly
    config = tiny_decoder_config(model_type, -(-tok.get_vocab_size() // 64) * 64, **overrides)
    config.update(
        bos_token_id=ids.get("bos_token", ids["eos_token"]), eos_token_id=ids["eos_token"]
    )
    out.mkdir(parents=True)
    hub.write_hub_weights(_untrained(config, seed), out, shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    stops = [tok.token_to_id(t) for t in DECODER_FAMILIES[model_type].get("stops", ())]
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": stops or config["eos_token_id"],
        "do_sample": False,
    }
    if "pad_token" in ids:
        generation["pad_token_id"] = ids["pad_token"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, sort_keys=True))
    return config


# A small instruction task a tiny model learns in a few hundred steps: each thing has one
# colour and one place, asked in several wordings.
_THINGS = {
    "apple": ("red", "kitchen"),
    "sky": ("blue", "window"),
    "grass": ("green", "garden"),
    "banana": ("yellow", "market"),
    "coal": ("black", "cellar"),
    "snow": ("white", "mountain"),
    "carrot": ("orange", "field"),
    "plum": ("purple", "orchard"),
}
_ASK = (
    ("What colour is the {thing}?", "The {thing} is {colour}."),
    ("Tell me the colour of the {thing}.", "The {thing} is {colour}."),
    ("Where would I find the {thing}?", "You would find the {thing} in the {place}."),
    ("Name the place of the {thing}.", "The {thing} belongs in the {place}."),
)


def make_instructions(seed: int = 0, rows: int = 256) -> list[dict]:
    """``rows`` instruction rows with Dolly's columns (``instruction``, ``context``,
    ``response``, ``category``), a few with a context, of varied lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        thing = rng.choice(sorted(_THINGS))
        colour, place = _THINGS[thing]
        ask, answer = rng.choice(_ASK)
        context = f"A note about the {thing}." if rng.random() < 0.25 else ""
        fill = {"thing": thing, "colour": colour, "place": place}
        out.append(
            {
                "instruction": ask.format(**fill),
                "context": context,
                "response": answer.format(**fill),
                "category": "open_qa" if not context else "closed_qa",
            }
        )
    return out


def write_instructions(out: Path, seed: int = 0, rows: int = 256) -> None:
    """``make_instructions`` as a JSON-lines train split in ``out``, loadable with
    ``datasets.load_dataset(str(out))`` (Dolly has a train split only)."""
    out.mkdir(parents=True)
    with open(out / "train.jsonl", "w") as f:
        for row in make_instructions(seed, rows):
            f.write(json.dumps(row) + "\n")


def decoder_corpus(seed: int = 0) -> list[str]:
    """The text the tiny tokenizers are trained on: the instructions and their answers."""
    rows = make_instructions(seed, 512)
    return [f"{r['instruction']} {r['context']} {r['response']}" for r in rows]
