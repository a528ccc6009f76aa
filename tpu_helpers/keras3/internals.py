"""The private parts of Keras and KerasHub the Keras 3 engine needs, in one place.

Each is used because no public API does the same, and each was written against the
releases in ``versions.WRITTEN_FOR``; ``tests/test_keras3.py`` checks every one on the
Keras 3 stack, so that a release that moves or changes one fails there, naming it.

=========================  ==============================================================
``hub_converter``          KerasHub's converter of a family from the hub's layout (its
                           ``convert_weights(backbone, loader, config)`` calls the loader's
                           ``port_weight`` and ``get_tensor``): ``keras_hub.src.utils.
                           transformers.preset_loader.TransformersPresetLoader``
``encoder_layer_classes``  KerasHub's encoder layers, DeBERTa-v3's among them:
                           ``keras_hub.src.models.deberta_v3.disentangled_attention_encoder``
``sublayers``              every layer inside a layer, recursively: ``Layer._flatten_layers``
``build_for_training``     a compiled model's metrics, loss and optimizer built for a batch,
                           as ``fit`` does first: ``Trainer._symbolic_build``
``compiled_with``          what a ``compile`` call set (each call makes new loss and
                           metrics containers): ``Trainer._compile_loss``/``_compile_metrics``
=========================  ==============================================================
"""

from __future__ import annotations

__all__ = [
    "hub_converter",
    "encoder_layer_classes",
    "sublayers",
    "build_for_training",
    "compiled_with",
]


def hub_converter(model_type: str):
    """KerasHub's converter module of the family ``model_type`` (``convert_weights``)."""
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader

    return TransformersPresetLoader("", {"model_type": model_type}).converter


def encoder_layer_classes() -> tuple:
    """KerasHub's encoder layers that take a mask per query and key (``attention_mask``):
    ``keras_hub.layers.TransformerEncoder``, and DeBERTa-v3's
    ``DisentangledAttentionEncoder``, which KerasHub does not export."""
    import keras_hub
    from keras_hub.src.models.deberta_v3.disentangled_attention_encoder import (
        DisentangledAttentionEncoder,
    )

    return (keras_hub.layers.TransformerEncoder, DisentangledAttentionEncoder)


def sublayers(layer) -> list:
    """Every layer inside ``layer``, recursively (``layer`` itself excluded)."""
    return list(layer._flatten_layers(include_self=False, recursive=True))


def build_for_training(model, batch) -> None:
    """Build a compiled Keras 3 model's metrics, loss and optimizer for batches like
    ``batch`` (``(features, labels, weights)``), as ``fit`` does before its first step."""
    model._symbolic_build(data_batch=tuple(batch))


def compiled_with(model) -> tuple:
    """What the model's last ``compile`` set, to tell one ``compile`` from the next (each
    call makes new loss and metrics containers): ``(optimizer, loss container, metrics
    container)``, to compare element by element with ``is``."""
    return (
        getattr(model, "optimizer", None),
        getattr(model, "_compile_loss", None),
        getattr(model, "_compile_metrics", None),
    )
