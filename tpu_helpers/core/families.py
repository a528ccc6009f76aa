"""The model families the package knows, in one table: which engine trains each, the
head the Keras 3 engine builds for it, where its positions start, and how the TF engine
packs several examples into one row of it. Nothing here imports TensorFlow, Keras or JAX.

=================  ================================================================
``FAMILIES``       model type -> ``Family`` (every family named anywhere in the package)
``KERAS3``         the families the Keras 3 engine trains (``Family.keras3``)
``MLM``            those whose masked-LM head it builds too (``Family.mlm``)
``DISCRIMINATORS`` those pretrained by replaced-token detection: no masked-LM head
``KERAS3_PACKED``  those it fine-tunes packed too: its text families (KerasHub's encoder
                   layers take a mask per query and key, its position embeddings, where
                   the family has them, the positions to read)
``PACKED``         the families packed fine-tuning covers on the TF engine
``OFFSET_POSITIONS`` families whose position ids start after the padding id
=================  ================================================================

>>> FAMILIES["roberta"].offset_positions, "roberta" in KERAS3, "mpnet" in KERAS3
(True, True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_helpers.core.errors import InputTypeError

__all__ = [
    "KERAS3_OTHER_FAMILY_FIX",
    "position_limit",
    "Family",
    "Head",
    "MlmHead",
    "PackedKind",
    "FAMILIES",
    "KERAS3",
    "MLM",
    "DISCRIMINATORS",
    "KERAS3_PACKED",
    "PACKED",
    "OFFSET_POSITIONS",
]


@dataclass(frozen=True)
class Head:
    """How a family's ``*ForSequenceClassification`` (or ``*ForImageClassification``)
    classifies, as a recipe over KerasHub's backbone of that family.

    Attributes:
        take: ``"pooled"`` (the backbone's pooled output, its pooler included),
            ``"first"`` (the first token of its last hidden states), ``"mean"`` (the mean
            of its last hidden states over the tokens: Swin) or ``"first_two"`` (a dense
            ``steps`` each on the first two tokens, their logits averaged: a distilled
            DeiT's class and distillation tokens).
        steps: in order, ``("dropout", config fields)`` (the first field the config sets
            gives the rate) or ``("dense", checkpoint name, activation)`` (a Keras name, or
            ``(config field, default)``); the last dense is the classifier itself.
        inputs: our pipelines' feature names -> the backbone's input names.
        optional: checkpoint names a base checkpoint may lack (a masked-LM save has no
            pooler): left as initialised, and said so.
        backbone: backbone arguments -> the config field that sets them, where KerasHub's
            converter leaves the backbone's default (BERT's dropout is 0.1 and ViT's layer
            norm epsilon 1e-6, whatever the config says).
        fold_token_type: add the token-type embedding of type 0 to the position embeddings,
            as transformers adds it to every token (KerasHub's RoBERTa converter drops it;
            its XLM-RoBERTa one folds it so).
        architecture: the transformers class whose checkpoint this head makes
            (``save_hub_layout`` writes it into ``config.json``).
        folded: the position embeddings hold the token-type row 0 (ours or the
            converter's fold): taken out again when saving in the hub's layout.
        prefix: the model prefix of the encoder's names in ``architecture``'s checkpoints
            (transformers' ``base_model_prefix``): a base model saved alone lacks it.
        alternative: another head of the family, taken where the file holds its dense
            layers (a distilled DeiT's two heads); a head of other labels with
            ``ignore_mismatched_sizes`` falls back to this one.
        derived: names of tensors transformers saves that no training changes (Swin's
            ``relative_position_index``, computed from the window size): not read, and
            copied as they were when saving in the hub's layout.
        relative_positions: the encoder has no position embedding, only relative
            positions (DeBERTa-v3): packing has none to restart.
        refused: ``(config field, value, what it means)`` of the checkpoints KerasHub's
            backbone would compute otherwise (Swin with absolute position embeddings).
    """

    take: str
    steps: tuple
    inputs: dict
    optional: tuple = ()
    backbone: tuple = ()
    fold_token_type: bool = False
    architecture: str = ""
    folded: bool = False
    prefix: str = ""
    alternative: Head | None = None
    derived: tuple = ()
    relative_positions: bool = False
    refused: tuple = ()


@dataclass(frozen=True)
class MlmHead:
    """How a family's ``*ForMaskedLM`` predicts the hidden tokens, over KerasHub's backbone:
    a dense layer of the hidden size (``dense``, its activation the first config field of
    ``activation`` that is set, else ``default_activation``), a layer norm (``norm``, its
    epsilon from ``epsilon`` or ``default_epsilon``), then the token embeddings transposed
    (tied, as every family here ties them) plus a bias per token (``bias``). The names are
    the checkpoint's; ``architecture`` the transformers class."""

    dense: str
    norm: str
    bias: str
    architecture: str
    activation: tuple = ()
    default_activation: str = "gelu"
    epsilon: tuple = ("layer_norm_eps",)
    default_epsilon: float = 1e-12


_ROBERTA_MLM = MlmHead("lm_head.dense", "lm_head.layer_norm", "lm_head.bias", "RobertaForMaskedLM")
_MLM = {
    "bert": MlmHead(
        "cls.predictions.transform.dense",
        "cls.predictions.transform.LayerNorm",
        "cls.predictions.bias",
        "BertForMaskedLM",
        ("hidden_act",),
    ),
    "distilbert": MlmHead(
        "vocab_transform",
        "vocab_layer_norm",
        "vocab_projector.bias",
        "DistilBertForMaskedLM",
        ("activation",),
        epsilon=(),
    ),
    "roberta": _ROBERTA_MLM,
    "xlm-roberta": _ROBERTA_MLM,
}


@dataclass(frozen=True)
class PackedKind:
    """How ``tf_engine.packed_classes.PackedClassifier`` drives one family's TF classifier: the attribute of
    its main layer, its embeddings call, its encoder call and its head (each choice names a
    ``PackedClassifier`` method).

    * ``embed``: ``"types"`` (ids, positions, token types), ``"no_types"`` (MPNet),
      ``"masked"`` (DeBERTa-v2 zeroes padding embeddings), ``"distilbert"`` (its blocks
      are run there, with the block mask its attention does not take);
    * ``encoder``: ``"full"`` (BERT's signature), ``"short"`` (hidden states, mask, head
      mask), ``"pairwise"`` (a 0/1 mask per query and key: DeBERTa-v2);
    * ``head``: ``"bert_pooler"``, ``"albert_pooler"``, ``"deberta_pooler"``,
      ``"pre_classifier"`` (DistilBERT), ``"first_token"`` (the classifier reads the
      first token itself: RoBERTa-shaped, ELECTRA, MPNet).
    """

    main: str
    embed: str = "types"
    encoder: str = "full"
    head: str = "first_token"


@dataclass(frozen=True)
class Family:
    """One model family (a ``model_type``): ``offset_positions`` (position ids start after
    the padding id, RoBERTa's scheme), ``packed`` (how the TF engine packs it, or
    ``None``), ``keras3`` (the Keras 3 engine's head, or ``None``: the TF engine only),
    ``mlm`` (the Keras 3 engine's masked-LM head, or ``None``)."""

    offset_positions: bool = False
    packed: PackedKind | None = None
    keras3: Head | None = None
    mlm: MlmHead | None = None


_TEXT = {"input_ids": "token_ids", "attention_mask": "padding_mask"}
_PAIRS = {**_TEXT, "token_type_ids": "segment_ids"}
_IMAGES = {"pixel_values": "images"}


def _dense_then_out_proj(activation: str) -> tuple:
    """RoBERTa's and ELECTRA's classification head, which differ by its activation: dropout,
    ``classifier.dense``, dropout, ``classifier.out_proj`` on the first token."""
    dropout = ("dropout", ("classifier_dropout", "hidden_dropout_prob"))
    dense = ("dense", "classifier.dense", activation)
    return (dropout, dense, dropout, ("dense", "classifier.out_proj", None))


_ROBERTA_STEPS = _dense_then_out_proj("tanh")
_HEADS = {
    "bert": Head(
        "pooled",
        (("dropout", ("classifier_dropout", "hidden_dropout_prob")), ("dense", "classifier", None)),
        _PAIRS,
        ("pooler.",),
        (("dropout", "hidden_dropout_prob"),),
        architecture="BertForSequenceClassification",
        prefix="bert",
    ),
    "albert": Head(
        "pooled",
        (("dropout", ("classifier_dropout_prob",)), ("dense", "classifier", None)),
        _PAIRS,
        ("pooler.",),
        architecture="AlbertForSequenceClassification",
        prefix="albert",
    ),
    "distilbert": Head(
        "first",
        (
            ("dense", "pre_classifier", "relu"),
            ("dropout", ("seq_classif_dropout",)),
            ("dense", "classifier", None),
        ),
        _TEXT,
        architecture="DistilBertForSequenceClassification",
        prefix="distilbert",
    ),
    "roberta": Head(
        "first",
        _ROBERTA_STEPS,
        _TEXT,
        fold_token_type=True,
        architecture="RobertaForSequenceClassification",
        prefix="roberta",
        folded=True,
    ),
    "xlm-roberta": Head(
        "first",
        _ROBERTA_STEPS,
        _TEXT,
        (),
        (("dropout", "hidden_dropout_prob"),),
        architecture="XLMRobertaForSequenceClassification",
        prefix="roberta",
        folded=True,
    ),
    "electra": Head(
        "first",
        _dense_then_out_proj("gelu"),  # transformers' exact GELU
        _PAIRS,
        architecture="ElectraForSequenceClassification",
        prefix="electra",
    ),
    # DeBERTa-v3 (model type deberta-v2): transformers' ContextPooler on the first token,
    # then the classifier; no token types (type_vocab_size 0)
    "deberta-v2": Head(
        "first",
        (
            ("dropout", ("pooler_dropout",)),
            ("dense", "pooler.dense", ("pooler_hidden_act", "gelu")),
            ("dropout", ("cls_dropout", "hidden_dropout_prob")),
            ("dense", "classifier", None),
        ),
        _TEXT,
        architecture="DebertaV2ForSequenceClassification",
        prefix="deberta",
        relative_positions=True,
    ),
    "vit": Head(
        "first",
        (("dense", "classifier", None),),
        _IMAGES,
        backbone=(("layer_norm_epsilon", "layer_norm_eps"),),
        architecture="ViTForImageClassification",
        prefix="vit",
    ),
    # DeiTForImageClassification reads the class token alone; the distilled checkpoints
    # (DeiTForImageClassificationWithTeacher) average a head on it and one on the
    # distillation token
    "deit": Head(
        "first",
        (("dense", "classifier", None),),
        _IMAGES,
        architecture="DeiTForImageClassification",
        prefix="deit",
        alternative=Head(
            "first_two",
            (("dense", "cls_classifier", None), ("dense", "distillation_classifier", None)),
            _IMAGES,
            architecture="DeiTForImageClassificationWithTeacher",
            prefix="deit",
        ),
    ),
    "swin": Head(
        "mean",
        (("dense", "classifier", None),),
        _IMAGES,
        architecture="SwinForImageClassification",
        prefix="swin",
        derived=("relative_position_index",),
        refused=(("use_absolute_embeddings", True, "absolute position embeddings"),),
    ),
}


_ROBERTA_PACKED = PackedKind("roberta")

#: Every family, in one place; the Keras 3 engine's first, in the order its tests list them.
FAMILIES = {
    "albert": Family(
        packed=PackedKind("albert", encoder="short", head="albert_pooler"), keras3=_HEADS["albert"]
    ),
    "bert": Family(
        packed=PackedKind("bert", head="bert_pooler"), keras3=_HEADS["bert"], mlm=_MLM["bert"]
    ),
    "distilbert": Family(
        packed=PackedKind("distilbert", embed="distilbert", head="pre_classifier"),
        keras3=_HEADS["distilbert"],
        mlm=_MLM["distilbert"],
    ),
    "roberta": Family(True, _ROBERTA_PACKED, _HEADS["roberta"], _MLM["roberta"]),
    "xlm-roberta": Family(True, _ROBERTA_PACKED, _HEADS["xlm-roberta"], _MLM["xlm-roberta"]),
    "electra": Family(packed=PackedKind("electra"), keras3=_HEADS["electra"]),
    "deberta-v2": Family(
        packed=PackedKind("deberta", embed="masked", encoder="pairwise", head="deberta_pooler"),
        keras3=_HEADS["deberta-v2"],
    ),
    "vit": Family(keras3=_HEADS["vit"]),
    "deit": Family(keras3=_HEADS["deit"]),
    "swin": Family(keras3=_HEADS["swin"]),
    "camembert": Family(True, _ROBERTA_PACKED),
    "mpnet": Family(True, PackedKind("mpnet", embed="no_types", encoder="short")),
    "data2vec-text": Family(offset_positions=True),
    "esm": Family(offset_positions=True),
    "longformer": Family(offset_positions=True),
    "roberta-prelayernorm": Family(offset_positions=True),
    "xlm-roberta-xl": Family(offset_positions=True),
}
KERAS3 = tuple(name for name, f in FAMILIES.items() if f.keras3 is not None)
#: What to do with a checkpoint of a family the Keras 3 engine does not train, on the runtimes
#: it runs on (Colab's and Kaggle's TPU images, where the TF engine cannot run).
KERAS3_OTHER_FAMILY_FIX = (
    "a checkpoint of one of those families (distilbert-base-cased, bert-base-cased,"
    " roberta-base, xlm-roberta-base, albert-base-v2, google/electra-base-discriminator,"
    " microsoft/deberta-v3-base;"
    " google/vit-base-patch16-224,"
    " facebook/deit-base-distilled-patch16-224 or microsoft/swin-tiny-patch4-window7-224"
    " for images), or add its family to the table in tpu_helpers/core/families.py (CONTRIBUTING.md"
    " says how). The TF engine (notebooks/tf/) trains more families where tensorflow-tpu"
    " runs: a TPU VM, not Colab's or Kaggle's TPU runtime."
)
MLM = tuple(name for name, f in FAMILIES.items() if f.mlm is not None)
#: Families pretrained by replaced-token detection, whose published checkpoints are mostly the
#: discriminator: no masked-LM head to continue (ELECTRA's recipe; DeBERTa-v3 took it over).
DISCRIMINATORS = ("electra", "deberta-v2")
KERAS3_PACKED = tuple(name for name in KERAS3 if "input_ids" in FAMILIES[name].keras3.inputs)
PACKED = tuple(sorted(name for name, f in FAMILIES.items() if f.packed is not None))
OFFSET_POSITIONS = frozenset(name for name, f in FAMILIES.items() if f.offset_positions)


def position_limit(model_config) -> int | None:
    """How many token positions a model can embed: ``max_position_embeddings`` (or
    ``n_positions``), less RoBERTa-style offsets; ``None`` for models without absolute
    positions (DeBERTa-v2 with ``position_biased_input=False``, Funnel and other configs
    that name no limit).

    Needs a model config (``AutoConfig.from_pretrained(checkpoint)`` or ``model.config``):
    anything else, a tokenizer for instance, raises ``TypeError`` instead of passing.

    >>> from types import SimpleNamespace as Config
    >>> position_limit(Config(model_type="roberta", max_position_embeddings=514, pad_token_id=1))
    512
    """
    if not hasattr(model_config, "model_type"):
        raise InputTypeError(
            f"position_limit needs a model config, got {type(model_config).__name__}. Fix:"
            " pass AutoConfig.from_pretrained(checkpoint) or model.config (a tokenizer's"
            " model_max_length is a default for truncation, not the model's limit)."
        )
    if getattr(model_config, "position_biased_input", True) is False:
        return None  # relative positions only
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        limit = getattr(model_config, name, None)
        if isinstance(limit, int) and limit > 0:
            if model_config.model_type in OFFSET_POSITIONS:
                limit -= (getattr(model_config, "pad_token_id", None) or 0) + 1
            return limit
    return None
