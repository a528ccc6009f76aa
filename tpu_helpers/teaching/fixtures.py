"""Small, real, offline stand-ins for the hub checkpoints and data sets the notebooks use.

``python -m tpu_helpers fixtures DIR`` (or ``build_fixtures(DIR)``) writes, from a seed:

* ``DIR/tiny-distilbert``: a DistilBERT-architecture masked-LM checkpoint and a WordPiece
  tokenizer trained here, laid out as most of the hub is: PyTorch-named
  ``model.safetensors`` alone;
* ``DIR/tiny-bert``: the same for BERT, laid out like a checkpoint pushed from transformers 5:
  PyTorch-named safetensors in shards with ``model.safetensors.index.json``, and the
  tokenizer and config files transformers 5 writes;
* ``DIR/mrpc``: an MRPC-like paraphrase data set of sentence pairs (columns ``sentence1``,
  ``sentence2``, ``label``, ``idx``; MRPC's split sizes);
* ``DIR/cola``: a CoLA-like acceptability data set (columns ``sentence``, ``label``,
  ``idx``; splits train/validation of CoLA's sizes) loadable with ``load_dataset(DIR/cola)``;
* ``DIR/tiny-vit``: a ViT image-classification checkpoint with its image processor (10
  labels, so loading it with ``num_labels=3`` exercises ``ignore_mismatched_sizes`` as the
  real ``google/vit-base-patch16-224`` does), PyTorch-named ``model.safetensors`` alone;
* ``DIR/tiny-deit``, ``DIR/tiny-swin``: the same of a distilled DeiT (two heads; a processor
  that resizes and crops the center) and of a Swin;
* ``DIR/tiny-electra``, ``DIR/tiny-deberta-v3``: an ELECTRA discriminator and a DeBERTa-v3
  masked LM with their tokenizers;
* ``DIR/beans``: three classes of 500x500 JPEG leaves in class folders plus a listing with
  beans' columns ``image_file_path`` and ``labels``, loadable with ``load_dataset(DIR/beans)``;
* ``DIR/text-corpus``: raw English prose laid out like wikitext (column ``text``), for
  masked-language-model pretraining, loadable with ``load_dataset(DIR/text-corpus)``;
* ``DIR/tiny-qwen3``, ``DIR/tiny-llama3``, ``DIR/tiny-gemma3``, ``DIR/instructions``:
  decoders with chat tokenizers and a Dolly-like instruction set (``llm.fixtures``);
* ``DIR/engines`` (where transformers' TF classes are): a tiny fine-tuned-shaped checkpoint
  of each family the Keras 3 engine trains, with the TF engine's numbers on a batch
  (DistilBERT's beside ``tf_model.h5``, as ``distilbert-base-cased`` is on the hub).

The notebooks' checkpoints are written from a table of transformers' weight names
(``untrained_weights``), so they need neither TensorFlow nor PyTorch; ``write_tiny_checkpoint``
makes one of any family that packed fine-tuning covers, with its family's kind of tokenizer,
in any of the ``LAYOUTS``, through transformers' TF classes.
Every checkpoint loads through ``tpu_helpers.data.hub`` (``from_pretrained``, ``load_tokenizer``),
as the hub's own do. The build is idempotent: a stamp file records what was built; a second call returns at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

from tpu_helpers.core.errors import InputError
from tpu_helpers.core.messages import say
from tpu_helpers.data.mlm import untrained_tokenizer
from tpu_helpers.llm import fixtures as decoder_fixtures

__all__ = [
    "FIXTURES_VERSION",
    "COLA_SPLITS",
    "COLA_LABELS",
    "MRPC_SPLITS",
    "CPU_TRAIN_ROWS",
    "MRPC_LABELS",
    "BEANS_CLASSES",
    "BEANS_SPLITS",
    "BEANS_SIZE",
    "cola_like_sentence",
    "make_cola_like",
    "paraphrase_pair",
    "make_mrpc_like",
    "write_cola",
    "write_mrpc",
    "write_tiny_distilbert",
    "write_tiny_bert",
    "untrained_weights",
    "write_untrained_checkpoint",
    "NOTEBOOK_FIXTURES",
    "tf_classes_present",
    "LAYOUTS",
    "SHARD_BYTES",
    "save_checkpoint",
    "as_saved_by_transformers5",
    "TOKENIZER_KINDS",
    "train_tokenizer",
    "tiny_config",
    "write_tiny_checkpoint",
    "write_text_corpus",
    "write_mlm_references",
    "TINY_VIT",
    "tiny_image_config",
    "write_tiny_vit",
    "write_tiny_deit",
    "write_tiny_swin",
    "write_tiny_electra",
    "write_tiny_deberta_v3",
    "leaf_image",
    "write_beans",
    "build_fixtures",
]


FIXTURES_VERSION = 27
COLA_SPLITS = {"train": 8551, "validation": 1043}
COLA_LABELS = ("unacceptable", "acceptable")
MRPC_SPLITS = {"train": 3668, "validation": 408}
#: The training rows the notebooks' CPU runs take (fewer CoLA-like sentences than CoLA's, so
#: that every leg runs each lesson in its time; validation splits of the same sizes; the tiny BERT
#: learns the MRPC-like pairs in two epochs from all of them, not from half). The
#: benchmarks build the data sets' own sizes (``build_fixtures(..., full_splits=True)``).
CPU_TRAIN_ROWS = {"cola": 4000}
MRPC_LABELS = ("not_equivalent", "equivalent")
BEANS_CLASSES = ("angular_leaf_spot", "bean_rust", "healthy")
BEANS_SPLITS = {"train": 120, "validation": 45}
BEANS_SIZE = 500

# --- a tiny grammar -------------------------------------------------------------------
_DETS = ("the", "a", "every", "some", "this", "that", "my", "her")
_NOUNS = (
    "dog",
    "cat",
    "student",
    "teacher",
    "farmer",
    "bird",
    "doctor",
    "girl",
    "boy",
    "writer",
    "baker",
    "pilot",
    "horse",
    "child",
    "singer",
    "neighbour",
)
_NAMES = ("John", "Mary", "Sue", "Bill", "Kim", "Pat", "Chris", "Lee")
_ADJS = ("small", "old", "happy", "quiet", "clever", "tall", "young", "red", "lazy", "busy")
_OBJECTS = ("book", "letter", "apple", "song", "car", "house", "picture", "cake", "story")
_PLACES = ("garden", "park", "kitchen", "station", "river", "market", "library", "school")
_PREPS = ("in", "near", "behind", "beside", "under")
_ADVS = ("quickly", "yesterday", "slowly", "again", "often", "today")
# Past tenses and the over-regularised forms that make a sentence unacceptable.
_VERBS = {
    "went": "goed",
    "ate": "eated",
    "saw": "seed",
    "took": "taked",
    "wrote": "writed",
    "ran": "runned",
    "gave": "gived",
    "found": "finded",
    "told": "telled",
    "knew": "knowed",
    "bought": "buyed",
    "sang": "singed",
    "brought": "bringed",
    "caught": "catched",
}
_REGULAR = ("liked", "watched", "visited", "helped", "painted", "opened", "carried")
_TRANSITIVE = ("ate", "saw", "took", "wrote", "found", "bought", "sang", "brought", "caught")


def _noun_phrase(rng: random.Random) -> list[str]:
    if rng.random() < 0.2:
        return [rng.choice(_NAMES)]
    words = [rng.choice(_DETS)]
    words += rng.sample(_ADJS, k=rng.choice((0, 0, 0, 1, 1, 2)))
    words.append(rng.choice(_NOUNS))
    return words


def _clause(rng: random.Random) -> tuple[list[str], list[int]]:
    """Words of one clause and the positions of its verbs."""
    words = _noun_phrase(rng)
    verbs = []
    if rng.random() < 0.6:
        verbs.append(len(words))
        words.append(rng.choice(_TRANSITIVE))
        words += [rng.choice(_DETS[:4]), rng.choice(_OBJECTS)]
    else:
        verbs.append(len(words))
        words.append(rng.choice(list(_VERBS) + list(_REGULAR)))
        if words[-1] in _REGULAR:
            words += [rng.choice(_DETS[:4]), rng.choice(_NOUNS)]
    if rng.random() < 0.35:
        words += [rng.choice(_PREPS), "the", rng.choice(_PLACES)]
    if rng.random() < 0.25:
        words.append(rng.choice(_ADVS))
    return words, verbs


def cola_like_sentence(rng: random.Random, acceptable: bool) -> str:
    """One sentence; unacceptable ones carry exactly one error somewhere in them.

    The errors are the kind CoLA marks: an over-regularised past tense ("goed"), a doubled
    determiner ("the the"), or a determiner without its noun. Sentence length follows
    CoLA's shape: mostly one short clause, a geometric tail of joined clauses.
    """
    words, verbs = _clause(rng)
    while rng.random() < 0.3:
        joiner = rng.choice(("and", "because", "but", "while", "after"))
        more, more_verbs = _clause(rng)
        verbs += [len(words) + 1 + v for v in more_verbs]
        words = words + [joiner] + more
    if not acceptable:
        candidates = [v for v in verbs if words[v] in _VERBS]
        kind = rng.random()
        if candidates and kind < 0.6:
            v = rng.choice(candidates)
            words[v] = _VERBS[words[v]]
        else:
            dets = [i for i, w in enumerate(words) if w in _DETS]
            if dets and kind < 0.85:
                i = rng.choice(dets)
                words.insert(i, words[i])
            elif dets:
                i = rng.choice(dets)
                heads = _NOUNS + _OBJECTS + _PLACES
                del words[next(j for j in range(i + 1, len(words)) if words[j] in heads)]
            else:
                words.insert(0, "the")
                words.insert(0, "the")
    sentence = " ".join(words)
    return sentence[0].upper() + sentence[1:] + "."


def make_cola_like(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Rows with CoLA's columns, about 70 % acceptable like CoLA, per split.

    >>> rows = make_cola_like(sizes={"train": 3})
    >>> sorted(rows["train"][0])
    ['idx', 'label', 'sentence']
    """
    return _labelled_rows(
        seed,
        sizes or COLA_SPLITS,
        0.7,
        lambda rng, label: {"sentence": cola_like_sentence(rng, bool(label))},
    )


def _labelled_rows(seed: int, sizes: dict[str, int], positive_share: float, columns) -> dict:
    """Per split, ``n`` rows: a label (1 with probability ``positive_share``), then the
    text ``columns(rng, label)`` makes for it, and the row's ``idx``."""
    rng = random.Random(seed)
    out = {}
    for split, n in sizes.items():
        rows = []
        for idx in range(n):
            label = int(rng.random() < positive_share)
            rows.append({**columns(rng, label), "label": label, "idx": idx})
        out[split] = rows
    return out


def paraphrase_pair(rng: random.Random, equivalent: bool) -> tuple[str, str]:
    """Two sentences of the tiny grammar: the same statement reworded (an adverb added or
    dropped, determiners swapped for their synonyms) when ``equivalent``, else a statement
    about something else that shares its frame."""
    first = cola_like_sentence(rng, True)
    if equivalent:
        words = first[:-1].split(" ")
        swap = {"the": "that", "that": "the", "a": "some", "some": "a"}
        words = [swap.get(w, w) if rng.random() < 0.5 else w for w in words]
        if words[-1] in _ADVS:
            words.pop()
        else:
            words.append(rng.choice(_ADVS))
        second = " ".join(words)
        return first, second[0].upper() + second[1:] + "."
    return first, cola_like_sentence(rng, True)


def make_mrpc_like(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Rows with GLUE MRPC's columns (``sentence1``, ``sentence2``, ``label``, ``idx``),
    about 68 % equivalent pairs like MRPC, per split.

    >>> sorted(make_mrpc_like(sizes={"train": 2})["train"][0])
    ['idx', 'label', 'sentence1', 'sentence2']
    """
    return _labelled_rows(seed, sizes or MRPC_SPLITS, 0.68, _pair_columns)


def _pair_columns(rng: random.Random, label: int) -> dict[str, str]:
    first, second = paraphrase_pair(rng, bool(label))
    return {"sentence1": first, "sentence2": second}


def _card(files: dict[str, str], features_yaml: str, title: str) -> str:
    entries = "".join(f"  - split: {s}\n    path: {p}\n" for s, p in files.items())
    return (
        f"---\nconfigs:\n- config_name: default\n  data_files:\n{entries}"
        f"dataset_info:\n  features:\n{features_yaml}---\n# {title}\n\n"
        "Built offline by `python -m tpu_helpers fixtures`; load with `datasets.load_dataset(<this"
        " folder>)`.\n"
    )


def _class_label_yaml(name: str, names) -> str:
    lines = "".join(f"          '{i}': {n}\n" for i, n in enumerate(names))
    return f"  - name: {name}\n    dtype:\n      class_label:\n        names:\n{lines}"


def _write_splits(out: Path, rows: dict[str, list[dict]]) -> dict[str, str]:
    """Write ``data/<split>-<content hash>.jsonl`` per split; return split -> relative path.

    The hash in the name matters: ``datasets`` caches a local folder under its name and
    file patterns, so a rebuilt folder with the same file names could load stale rows.
    """
    files = {}
    (out / "data").mkdir(parents=True, exist_ok=True)
    for split, split_rows in rows.items():
        text = "".join(json.dumps(row) + "\n" for row in split_rows)
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        files[split] = f"data/{split}-{digest}.jsonl"
        (out / files[split]).write_text(text, encoding="utf-8")
    return files


def write_cola(out: Path, seed: int, train_rows: int | None = None) -> None:
    rows = make_cola_like(seed, _with_train_rows(COLA_SPLITS, train_rows))
    files = _write_splits(out, rows)
    features = (
        "  - name: sentence\n    dtype: string\n"
        + _class_label_yaml("label", COLA_LABELS)
        + "  - name: idx\n    dtype: int32\n"
    )
    (out / "README.md").write_text(_card(files, features, "CoLA-like acceptability (synthetic)"))


def _with_train_rows(splits: dict[str, int], train_rows: int | None) -> dict[str, int]:
    return {**splits, "train": train_rows or splits["train"]}


def write_mrpc(out: Path, seed: int, train_rows: int | None = None) -> None:
    files = _write_splits(out, make_mrpc_like(seed, _with_train_rows(MRPC_SPLITS, train_rows)))
    features = (
        "  - name: sentence1\n    dtype: string\n  - name: sentence2\n    dtype: string\n"
        + _class_label_yaml("label", MRPC_LABELS)
        + "  - name: idx\n    dtype: int32\n"
    )
    (out / "README.md").write_text(_card(files, features, "MRPC-like paraphrase pairs (synthetic)"))


def write_tiny_distilbert(out: Path, corpus: list[str], seed: int) -> None:
    """Train a cased WordPiece tokenizer on ``corpus`` and save an untrained DistilBERT
    masked language model (classification notebooks load its base and add their head)."""
    tokenizer = train_tokenizer("distilbert", corpus, vocab_size=1000)
    config = tiny_config(
        "distilbert",
        len(tokenizer),
        tokenizer.pad_token_id,
        dim=64,
        n_heads=2,
        hidden_dim=128,
        max_position_embeddings=512,
    )
    write_untrained_checkpoint(out, config, tokenizer, seed)


def write_tiny_bert(out: Path, corpus: list[str], seed: int) -> None:
    """An untrained BERT masked language model and its WordPiece tokenizer, laid out as a
    checkpoint pushed from transformers 5: sharded safetensors, transformers 5's tokenizer
    and config files."""
    tokenizer = train_tokenizer("bert", corpus)
    config = tiny_config("bert", len(tokenizer), tokenizer.pad_token_id)
    write_untrained_checkpoint(out, config, tokenizer, seed, "pytorch-sharded+transformers5")


def write_tiny_electra(out: Path, corpus: list[str], seed: int) -> None:
    """An untrained ELECTRA discriminator (embeddings of 16 projected to 32) and its
    WordPiece tokenizer, as the hub serves ``google/electra-*-discriminator``."""
    tokenizer = train_tokenizer("electra", corpus)
    config = tiny_config("electra", len(tokenizer), tokenizer.pad_token_id)
    write_untrained_checkpoint(out, config, tokenizer, seed)


def write_tiny_deberta_v3(out: Path, corpus: list[str], seed: int) -> None:
    """An untrained DeBERTa-v3 masked LM (model type ``deberta-v2``: relative positions in
    log buckets, no token types) and its tokenizer."""
    tokenizer = train_tokenizer("deberta-v2", corpus)
    config = tiny_config(
        "deberta-v2",
        len(tokenizer),
        tokenizer.pad_token_id,
        **ENGINE_FAMILY_OVERRIDES["deberta-v2"],
    )
    write_untrained_checkpoint(out, config, tokenizer, seed)


# How a checkpoint's files are laid out (see tpu_helpers.data.hub): PyTorch-named safetensors
# alone (most of the hub), beside tf_model.h5 (distilbert-base-cased and other older
# checkpoints), in shards, as a TF class writes them; "+transformers5" also writes the
# tokenizer and config files as transformers 5 does.
LAYOUTS = ("pytorch", "pytorch+h5", "pytorch-sharded", "tf-h5")
SHARD_BYTES = 64 * 1024  # tiny checkpoints still span several shards


def save_checkpoint(
    out: Path, model, tokenizer=None, layout: str = "pytorch", shard_bytes: int = SHARD_BYTES
) -> None:
    """Save ``model`` (a TF class) and ``tokenizer`` (or an image processor; none: the
    weights and config alone) into ``out`` in ``layout``: one of ``LAYOUTS``, optionally
    followed by ``+transformers5``; shards of at most ``shard_bytes``."""
    from tpu_helpers.tf_engine import tf_classes

    weights, version = _layout(layout)
    out.mkdir(parents=True)
    if weights in ("pytorch+h5", "tf-h5"):
        model.save_pretrained(out, safe_serialization=False)  # config.json + tf_model.h5
    if weights.startswith("pytorch"):
        sharded = weights == "pytorch-sharded"
        tf_classes.save_hub_layout(model, out, max_shard_bytes=shard_bytes if sharded else None)
    _save_preprocessing(out, tokenizer, version)


def _save_preprocessing(out: Path, tokenizer, version: str) -> None:
    """The tokenizer's (or image processor's) files beside the weights, rewritten as
    transformers 5 writes them when ``version`` is ``"5"``."""
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if version:
        as_saved_by_transformers5(out)


def _layout(layout: str) -> tuple[str, str]:
    """``(weights, transformers version)`` of a layout name such as ``pytorch+transformers5``."""
    weights, _, version = layout.partition("+transformers")
    if weights not in LAYOUTS or version not in ("", "5"):
        raise InputError(
            f"Unknown checkpoint layout {layout!r}. Fix: one of {LAYOUTS}, optionally"
            " followed by '+transformers5'."
        )
    return weights, version


def as_saved_by_transformers5(folder: Path) -> None:
    """Rewrite the tokenizer and config files in ``folder`` as transformers 5 writes them
    (seen with 5.2): ``tokenizer_config.json`` names the class ``TokenizersBackend`` and
    drops the added-token table (``tokenizer.json`` holds it), no ``vocab.txt`` nor
    ``special_tokens_map.json``; ``config.json`` names ``dtype`` (4.x: ``torch_dtype``)."""
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    for old in ("added_tokens_decoder", "extra_special_tokens"):
        settings.pop(old, None)
    settings.update(tokenizer_class="TokenizersBackend", backend="tokenizers")
    tokenizer_config.write_text(json.dumps(settings, indent=2, sort_keys=True))
    for gone in ("vocab.txt", "special_tokens_map.json", "added_tokens.json"):
        (folder / gone).unlink(missing_ok=True)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("torch_dtype", None)
    config.update(dtype="float32", transformers_version="5.2.0")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


# Per family: the tokenizer model its hub checkpoints use (WordPiece, byte-level BPE or a
# SentencePiece unigram), its special tokens (padding first: its id is the config's
# pad_token_id), and the templates of one sentence and of a pair ($B:1 marks token type 1).
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
_BERT_TEMPLATES = ("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1")
_ROBERTA_TEMPLATES = ("<s> $A </s>", "<s> $A </s> </s> $B </s>")
TOKENIZER_KINDS = {
    "albert": ("unigram", ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"), _BERT_TEMPLATES),
    "bert": ("wordpiece", _BERT_SPECIALS, _BERT_TEMPLATES),
    "camembert": ("unigram", _ROBERTA_SPECIALS, _ROBERTA_TEMPLATES),
    "deberta-v2": ("unigram", _BERT_SPECIALS, _BERT_TEMPLATES),
    "distilbert": ("wordpiece", _BERT_SPECIALS, _BERT_TEMPLATES),
    "electra": ("wordpiece", _BERT_SPECIALS, _BERT_TEMPLATES),
    "mpnet": ("wordpiece", _ROBERTA_SPECIALS, _ROBERTA_TEMPLATES),
    "roberta": ("bpe", _ROBERTA_SPECIALS, _ROBERTA_TEMPLATES),
    "xlm-roberta": ("unigram", _ROBERTA_SPECIALS, _ROBERTA_TEMPLATES),
}


def train_tokenizer(family: str, corpus: list[str], vocab_size: int = 600):
    """A fast tokenizer of ``family``'s class (``BertTokenizerFast``, ``AlbertTokenizerFast``
    ...) with the tokenizer model, special tokens and pair template of its hub checkpoints,
    trained on ``corpus`` (WordPiece ones cased): loads with ``AutoTokenizer.from_pretrained`` once saved."""
    from tokenizers import models, processors
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if family not in TOKENIZER_KINDS:
        raise InputError(
            f"No tokenizer recipe for family {family!r}. Fix: one of {sorted(TOKENIZER_KINDS)}."
        )
    kind, specials, (single, pair) = TOKENIZER_KINDS[family]
    specials = list(specials)
    unk = next(t for t in specials if "unk" in t.lower())
    tok, trainer = untrained_tokenizer(kind, specials, unk, vocab_size)
    tok.train_from_iterator(corpus, trainer)
    if kind == "wordpiece":
        # The trainer numbers tokens of equal frequency in hash order; renumber them
        # (specials first, then sorted). Its ties can still change which sub-words it
        # learns from one build to the next (seen: 359 tokens, a few dozen differing).
        learned = sorted(set(tok.get_vocab()) - set(specials))
        vocab = {token: i for i, token in enumerate(specials + learned)}
        tok.model = models.WordPiece(vocab=vocab, unk_token=unk)
    ids = {t: tok.token_to_id(t) for t in specials}
    assert [ids[t] for t in specials] == list(range(len(specials))), ids
    used = [t for t in specials if t in single + pair]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, ids[t]) for t in used]
    )
    cls = tokenizer_class_from_name(_FAST_CLASS[family])
    return cls(tokenizer_object=tok, model_max_length=512, **_special_names(kind, specials, unk))


def _special_names(kind: str, specials: list[str], unk: str) -> dict:
    """The fast tokenizer class's special-token arguments for ``specials``."""
    if "<s>" in specials:
        names = {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
        names["pad_token"] = "<pad>"
    else:
        names = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": specials[0]}
    names.update(unk_token=unk, mask_token=specials[-1])
    if kind == "wordpiece":  # cased: the fast classes would lowercase by default
        names["do_lower_case"] = False
    return names


_FAST_CLASS = {
    "albert": "AlbertTokenizerFast",
    "bert": "BertTokenizerFast",
    "camembert": "CamembertTokenizerFast",
    "deberta-v2": "DebertaV2TokenizerFast",
    "distilbert": "DistilBertTokenizerFast",
    "electra": "ElectraTokenizerFast",
    "mpnet": "MPNetTokenizerFast",
    "roberta": "RobertaTokenizerFast",
    "xlm-roberta": "XLMRobertaTokenizerFast",
}


def tiny_config(family: str, vocab_size: int, pad_token_id: int, num_labels: int = 2, **overrides):
    """A tiny config of ``family`` (hidden size 32, 2 layers, 2 heads, 130 positions) for a
    tokenizer's vocabulary size and padding id; ``overrides`` replace any field."""
    from transformers import AutoConfig

    sizes = {"vocab_size": vocab_size, "num_labels": num_labels, "pad_token_id": pad_token_id}
    if family == "distilbert":
        sizes.update(dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=130)
    else:
        sizes.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
        sizes.update(intermediate_size=64, max_position_embeddings=130)
    if family in ("albert", "electra"):
        sizes["embedding_size"] = 16  # both project their embeddings to the hidden size
    if family in ("camembert", "mpnet", "roberta", "xlm-roberta"):
        sizes["max_position_embeddings"] = 130 + pad_token_id + 1
    if family in ("roberta", "xlm-roberta", "camembert"):
        sizes["type_vocab_size"] = 1
    if family == "deberta-v2":  # relative attention as DeBERTa-v3 has, and absolute
        # position embeddings too (position_biased_input, the config's default)
        sizes.update(relative_attention=True, pos_att_type=["p2c", "c2p"])
        sizes.update(position_buckets=32, max_relative_positions=128, type_vocab_size=0)
    sizes.update(overrides)
    return AutoConfig.for_model(family, **sizes)


# The weights transformers saves for the architectures of the notebooks' tiny checkpoints,
# by their PyTorch names and shapes, so that those checkpoints are written without any
# framework: a TPU runtime has no TensorFlow, and transformers 5 no TF classes.
# tests/test_fixtures.py holds them equal to what transformers' own classes save.
_ARCHITECTURES = {
    "distilbert": "DistilBertForMaskedLM",
    "bert": "BertForMaskedLM",
    "vit": "ViTForImageClassification",
    "deit": "DeiTForImageClassificationWithTeacher",
    "swin": "SwinForImageClassification",
    "electra": "ElectraForPreTraining",
    "deberta-v2": "DebertaV2ForMaskedLM",
}


def _linear(name: str, out: int, into: int) -> dict:
    return {f"{name}.weight": (out, into), f"{name}.bias": (out,)}


def _norm(name: str, size: int) -> dict:
    return {f"{name}.weight": (size,), f"{name}.bias": (size,)}


def _encoder_layers(
    prefix: str, config, attention: str, norms: tuple[str, str], parts=("query", "key", "value")
) -> dict:
    """BERT's and ViT's encoder layers (ELECTRA's and DeBERTa's too): ``attention`` names
    the query/key/value block, ``parts`` its three projections, ``norms`` the layer norms
    after attention and after the feed-forward part (BERT) or before them (ViT)."""
    h, inner = config.hidden_size, config.intermediate_size
    shapes = {}
    for i in range(config.num_hidden_layers):
        p = f"{prefix}.encoder.layer.{i}"
        for part in parts:
            shapes |= _linear(f"{p}.{attention}.{part}", h, h)
        shapes |= _linear(f"{p}.attention.output.dense", h, h)
        shapes |= _linear(f"{p}.intermediate.dense", inner, h)
        shapes |= _linear(f"{p}.output.dense", h, inner)
        shapes |= _norm(f"{p}.{norms[0]}", h) | _norm(f"{p}.{norms[1]}", h)
    return shapes


def _distilbert_shapes(c) -> dict:
    shapes = {
        "distilbert.embeddings.word_embeddings.weight": (c.vocab_size, c.dim),
        "distilbert.embeddings.position_embeddings.weight": (c.max_position_embeddings, c.dim),
        **_norm("distilbert.embeddings.LayerNorm", c.dim),
    }
    for i in range(c.n_layers):
        p = f"distilbert.transformer.layer.{i}"
        for part in ("q_lin", "k_lin", "v_lin", "out_lin"):
            shapes |= _linear(f"{p}.attention.{part}", c.dim, c.dim)
        shapes |= _linear(f"{p}.ffn.lin1", c.hidden_dim, c.dim)
        shapes |= _linear(f"{p}.ffn.lin2", c.dim, c.hidden_dim)
        shapes |= _norm(f"{p}.sa_layer_norm", c.dim) | _norm(f"{p}.output_layer_norm", c.dim)
    shapes |= _linear("vocab_transform", c.dim, c.dim) | _norm("vocab_layer_norm", c.dim)
    return shapes | {"vocab_projector.bias": (c.vocab_size,)}  # its weight: the embeddings


def _bert_shapes(c) -> dict:
    h = c.hidden_size
    shapes = {
        "bert.embeddings.word_embeddings.weight": (c.vocab_size, h),
        "bert.embeddings.position_embeddings.weight": (c.max_position_embeddings, h),
        "bert.embeddings.token_type_embeddings.weight": (c.type_vocab_size, h),
        **_norm("bert.embeddings.LayerNorm", h),
    }
    norms = ("attention.output.LayerNorm", "output.LayerNorm")
    shapes |= _encoder_layers("bert", c, "attention.self", norms)
    shapes |= _linear("cls.predictions.transform.dense", h, h)
    shapes |= _norm("cls.predictions.transform.LayerNorm", h)
    return shapes | {"cls.predictions.bias": (c.vocab_size,)}  # the decoder: the embeddings


def _electra_shapes(c) -> dict:
    """ELECTRA's discriminator (``ElectraForPreTraining``, as the hub serves ELECTRA): BERT's
    encoder on embeddings of their own size, projected to the hidden size where they differ,
    and the head that tells replaced tokens."""
    e, h = c.embedding_size, c.hidden_size
    shapes = {
        "electra.embeddings.word_embeddings.weight": (c.vocab_size, e),
        "electra.embeddings.position_embeddings.weight": (c.max_position_embeddings, e),
        "electra.embeddings.token_type_embeddings.weight": (c.type_vocab_size, e),
        **_norm("electra.embeddings.LayerNorm", e),
    }
    if e != h:
        shapes |= _linear("electra.embeddings_project", h, e)
    norms = ("attention.output.LayerNorm", "output.LayerNorm")
    shapes |= _encoder_layers("electra", c, "attention.self", norms)
    shapes |= _linear("discriminator_predictions.dense", h, h)
    return shapes | _linear("discriminator_predictions.dense_prediction", 1, h)


def _deberta_shapes(c) -> dict:
    """DeBERTa-v3's masked LM (``DebertaV2ForMaskedLM``): token embeddings alone, the table
    of relative position embeddings and its layer norm, the encoder, BERT's masked-LM head."""
    h = c.hidden_size
    shapes = {
        "deberta.embeddings.word_embeddings.weight": (c.vocab_size, h),
        **_norm("deberta.embeddings.LayerNorm", h),
        "deberta.encoder.rel_embeddings.weight": (2 * c.position_buckets, h),
        **_norm("deberta.encoder.LayerNorm", h),
    }
    norms = ("attention.output.LayerNorm", "output.LayerNorm")
    parts = ("query_proj", "key_proj", "value_proj")
    shapes |= _encoder_layers("deberta", c, "attention.self", norms, parts)
    shapes |= _linear("cls.predictions.transform.dense", h, h)
    shapes |= _norm("cls.predictions.transform.LayerNorm", h)
    return shapes | {"cls.predictions.bias": (c.vocab_size,)}  # the decoder: the embeddings


def _vit_shapes(c, prefix: str = "vit", tokens: tuple = ("cls_token",)) -> dict:
    """ViT's (``ViTForImageClassification``): patches and the ``tokens`` before them, the
    encoder layers, a layer norm, the classifier."""
    h, patch = c.hidden_size, c.patch_size
    patches = (c.image_size // patch) ** 2
    shapes = {f"{prefix}.embeddings.{token}": (1, 1, h) for token in tokens}
    shapes |= {
        f"{prefix}.embeddings.position_embeddings": (1, patches + len(tokens), h),
        f"{prefix}.embeddings.patch_embeddings.projection.weight": (
            h,
            c.num_channels,
            patch,
            patch,
        ),
        f"{prefix}.embeddings.patch_embeddings.projection.bias": (h,),
    }
    norms = ("layernorm_before", "layernorm_after")
    shapes |= _encoder_layers(prefix, c, "attention.attention", norms)
    shapes |= _norm(f"{prefix}.layernorm", h)
    if prefix == "deit":  # a head on each token
        heads = ("cls_classifier", "distillation_classifier")
        return shapes | {k: v for n in heads for k, v in _linear(n, c.num_labels, h).items()}
    return shapes | _linear("classifier", c.num_labels, h)


def _deit_shapes(c) -> dict:
    """A distilled DeiT's (``DeiTForImageClassificationWithTeacher``): ViT's layers under
    ``deit.``, a distillation token beside the class token, and a head on each."""
    return _vit_shapes(c, "deit", ("cls_token", "distillation_token"))


def _swin_shapes(c) -> dict:
    """Swin's: a patch embedding, stages of window-attention blocks (each with its table of
    relative position biases and the index into it), a patch merging between stages."""
    w, dim = c.window_size, c.embed_dim
    shapes = {
        "swin.embeddings.patch_embeddings.projection.weight": (
            dim,
            c.num_channels,
            c.patch_size,
            c.patch_size,
        ),
        "swin.embeddings.patch_embeddings.projection.bias": (dim,),
        **_norm("swin.embeddings.norm", dim),
    }
    for i, (depth, heads) in enumerate(zip(c.depths, c.num_heads, strict=True)):
        inner = int(dim * c.mlp_ratio)
        for j in range(depth):
            p = f"swin.encoder.layers.{i}.blocks.{j}"
            for part in ("query", "key", "value"):
                shapes |= _linear(f"{p}.attention.self.{part}", dim, dim)
            shapes[f"{p}.attention.self.relative_position_bias_table"] = ((2 * w - 1) ** 2, heads)
            shapes[f"{p}.attention.self.relative_position_index"] = (w * w, w * w)
            shapes |= _linear(f"{p}.attention.output.dense", dim, dim)
            shapes |= _linear(f"{p}.intermediate.dense", inner, dim)
            shapes |= _linear(f"{p}.output.dense", dim, inner)
            shapes |= _norm(f"{p}.layernorm_before", dim) | _norm(f"{p}.layernorm_after", dim)
        if i < len(c.depths) - 1:  # patch merging: 2x2 neighbours into twice the width
            p = f"swin.encoder.layers.{i}.downsample"
            shapes[f"{p}.reduction.weight"] = (2 * dim, 4 * dim)
            shapes |= _norm(f"{p}.norm", 4 * dim)
            dim *= 2
    return shapes | _norm("swin.layernorm", dim) | _linear("classifier", c.num_labels, dim)


def _relative_position_index(window: int):
    """Swin's index of each pair of a window's positions into its table of biases: the pair's
    offset along each axis, shifted to start at 0, as one row-major number (int64, as
    PyTorch saves it)."""
    import numpy as np

    rows, cols = np.meshgrid(np.arange(window), np.arange(window), indexing="ij")
    coords = np.stack([rows.ravel(), cols.ravel()])  # [2, window * window]
    offsets = (coords[:, :, None] - coords[:, None, :]) + window - 1
    return (offsets[0] * (2 * window - 1) + offsets[1]).astype("int64")


_SHAPES = {
    "distilbert": _distilbert_shapes,
    "bert": _bert_shapes,
    "vit": _vit_shapes,
    "deit": _deit_shapes,
    "swin": _swin_shapes,
    "electra": _electra_shapes,
    "deberta-v2": _deberta_shapes,
}


def untrained_weights(config, seed: int = 0) -> dict:
    """PyTorch name -> array of an untrained ``config`` (a ``distilbert`` or ``bert``
    masked-LM, a ``vit``, distilled ``deit`` or ``swin`` image classifier) as transformers' TF classes initialize one:
    weights drawn from a normal of ``initializer_range`` cut at two deviations, biases 0,
    layer norms 1 and 0."""
    import numpy as np

    if config.model_type not in _SHAPES:
        raise InputError(
            f"No weight table for model_type {config.model_type!r}. Fix: one of"
            f" {sorted(_SHAPES)}, or write_tiny_checkpoint (transformers' TF classes)."
        )
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in _SHAPES[config.model_type](config).items():
        if name.endswith(".relative_position_index"):  # computed, not drawn
            tensors[name] = _relative_position_index(config.window_size)
        elif name.endswith(".bias"):
            tensors[name] = np.zeros(shape, "float32")
        elif "norm" in name.lower():
            tensors[name] = np.ones(shape, "float32")
        else:
            drawn = rng.standard_normal(shape)
            while (outside := np.abs(drawn) > 2).any():
                drawn[outside] = rng.standard_normal(int(outside.sum()))
            tensors[name] = (drawn * config.initializer_range).astype("float32")
    return tensors


def write_untrained_checkpoint(
    out: Path, config, tokenizer=None, seed: int = 0, layout: str = "pytorch"
) -> None:
    """Save an untrained ``config`` (see ``untrained_weights``) and ``tokenizer`` into
    ``out`` as the hub serves them, without TensorFlow or PyTorch: ``layout`` ``pytorch``
    or ``pytorch-sharded``, optionally followed by ``+transformers5``."""
    import copy

    from tpu_helpers.data import hub

    weights, version = _layout(layout)
    if weights not in ("pytorch", "pytorch-sharded"):
        raise InputError(
            f"Layout {layout!r} holds tf_model.h5, which needs transformers' TF classes. Fix:"
            " 'pytorch' or 'pytorch-sharded' (optionally '+transformers5'), or"
            " write_tiny_checkpoint in the CPU stack."
        )
    tensors = untrained_weights(config, seed)  # an unknown model type: refused here
    out.mkdir(parents=True)
    shard_bytes = SHARD_BYTES if weights == "pytorch-sharded" else None
    hub.write_hub_weights(tensors, out, shard_bytes)
    config = copy.deepcopy(config)
    config.architectures = [_ARCHITECTURES[config.model_type]]
    config.save_pretrained(out)
    _save_preprocessing(out, tokenizer, version)


def write_tiny_checkpoint(
    out: Path,
    family: str,
    corpus: list[str],
    seed: int = 0,
    layout: str = "pytorch",
    **overrides,
) -> None:
    """Save a tiny untrained masked-LM checkpoint of ``family`` and its tokenizer (see
    ``train_tokenizer``) to ``out`` in ``layout`` (see ``save_checkpoint``; by default
    PyTorch-named ``model.safetensors``, as most of the hub serves), loadable like the
    family's hub checkpoints (``hub.load_tokenizer``, ``tf_classes.from_pretrained``).
    ``overrides`` go to ``tiny_config``."""
    import tensorflow as tf
    from transformers import TFAutoModelForMaskedLM

    tokenizer = train_tokenizer(family, corpus)
    tf.keras.utils.set_random_seed(seed)
    config = tiny_config(family, len(tokenizer), tokenizer.pad_token_id, **overrides)
    model = TFAutoModelForMaskedLM.from_config(config)
    model(model.dummy_inputs)
    save_checkpoint(out, model, tokenizer, layout)


def write_text_corpus(out: Path) -> None:
    """Raw English prose laid out like wikitext (`` = Title = `` headings, blank lines, one
    paragraph per line): the Python documentation topics that ship with Python itself
    (``pydoc_data.topics``), about 460 KB. Split into train and validation by topic."""
    from pydoc_data.topics import topics

    splits = {"train": [], "validation": []}
    for i, (name, body) in enumerate(sorted(topics.items())):
        lines = [{"text": ""}, {"text": f" = {name} = "}, {"text": ""}]
        for paragraph in re.split(r"\n\s*\n", body):
            kept = [line.strip() for line in paragraph.splitlines()]
            text = " ".join(line for line in kept if line and not set(line) <= set("*=-~^"))
            if text:
                lines += [{"text": f" {text} "}, {"text": ""}]
        splits["validation" if i % 8 == 7 else "train"].extend(lines)
    files = _write_splits(out, splits)
    features = "  - name: text\n    dtype: string\n"
    (out / "README.md").write_text(_card(files, features, "Python documentation prose (raw text)"))


# The tiny ViT's config: 32x32 images in patches of 8, 10 labels.
TINY_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "num_labels": 10,
}


# The other image families' tiny configs for the engines' references: DeiT as the ViT
# above (its distillation token beside the class token), Swin in patches of 4 and windows
# of 4 (its first stage's second block shifts them), two stages.
TINY_DEIT = dict(TINY_VIT)
TINY_SWIN = {
    "image_size": 32,
    "patch_size": 4,
    "embed_dim": 16,
    "depths": [2, 2],
    "num_heads": [2, 4],
    "window_size": 4,
    "num_labels": 10,
}


def tiny_image_config(family: str, **overrides):
    """The tiny config of the image ``family`` (``vit``, ``deit``, ``swin``), ``overrides``
    set on it."""
    from transformers import AutoConfig

    sizes = {"vit": TINY_VIT, "deit": TINY_DEIT, "swin": TINY_SWIN}[family]
    return AutoConfig.for_model(family, **{**sizes, **overrides})


def _image_reference_model(family: str):
    """A tiny TF image classifier of ``family`` for the engines' references, of the class
    the notebooks' checkpoint of it names (a distilled DeiT's: two heads, averaged)."""
    import transformers

    config = _without_dropout(tiny_image_config(family, **ENGINE_OVERRIDES))
    return getattr(transformers, "TF" + _ARCHITECTURES[family])(config)


def write_tiny_vit(out: Path, seed: int) -> None:
    """An untrained 32x32 ViT with 10 labels and its image processor's settings."""
    processor = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    _write_tiny_image_classifier(
        out, tiny_image_config("vit"), "ViTImageProcessor", processor, seed
    )


def write_tiny_deit(out: Path, seed: int) -> None:
    """An untrained 32x32 distilled DeiT with 10 labels, and a processor that resizes to
    36x36 and crops the center 32x32, with ImageNet's constants (as DeiT's does at 256 and
    224)."""
    processor = {
        **_IMAGENET,
        "resample": 3,
        "size": {"height": 36, "width": 36},
        "do_center_crop": True,
        "crop_size": {"height": 32, "width": 32},
    }
    _write_tiny_image_classifier(
        out, tiny_image_config("deit"), "DeiTImageProcessor", processor, seed
    )


def write_tiny_swin(out: Path, seed: int) -> None:
    """An untrained 32x32 Swin with 10 labels and ImageNet's constants (Swin's checkpoints
    save ViT's processor)."""
    config = tiny_image_config("swin")
    _write_tiny_image_classifier(
        out, config, "ViTImageProcessor", {**_IMAGENET, "resample": 3}, seed
    )


_IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def _write_tiny_image_classifier(out: Path, config, processor_type: str, settings, seed):
    """An untrained image classifier of ``config`` and the ``preprocessor_config.json`` a
    ``processor_type`` of ``settings`` saves (32x32 images unless they say otherwise)."""
    write_untrained_checkpoint(out, config, None, seed)
    processor = {
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_processor_type": processor_type,
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": 32, "width": 32},
        **settings,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True))


def leaf_image(rng, label: int, size: int = BEANS_SIZE):
    """A synthetic bean leaf: green with veins; class 0 brown angular patches, class 1
    many small rust-coloured dots, class 2 (healthy) neither. Returns an RGB uint8 array."""
    import numpy as np

    y, x = np.mgrid[0:size, 0:size] / size
    cx, cy = 0.5 + rng.normal(0, 0.05), 0.5 + rng.normal(0, 0.05)
    leaf = ((x - cx) / 0.45) ** 2 + ((y - cy) / 0.32) ** 2 < 1
    img = np.empty((size, size, 3), np.float32)
    img[:] = (200, 190, 160)  # background
    green = np.array((60, 130 + rng.integers(-20, 20), 50), np.float32)
    img[leaf] = green + rng.normal(0, 12, (int(leaf.sum()), 3))
    veins = leaf & (np.abs(np.sin((x - cx) * 30 + (y - cy) * 6)) < 0.06)
    img[veins] = (90, 170, 80)
    if label == 0:
        for _ in range(rng.integers(6, 12)):
            px, py = rng.uniform(0.2, 0.8), rng.uniform(0.3, 0.7)
            w, h = rng.uniform(0.03, 0.07, 2)
            patch = leaf & (np.abs(x - px) < w) & (np.abs(y - py) < h)
            img[patch] = (110, 80, 40)
    elif label == 1:
        for _ in range(rng.integers(60, 120)):
            px, py = rng.uniform(0.1, 0.9), rng.uniform(0.2, 0.8)
            dot = leaf & ((x - px) ** 2 + (y - py) ** 2 < rng.uniform(0.0002, 0.0006))
            img[dot] = (190, 100, 30)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_beans(out: Path, seed: int, splits: dict[str, int] | None = None) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    listing = {}
    for split, n in (splits or BEANS_SPLITS).items():
        rows = []
        for i in range(n):
            label = i % len(BEANS_CLASSES)
            folder = out / "images" / split / BEANS_CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{BEANS_CLASSES[label]}_{split}.{i}.jpg"
            Image.fromarray(leaf_image(rng, label)).save(path, quality=90)
            rows.append({"image_file_path": str(path.resolve()), "labels": label})
        listing[split] = rows
    files = _write_splits(out, listing)
    features = "  - name: image_file_path\n    dtype: string\n" + _class_label_yaml(
        "labels", BEANS_CLASSES
    )
    (out / "README.md").write_text(_card(files, features, "Beans-like leaves (synthetic)"))


# The Keras 3 engine's references: a fine-tuned-shaped checkpoint (a classifier head for 3
# labels) of every family that engine trains, and what the TF engine computes with it.
ENGINE_LABELS = 3
ENGINE_LEARNING_RATE = 0.5
#: Weights drawn 15 times wider than transformers' (0.02): a tiny model's logits then
#: depend on every input token and weight, so a wrong one shows (at 0.02 they are nearly
#: the same for every row).
ENGINE_OVERRIDES = {"num_labels": ENGINE_LABELS, "initializer_range": 0.3}
#: DeBERTa-v3's settings where the tiny DeBERTa-v2 (the TF engine's packing tests) differs:
#: the variant the Keras 3 engine reads (relative positions only, their layer norm)
ENGINE_FAMILY_OVERRIDES = {
    "deberta-v2": {
        "position_biased_input": False,
        "norm_rel_ebd": "layer_norm",
        "share_att_key": True,
    }
}


def _without_dropout(config):
    """``config`` with every dropout rate 0, stochastic depth's (Swin's ``drop_path_rate``)
    too: one training step is then the same function in both engines (their dropout masks
    are drawn from different generators)."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or "drop_path" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def _reference_batch(family: str, tokenizer, corpus: list[str], rng) -> dict:
    """8 rows padded to one width: four single sentences, then four sentence pairs, each
    as the family's tokenizer joins them, with the features the Keras 3 engine takes for
    the family (token types for BERT, ALBERT and ELECTRA)."""
    import numpy as np

    from tpu_helpers.core.families import FAMILIES

    rows = [corpus[i] for i in rng.choice(len(corpus), 8, replace=False)]
    if tokenizer is None:  # an image family
        return {"pixel_values": rng.normal(size=(8, 3, 32, 32)).astype("float32")}
    options = {"padding": "max_length", "max_length": 40, "truncation": True}
    singles, pairs = tokenizer(rows[:4], **options), tokenizer(rows[4:], rows[:4], **options)
    keep = [k for k in FAMILIES[family].keras3.inputs if k in pairs]
    return {k: np.asarray(singles[k] + pairs[k], dtype="int32") for k in keep}


def write_engine_references(out: Path, corpus: list[str], seed: int) -> None:
    """For each family of ``families.KERAS3``: a tiny classifier for
    ``ENGINE_LABELS`` labels without dropout in the hub's layout (BERT's sharded, with
    transformers 5's tokenizer files), and ``reference.npz``: a batch, its labels, the TF
    engine's logits, the loss, and the logits after one SGD step of
    ``ENGINE_LEARNING_RATE`` on that batch. The Keras 3 engine's tests load the same
    files and must compute the same numbers."""
    import numpy as np
    import tensorflow as tf
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.core.families import FAMILIES, KERAS3

    rng = np.random.default_rng(seed)
    for family in KERAS3:
        tf.keras.utils.set_random_seed(seed)
        if "pixel_values" in FAMILIES[family].keras3.inputs:
            model, tokenizer = _image_reference_model(family), None
        else:
            tokenizer = train_tokenizer(family, corpus)
            overrides = {**ENGINE_OVERRIDES, **ENGINE_FAMILY_OVERRIDES.get(family, {})}
            config = tiny_config(family, len(tokenizer), tokenizer.pad_token_id, **overrides)
            model = TFAutoModelForSequenceClassification.from_config(_without_dropout(config))
        _without_dropout(model.config)
        features = _reference_batch(family, tokenizer, corpus, rng)
        labels = rng.integers(0, ENGINE_LABELS, size=8).astype("int32")
        logits = model(features, training=False).logits.numpy()
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True).logits)
        grads = tape.gradient(loss, model.trainable_variables)
        layout = {"bert": "pytorch-sharded+transformers5", "distilbert": "pytorch+h5"}.get(
            family, "pytorch"
        )
        save_checkpoint(out / family, model, tokenizer, layout)  # the weights before the step
        tf.keras.optimizers.SGD(ENGINE_LEARNING_RATE).apply_gradients(
            zip(grads, model.trainable_variables, strict=True)
        )
        after = model(features, training=False).logits.numpy()
        np.savez(
            out / family / "reference.npz",
            labels=labels,
            logits=logits,
            loss=np.float32(loss),
            logits_after_step=after,
            **{f"feature_{k}": v for k, v in features.items()},
        )


def _masked_reference_batch(tokenizer, corpus: list[str], rng, rows=8, width=24) -> tuple:
    """``rows`` blocks of ``width`` tokens cut from ``corpus``, about 15 % of their
    non-special tokens replaced by the mask token: ``(input_ids, labels, weights)``, the
    labels the original ids, the weights 1 where a token was masked."""
    import numpy as np

    stream = [i for text in corpus[:400] for i in tokenizer(text)["input_ids"]]
    labels = np.asarray(stream[: rows * width], "int32").reshape(rows, width)
    special = np.isin(labels, tokenizer.all_special_ids)
    chosen = (rng.random(labels.shape) < 0.15) & ~special
    chosen[np.arange(rows), rng.integers(1, width - 1, rows)] |= True  # one at least
    chosen &= ~special
    ids = np.where(chosen, tokenizer.mask_token_id, labels).astype("int32")
    return ids, labels, chosen.astype("float32")


def write_mlm_references(out: Path, corpus: list[str], seed: int) -> None:
    """For each family of ``families.MLM``: a tiny masked-LM checkpoint without dropout in
    the hub's layout (``out/<family>-mlm``), and ``reference.npz``: a masked batch, the TF
    engine's logits, transformers' masked-LM loss (the mean over the masked tokens) and
    the logits after one SGD step of ``ENGINE_LEARNING_RATE`` on it."""
    import numpy as np
    import tensorflow as tf
    from transformers import TFAutoModelForMaskedLM

    from tpu_helpers.core.families import MLM

    rng = np.random.default_rng(seed + 1)
    for family in MLM:
        tf.keras.utils.set_random_seed(seed)
        tokenizer = train_tokenizer(family, corpus)
        overrides = {k: v for k, v in ENGINE_OVERRIDES.items() if k != "num_labels"}
        config = tiny_config(family, len(tokenizer), tokenizer.pad_token_id, **overrides)
        model = TFAutoModelForMaskedLM.from_config(_without_dropout(config))
        ids, labels, weights = _masked_reference_batch(tokenizer, corpus, rng)
        logits = model(ids, training=False).logits.numpy()
        hidden = np.where(weights > 0, labels, -100)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(ids, labels=hidden, training=True).loss)
        grads = tape.gradient(loss, model.trainable_variables)
        save_checkpoint(out / f"{family}-mlm", model, tokenizer, "pytorch")
        pairs = [
            (g, v) for g, v in zip(grads, model.trainable_variables, strict=True) if g is not None
        ]
        tf.keras.optimizers.SGD(ENGINE_LEARNING_RATE).apply_gradients(pairs)
        after = model(ids, training=False).logits.numpy()
        np.savez(
            out / f"{family}-mlm" / "reference.npz",
            input_ids=ids,
            labels=labels,
            weights=weights,
            logits=logits,
            loss=np.float32(loss),
            logits_after_step=after,
        )


#: What the notebooks read (both tracks), written in any stack; the engines' references
#: ("engines") need transformers' TF classes, so only the TF engine's stacks write them.
NOTEBOOK_FIXTURES = (
    "tiny-distilbert",
    "tiny-bert",
    "cola",
    "mrpc",
    "tiny-vit",
    "tiny-deit",
    "tiny-swin",
    "tiny-electra",
    "tiny-deberta-v3",
    "beans",
    "text-corpus",
    "tiny-qwen3",
    "tiny-llama3",
    "tiny-gemma3",
    "instructions",
)


def tf_classes_present() -> bool:
    """Whether this transformers has its TF classes and TensorFlow to run them (4.x with
    TensorFlow and tf-keras; 5 has none, and 4.x without TensorFlow only placeholders)."""
    try:
        import transformers
        from transformers.utils import is_tf_available
    except ImportError:
        return False
    return int(transformers.__version__.split(".")[0]) < 5 and is_tf_available()


def _write_staged(staging: Path, seed: int, train_rows: dict, references: bool) -> None:
    """Every fixture but the beans (whose listing holds absolute paths) into ``staging``."""
    write_cola(staging / "cola", seed, train_rows.get("cola"))
    corpus = [r["sentence"] for rows in make_cola_like(seed).values() for r in rows]
    write_tiny_distilbert(staging / "tiny-distilbert", corpus, seed)
    write_mrpc(staging / "mrpc", seed, train_rows.get("mrpc"))
    write_tiny_bert(staging / "tiny-bert", corpus, seed)
    write_tiny_vit(staging / "tiny-vit", seed)
    write_tiny_deit(staging / "tiny-deit", seed)
    write_tiny_swin(staging / "tiny-swin", seed)
    write_tiny_electra(staging / "tiny-electra", corpus, seed)
    write_tiny_deberta_v3(staging / "tiny-deberta-v3", corpus, seed)
    write_text_corpus(staging / "text-corpus")
    chats = decoder_fixtures.decoder_corpus(seed)
    for name, model_type in (
        ("tiny-qwen3", "qwen3"),
        ("tiny-llama3", "llama"),
        ("tiny-gemma3", "gemma3_text"),
    ):
        decoder_fixtures.write_tiny_decoder(staging / name, model_type, chats, seed)
    decoder_fixtures.write_instructions(staging / "instructions", seed)
    if references:
        write_engine_references(staging / "engines", corpus, seed)
        write_mlm_references(staging / "engines", corpus, seed)


def build_fixtures(
    directory: str | os.PathLike,
    seed: int = 0,
    verbose: bool = True,
    references: bool | None = None,
    full_splits: bool = False,
) -> dict:
    """Write every fixture under ``directory`` (skipped when already built with ``seed``).

    The notebooks' fixtures need no TensorFlow (a CPU runtime of Colab or Kaggle builds them);
    ``references`` (default: where transformers' TF classes are) adds ``engines``, the TF
    engine's numbers the Keras 3 engine's tests compare with. A build with them serves a
    call without. The training splits named in ``CPU_TRAIN_ROWS`` have that many rows, or
    the data sets' own sizes with ``full_splits`` (the benchmarks'). Returns a mapping from
    fixture name to its absolute path, the values the CPU parameter files pass to the
    notebooks (``model_checkpoint``, ``dataset_name`` ...).
    """
    root = Path(directory).resolve()
    present = tf_classes_present()
    if references and not present:
        raise InputError(
            "references=True: the engines' reference numbers need transformers' TF classes,"
            " which this environment lacks. Fix: build them in the CPU stack (STACK=cpu bash -c"
            " 'source tools/env.sh && python -m tpu_helpers fixtures build/fixtures')."
        )
    references = present if references is None else references
    names = NOTEBOOK_FIXTURES + (("engines",) if references else ())
    paths = {name: str(root / name) for name in names}
    stamp = root / "fixtures.json"
    made = {"version": FIXTURES_VERSION, "seed": seed, "full_splits": full_splits}
    if _up_to_date(stamp, made, paths):
        if verbose:
            say(f"fixtures: up to date in {root}")
        return paths
    root.mkdir(parents=True, exist_ok=True)
    with _one_builder(root):  # another process building here is waited for
        if not _up_to_date(stamp, made, paths):  # nor did it build these meanwhile
            _build(root, names, seed, full_splits, references)
            stamp.write_text(json.dumps({**made, "paths": paths}, indent=1))
    if verbose:
        say(f"fixtures: built in {root}")
    return paths


def _up_to_date(stamp: Path, made: dict, paths: dict) -> bool:
    """Whether ``stamp`` says a build of ``made`` wrote at least ``paths``."""
    built = json.loads(stamp.read_text()) if stamp.exists() else {}
    same = all(built.get(key) == value for key, value in made.items())
    return same and paths.items() <= built.get("paths", {}).items()


@contextlib.contextmanager
def _one_builder(root: Path):
    """Hold ``root``'s lock: one process (or thread) builds there at a time."""
    import fcntl

    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(root: Path, names: tuple, seed: int, full_splits: bool, references: bool) -> None:
    """Every fixture of ``names`` into ``root``, staged first; the stamp is the caller's."""
    (root / "fixtures.json").unlink(missing_ok=True)  # a build stopped part way is no build
    staging = root / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    _write_staged(staging, seed, {} if full_splits else CPU_TRAIN_ROWS, references)
    for name in (*NOTEBOOK_FIXTURES, "engines"):
        shutil.rmtree(root / name, ignore_errors=True)
    # Beans paths are absolute, so write them in place after staging the rest.
    write_beans(root / "beans", seed)
    for name in names:
        if name != "beans":
            (staging / name).rename(root / name)
    staging.rmdir()
