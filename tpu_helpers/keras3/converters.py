"""Converters of ours, for families KerasHub builds but does not read from the hub's files.

KerasHub 0.32 has backbone classes for ELECTRA (``ElectraBackbone``) and DeBERTa-v3
(``DebertaV3Backbone``) and no converter for their checkpoints in the hub's layout:
``Backbone.from_preset("hf://google/electra-...")`` refuses the model type. ``CONVERTERS`` gives, per such family, how to build the backbone
from ``config.json`` and how to read its weights, through the same loader as KerasHub's
converters (``port_weight`` / ``get_tensor``, so that ``save_hub_layout`` writes them back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tpu_helpers.core.errors import EngineError

__all__ = [
    "Converter",
    "CONVERTERS",
]


@dataclass(frozen=True)
class Converter:
    """``build(keras_hub, config)``: the family's backbone, untrained;
    ``convert(backbone, loader, config)``: its weights read from the loader."""

    build: Callable
    convert: Callable


def _electra_backbone(keras_hub, config: dict):
    hidden = config["hidden_size"]
    return keras_hub.models.ElectraBackbone(
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        hidden_dim=hidden,
        embedding_dim=config.get("embedding_size", 128),  # transformers' default
        intermediate_dim=config["intermediate_size"],
        dropout=config.get("hidden_dropout_prob", 0.1),
        max_sequence_length=config["max_position_embeddings"],
        num_segments=config.get("type_vocab_size", 2),
    )


class _WithoutPooler:
    """A loader that skips the pooler: ELECTRA's classifier reads the first token itself,
    and its checkpoints have none (KerasHub's ``ElectraBackbone`` has one: left unused)."""

    def __init__(self, loader):
        self.loader = loader

    def get_tensor(self, name):
        return self.loader.get_tensor(name)

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
        if not hf_weight_key.startswith("pooler."):
            self.loader.port_weight(keras_variable, hf_weight_key, hook_fn)


def _convert_electra(backbone, loader, config: dict) -> None:
    """ELECTRA's encoder is BERT's, and ``ElectraBackbone`` names its layers as
    ``BertBackbone`` does: KerasHub's BERT converter reads them. Ours adds the projection
    from the embedding size to the hidden size (``embeddings_project``), where they
    differ (ELECTRA-small: 128 and 256)."""
    from tpu_helpers.keras3.internals import hub_converter

    hub_converter("bert").convert_weights(backbone, _WithoutPooler(loader), config)
    if config.get("embedding_size", 128) != config["hidden_size"]:
        projection = backbone.get_layer("embeddings_projection")
        loader.port_weight(projection.kernel, "embeddings_project.weight", hook_fn=lambda x, _: x.T)
        loader.port_weight(projection.bias, "embeddings_project.bias")


#: What KerasHub's DebertaV3Backbone computes, as config.json says it: DeBERTa-v3's variant
#: of DeBERTa-v2's model type (relative positions only, in log buckets; the query and key
#: projections shared with the positions; no token types; a layer norm on the position
#: embeddings). field -> (the value it must have, what another value would mean)
_DEBERTA_V3 = {
    "relative_attention": (True, "relative attention off"),
    "position_biased_input": (False, "absolute position embeddings"),
    "type_vocab_size": (0, "token-type embeddings"),
    "share_att_key": (True, "position projections of their own"),
    "norm_rel_ebd": ("layer_norm", "position embeddings without their layer norm"),
    "conv_kernel_size": (0, "a convolution layer (DeBERTa-v2 xlarge and xxlarge)"),
}


def _deberta_v3_config(config: dict) -> None:
    """Refuse a ``deberta-v2`` config that KerasHub's ``DebertaV3Backbone`` would compute
    otherwise than transformers, naming each difference."""
    defaults = {"relative_attention": False, "position_biased_input": True}
    # transformers' defaults where config.json leaves a field out (a DeBERTa-v3 names each)
    defaults |= {"type_vocab_size": 0, "share_att_key": False, "norm_rel_ebd": "none"}
    differ = [
        meaning
        for field, (want, meaning) in _DEBERTA_V3.items()
        if config.get(field, defaults.get(field, want)) != want
    ]
    kinds = config.get("pos_att_type") or []
    if isinstance(kinds, str):  # "p2c|c2p", as older configs write it
        kinds = [kind.strip() for kind in kinds.lower().split("|")]
    if sorted(kinds) != ["c2p", "p2c"]:
        differ.append(f"attention types {config.get('pos_att_type')} (DeBERTa-v3: p2c and c2p)")
    if config.get("position_buckets", -1) <= 0:
        differ.append("relative positions without log buckets (position_buckets)")
    if config.get("embedding_size", config["hidden_size"]) != config["hidden_size"]:
        differ.append("an embedding projection (embedding_size differs from hidden_size)")
    if differ:
        raise EngineError(
            f"this deberta-v2 checkpoint has {', '.join(differ)}: the Keras 3 engine reads"
            " DeBERTa-v3 checkpoints only, the variant KerasHub's DebertaV3Backbone computes."
            " Fix: a DeBERTa-v3 checkpoint (microsoft/deberta-v3-base, -small, -large,"
            " mdeberta-v3-base), or this one on the TF engine (notebooks/tf/) on a TPU VM."
        )


def _deberta_backbone(keras_hub, config: dict):
    _deberta_v3_config(config)
    longest = config.get("max_relative_positions", -1)
    return keras_hub.models.DebertaV3Backbone(
        vocabulary_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        hidden_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        dropout=config.get("hidden_dropout_prob", 0.1),
        # the log buckets' scale: transformers' max_relative_positions, else the positions
        max_sequence_length=longest if longest > 0 else config["max_position_embeddings"],
        bucket_size=config["position_buckets"],
    )


def _convert_deberta(backbone, loader, config: dict) -> None:
    """DeBERTa-v3's weights onto ``DebertaV3Backbone``: PyTorch's ``[out, in]`` kernels
    transposed, the query, key and value ones split by head."""

    def norm(layer, name):
        loader.port_weight(layer.gamma, f"{name}.weight")
        loader.port_weight(layer.beta, f"{name}.bias")

    def dense(layer, name, by_head=False):
        def kernel(x, shape):
            return x.T.reshape(shape)

        def bias(x, shape):
            return x.reshape(shape)

        loader.port_weight(layer.kernel, f"{name}.weight", kernel if by_head else lambda x, _: x.T)
        loader.port_weight(layer.bias, f"{name}.bias", bias if by_head else None)

    loader.port_weight(
        backbone.get_layer("token_embedding").embeddings, "embeddings.word_embeddings.weight"
    )
    norm(backbone.get_layer("embeddings_layer_norm"), "embeddings.LayerNorm")
    relative = backbone.get_layer("rel_embedding")
    loader.port_weight(relative.rel_embeddings, "encoder.rel_embeddings.weight")
    norm(relative.layer_norm, "encoder.LayerNorm")
    for i in range(config["num_hidden_layers"]):
        layer = backbone.get_layer(f"disentangled_attention_encoder_layer_{i}")
        attention, name = layer._self_attention_layer, f"encoder.layer.{i}"
        for ours, theirs in (("_query_dense", "query"), ("_key_dense", "key")):
            dense(getattr(attention, ours), f"{name}.attention.self.{theirs}_proj", by_head=True)
        dense(attention._value_dense, f"{name}.attention.self.value_proj", by_head=True)
        dense(attention._output_dense, f"{name}.attention.output.dense")
        norm(layer._self_attention_layer_norm, f"{name}.attention.output.LayerNorm")
        dense(layer._feedforward_intermediate_dense, f"{name}.intermediate.dense")
        dense(layer._feedforward_output_dense, f"{name}.output.dense")
        norm(layer._feedforward_layer_norm, f"{name}.output.LayerNorm")


#: model type -> how this package builds and reads it
CONVERTERS = {
    "electra": Converter(_electra_backbone, _convert_electra),
    "deberta-v2": Converter(_deberta_backbone, _convert_deberta),
}
