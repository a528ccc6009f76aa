"""A Keras 3 classifier run on packed rows (``data.packing.packed_batches``): the
block-diagonal attention, restarted positions and a head at each example's first token.
"""

from __future__ import annotations

import warnings

from tpu_helpers.core.errors import (
    EngineError,
)
from tpu_helpers.core.families import Head
from tpu_helpers.core.versions import KERAS_HUB_PIN
from tpu_helpers.keras3.distribution import _keras
from tpu_helpers.keras3.models import HubSource, _model_class

__all__ = [
    "packed_classifier",
    "packed_attention",
    "packed_positions",
]


def packed_classifier(model):
    """A ``keras.Model`` that runs ``model`` (a text ``classifier``) on packed rows
    (``packing.packed_batches``): features ``input_ids``, ``segment_ids`` (1, 2, ... per
    example, 0 on padding) and ``starts`` ``[rows, slots]`` (``token_type_ids`` for
    sentence pairs), logits ``[rows, slots, labels]``, one per example at its first token
    (an empty slot's are the row's first example's: give it weight 0).

    The same layers and weights as ``model``, called otherwise: each of KerasHub's encoder
    layers with a mask per query and key (``packed_attention``: a token sees its own
    example only), each position embedding with the positions of each token inside its
    example (``packed_positions``, restarting at 0; DeBERTa-v3 has relative positions
    only, the same in a packed row), the pooler or the first-token head at
    every example's first token. Training it trains ``model``, which evaluates, predicts
    and saves (``save_hub_layout``) unpacked as usual. Compile it with
    ``compile_classifier``: the loss is averaged over the weighted slots."""
    keras = _keras()
    from tpu_helpers.core.families import KERAS3_PACKED

    source = getattr(model, "hub_source", None)
    family = source.config["model_type"] if isinstance(source, HubSource) else None
    if family not in KERAS3_PACKED or source.mlm is not None:
        raise EngineError(
            f"packed_classifier takes a keras3.classifier of {', '.join(KERAS3_PACKED)}, not"
            f" {type(model).__name__} ({family or 'not made by keras3.classifier'}). Fix:"
            " model = keras3.classifier(checkpoint, num_labels), then packed_classifier(model);"
            " other families train unpacked (text.text_batches)."
        )
    names = ["input_ids", "segment_ids", "starts"]
    names += ["token_type_ids"] if "token_type_ids" in source.head.inputs else []
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in names}
    import keras_hub

    layers = model.network.layers
    backbone = next(layer for layer in layers if isinstance(layer, keras_hub.models.Backbone))
    hidden = _packed_encoder(keras, backbone, inputs, source.head)
    x = keras.ops.take_along_axis(hidden, keras.ops.expand_dims(inputs["starts"], -1), axis=1)
    if source.head.take == "pooled":
        x = backbone.pooled_dense(x)
    for layer in source.head_calls:  # the head's own layers, in order
        x = layer(x)
    packed = _model_class(keras)(keras.Model(inputs, x, name=f"{family}_packed_classifier"))
    packed.hub_source = source
    return packed


def packed_attention(segment_ids):
    """``[rows, T, T]`` booleans, in ``keras.ops``: query token ``i`` may attend to key
    token ``j`` (both of one example; ``j`` not padding, segment 0)."""
    ops = _keras().ops
    same = ops.equal(ops.expand_dims(segment_ids, 2), ops.expand_dims(segment_ids, 1))
    return ops.logical_and(same, ops.expand_dims(segment_ids > 0, 1))


def packed_positions(segment_ids):
    """``[rows, T]`` int32, in ``keras.ops``: each token's position inside its own example
    (0 at its first token; 0 on padding): the tokens of its example before it."""
    ops = _keras().ops
    index = ops.cumsum(ops.ones_like(segment_ids), axis=1)
    before = ops.expand_dims(index, 1) < ops.expand_dims(index, 2)  # [rows, query, key]
    seen = ops.logical_and(packed_attention(segment_ids), before)
    return ops.where(segment_ids > 0, ops.sum(ops.cast(seen, "int32"), axis=-1), 0)


def _packed_encoder(keras, backbone, inputs: dict, head: Head):
    """The backbone's sequence output on packed ``inputs``: its own graph of layers run
    again (``keras.models.clone_model`` sharing every layer), the positions and the mask
    given to the layers that take them, and the segment ids where the padding mask was."""
    import keras_hub

    from tpu_helpers.keras3.internals import encoder_layer_classes

    ours = {**inputs, "attention_mask": inputs["segment_ids"]}
    segments = inputs["segment_ids"]
    allowed, positions = packed_attention(segments), packed_positions(segments)
    embeddings = (keras_hub.layers.PositionEmbedding, keras_hub.layers.TokenAndPositionEmbedding)
    seen = {"positions": 0, "attention": 0}

    def call(layer, *args, **kwargs):
        if isinstance(layer, embeddings):
            kwargs["positions"], seen["positions"] = positions, seen["positions"] + 1
        elif isinstance(layer, encoder_layer_classes()):
            kwargs.update(padding_mask=None, attention_mask=allowed)
            seen["attention"] += 1
        elif "padding_mask" in kwargs:
            raise EngineError(_KERASHUB_CHANGED.format(f"{type(layer).__name__} takes the mask"))
        return layer(*args, **kwargs)

    with warnings.catch_warnings():  # our inputs' names are not the backbone's: meant so
        warnings.filterwarnings("ignore", "When providing `inputs` as a dict")
        clone = keras.models.clone_model(
            backbone,
            input_tensors={theirs: ours[name] for name, theirs in head.inputs.items()},
            clone_function=lambda layer: layer,  # the same layers: the same weights
            call_function=call,
        )
    calls = backbone.num_layers * getattr(backbone, "num_inner_repetitions", 1)  # ALBERT's
    # DeBERTa-v3's positions are relative only (the query-key offsets, the same in a packed
    # example as alone): no position embedding to restart
    positions_wanted = 0 if head.relative_positions else 1
    if seen["positions"] != positions_wanted or seen["attention"] != calls:
        raise EngineError(_KERASHUB_CHANGED.format(f"{seen} in {type(backbone).__name__}"))
    output = clone.output
    return output["sequence_output"] if isinstance(output, dict) else output


_KERASHUB_CHANGED = (
    "packing expects one position embedding (none for DeBERTa-v3) and one encoder call per"
    " layer in"
    " KerasHub's backbone, and found otherwise ({}): this KerasHub builds its encoders"
    f" differently. Fix: {KERAS_HUB_PIN} (tpu_helpers.install(engine='keras3')), or train"
    " unpacked."
)
