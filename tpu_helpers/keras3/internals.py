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
``take_full_masks``        a Gemma 3 decoder block taking a whole attention mask as its
                           padding mask: ``Gemma3DecoderBlock._compute_attention_mask``
=========================  ==============================================================
"""

from __future__ import annotations

__all__ = [
    "hub_converter",
    "encoder_layer_classes",
    "sublayers",
    "build_for_training",
    "compiled_with",
    "take_full_masks",
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


#: The arguments of KerasHub 0.32's ``Gemma3DecoderBlock._compute_attention_mask``.
_MASK_ARGUMENTS = ["x", "padding_mask", "vision_mask", "cache", "cache_update_index"]


def take_full_masks(block) -> None:
    """Make ``block`` (a KerasHub ``Gemma3DecoderBlock``) take a ``[rows, T, T]`` mask as its
    ``padding_mask``, and-combined with its causal mask; its own method makes every other
    mask (a padding mask of one row per token, generation's with a cache). Done once per
    block. A KerasHub whose block makes its mask otherwise is refused, naming the method."""
    import inspect

    import keras

    from tpu_helpers.core.errors import EngineError

    if hasattr(block, "_own_mask"):
        return
    own = getattr(block, "_compute_attention_mask", None)
    if own is None or list(inspect.signature(own).parameters) != _MASK_ARGUMENTS:
        raise EngineError(
            f"{type(block).__name__}._compute_attention_mask is not KerasHub 0.32's"
            f" ({', '.join(_MASK_ARGUMENTS)}): packed rows cannot be given to this KerasHub's"
            " Gemma 3. Fix: pip install keras-hub==0.32.0."
        )
    block._own_mask = own

    def compute(x, padding_mask, vision_mask, cache, cache_update_index):
        if cache is None and padding_mask is not None and len(padding_mask.shape) == 3:
            causal = own(x, None, vision_mask, cache, cache_update_index)
            return keras.ops.logical_and(causal, keras.ops.cast(padding_mask, "bool"))
        return own(x, padding_mask, vision_mask, cache, cache_update_index)

    block._compute_attention_mask = compute
