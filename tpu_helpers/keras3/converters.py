"""Converters of ours, for families KerasHub builds but does not read from the hub's files.

KerasHub 0.32 has a backbone class for ELECTRA (``ElectraBackbone``) and no converter for
its checkpoints in the hub's layout: ``Backbone.from_preset("hf://google/electra-...")``
refuses the model type. ``CONVERTERS`` gives, per such family, how to build the backbone
from ``config.json`` and how to read its weights, through the same loader as KerasHub's
converters (``port_weight`` / ``get_tensor``, so that ``save_hub_layout`` writes them back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
        embedding_dim=config.get("embedding_size") or hidden,
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
    if (config.get("embedding_size") or config["hidden_size"]) != config["hidden_size"]:
        projection = backbone.get_layer("embeddings_projection")
        loader.port_weight(projection.kernel, "embeddings_project.weight", hook_fn=lambda x, _: x.T)
        loader.port_weight(projection.bias, "embeddings_project.bias")


#: model type -> how this package builds and reads it
CONVERTERS = {"electra": Converter(_electra_backbone, _convert_electra)}
