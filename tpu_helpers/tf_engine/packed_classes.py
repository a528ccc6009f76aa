"""Packed fine-tuning on the TF engine: transformers' TF classifiers on packed rows
(``tpu_helpers.data.packing`` makes the rows).

* ``PackedClassifier``: runs a Hugging Face TF sequence classifier's own layers on packed
  rows (embeddings with restarted positions, encoder with the block-diagonal mask, the
  classification head at each example's first token) and gives logits
  ``[rows, max_per_row, labels]``. The weights stay those of the wrapped model, which loads
  and saves with ``from_pretrained`` / ``save_pretrained`` and serves unpacked as usual.
  Covered (``families.PACKED``): BERT, RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA (their
  encoders take an additive mask of any shape that broadcasts to the scores), ALBERT and
  MPNet (the same, through their own encoder signatures; MPNet's relative position buckets
  depend only on the distance between two tokens, so they are the same inside a packed
  example as alone), DeBERTa-v2 (a 0/1 mask per query and key; its relative positions are
  distances too) and DistilBERT (its attention reshapes the mask itself, so its blocks are
  run here with its own weights). ``unsupported_reason`` says why a model is not covered
  (another family, or a DeBERTa-v2 whose convolution mixes neighbouring tokens).
* ``packed_loss``: the loss averaged over the weighted slots of a batch;
  ``packed_keras_model`` and ``packed_train_step``: the classifier as a Keras model for
  ``fit``, and its step for a custom loop.
"""

from __future__ import annotations

from tpu_helpers.core.errors import InputError
from tpu_helpers.core.families import FAMILIES as FAMILY_TABLE
from tpu_helpers.core.families import PACKED

__all__ = [
    "FAMILY",
    "unsupported_reason",
    "block_mask",
    "same_example",
    "PackedClassifier",
    "packed_loss",
    "packed_keras_model",
    "packed_train_step",
]


#: How each family it covers is packed (``families.FAMILIES``' ``packed``).
FAMILY = {name: FAMILY_TABLE[name].packed for name in PACKED}


def unsupported_reason(config) -> str | None:
    """Why packed fine-tuning cannot run a model with this config (``None``: it can).

    >>> from types import SimpleNamespace as Config
    >>> unsupported_reason(Config(model_type="gpt2")) is not None
    True
    """
    family = getattr(config, "model_type", None)
    if family not in PACKED:
        return (
            f"packed fine-tuning covers {', '.join(PACKED)} sequence classifiers, not"
            f" {family!r}. Fix: train it unpacked with the padding widths of"
            " text.padding_boundaries."
        )
    if family == "deberta-v2" and (getattr(config, "conv_kernel_size", 0) or 0) > 0:
        return (
            f"this DeBERTa-v2 checkpoint has a convolution layer (conv_kernel_size="
            f"{config.conv_kernel_size}) that mixes neighbouring tokens, which in a packed"
            " row belong to other examples. Fix: train it unpacked."
        )
    return None


def _family(model) -> str:
    reason = unsupported_reason(model.config)
    if reason is not None:
        raise InputError(f"{type(model).__name__}: {reason[0].upper()}{reason[1:]}")
    return model.config.model_type


def block_mask(segment_ids, dtype):
    """Additive attention mask ``[rows, 1, T, T]``: 0 where query and key are tokens of
    the same example, -10000 elsewhere (the constant the BERT family uses for padding)."""
    import tensorflow as tf

    allowed = same_example(segment_ids)
    return tf.where(allowed[:, None], tf.constant(0.0, dtype), tf.constant(-10000.0, dtype))


def same_example(segment_ids):
    """``[rows, T, T]`` booleans: query and key are tokens of one example."""
    import tensorflow as tf

    same = tf.equal(segment_ids[:, :, None], segment_ids[:, None, :])
    return tf.logical_and(same, segment_ids[:, None, :] > 0)


class PackedClassifier:
    """Logits per packed example from a TF ``*ForSequenceClassification`` model.

    ``PackedClassifier(model)(features, training=False)`` with ``features`` holding
    ``input_ids``, ``segment_ids``, ``position_ids`` ``[rows, T]`` (and, for sentence
    pairs, ``token_type_ids``) and ``starts`` ``[rows, max_per_row]`` returns logits
    ``[rows, max_per_row, num_labels]``; slots without an example hold the logits of the
    row's first token (give them weight 0). ``trainable_variables`` are the wrapped model's.

    A model whose weights are not built yet (made with ``from_config``) is built here by
    its own call first, so the packed path and the model's own call use the same weights
    (create the classifier inside ``strategy.scope()`` then, like the model).
    """

    def __init__(self, model):
        self.model = model
        self.family = _family(model)
        self.kind = FAMILY[self.family]
        if not model.built:
            model(model.dummy_inputs, training=False)
        self.main = getattr(model, self.kind.main)
        self.position_offset = 0
        if FAMILY_TABLE[self.family].offset_positions:
            self.position_offset = self.main.embeddings.padding_idx + 1

    @property
    def trainable_variables(self):
        return self.model.trainable_variables

    def hidden_states(self, features, training=False):
        import tensorflow as tf

        ids = tf.cast(features["input_ids"], tf.int32)
        segments = tf.cast(features["segment_ids"], tf.int32)
        positions = tf.cast(features["position_ids"], tf.int32) + self.position_offset
        if self.position_offset:  # padding keeps the padding position (RoBERTa's scheme)
            positions = tf.where(segments > 0, positions, self.position_offset - 1)
        types = tf.cast(features.get("token_type_ids", tf.zeros_like(ids)), tf.int32)
        embed = getattr(self, f"_embed_{self.kind.embed}")
        x = embed(ids, positions, types, segments, training)
        if self.kind.embed == "distilbert":
            return x
        if getattr(self.main, "embeddings_project", None) is not None:  # ELECTRA
            x = self.main.embeddings_project(x, training=training)
        return self._encoder(x, segments, training)[0]

    # --- embeddings, per Family.embed ---------------------------------------------------
    def _embed_types(self, ids, positions, types, segments, training):
        return self.main.embeddings(
            input_ids=ids, position_ids=positions, token_type_ids=types, training=training
        )

    def _embed_no_types(self, ids, positions, types, segments, training):
        return self.main.embeddings(input_ids=ids, position_ids=positions, training=training)

    def _embed_masked(self, ids, positions, types, segments, training):
        import tensorflow as tf

        return self.main.embeddings(
            input_ids=ids,
            position_ids=positions,
            token_type_ids=types,
            mask=tf.cast(segments > 0, tf.int32),
            training=training,
        )

    def _embed_distilbert(self, ids, positions, types, segments, training):
        """DistilBERT's embeddings and every block (the whole encoder)."""
        x = self.main.embeddings(input_ids=ids, position_ids=positions, training=training)
        mask = block_mask(segments, x.dtype)
        for block in self.main.transformer.layer:
            x = _distilbert_block(block, x, mask, training)
        return x

    def _encoder(self, x, segments, training):
        """The family's encoder on embeddings ``x``, each token seeing its own example."""
        import tensorflow as tf

        flags = {"output_attentions": False, "output_hidden_states": False, "return_dict": False}
        if self.kind.encoder == "pairwise":  # a 0/1 mask per (query, key)
            mask = tf.cast(same_example(segments), tf.int32)
            return self.main.encoder(
                hidden_states=x, attention_mask=mask, training=training, **flags
            )
        mask = block_mask(segments, x.dtype)
        heads = [None] * self.model.config.num_hidden_layers
        if self.kind.encoder == "short":
            return self.main.encoder(
                hidden_states=x, attention_mask=mask, head_mask=heads, training=training, **flags
            )
        return self.main.encoder(
            hidden_states=x,
            attention_mask=mask,
            head_mask=heads,
            encoder_hidden_states=None,
            encoder_attention_mask=None,
            past_key_values=None,
            use_cache=False,
            training=training,
            **flags,
        )

    def __call__(self, features, training=False):
        import tensorflow as tf

        hidden = self.hidden_states(features, training=training)
        starts = tf.cast(features["starts"], tf.int32)
        first = tf.gather(hidden, starts, batch_dims=1)  # [rows, max_per_row, H]
        rows, slots = tf.shape(starts)[0], tf.shape(starts)[1]
        flat = tf.reshape(first, [rows * slots, 1, first.shape[-1]])
        logits = self._head(flat, training)
        return tf.reshape(logits, [rows, slots, self.model.config.num_labels])

    def _head(self, flat, training):
        """The model's classification head on ``[examples, 1, H]`` first-token states."""
        m, head = self.model, self.kind.head
        if head == "first_token":  # the classifier reads the first token itself
            return m.classifier(flat, training=training)
        pooled = {
            "bert_pooler": lambda: self.main.pooler(hidden_states=flat),
            "albert_pooler": lambda: self.main.pooler(flat[:, 0]),
            "deberta_pooler": lambda: m.pooler(flat, training=training),
            "pre_classifier": lambda: m.pre_classifier(flat[:, 0]),
        }[head]()
        return m.classifier(m.dropout(pooled, training=training))


def _distilbert_block(block, x, mask, training):
    """One DistilBERT transformer block with an additive ``[rows, 1, T, T]`` mask (its own
    attention layer only takes ``[rows, T]``); the same weights and ops otherwise."""
    import tensorflow as tf

    att = block.attention
    rows, length = tf.shape(x)[0], tf.shape(x)[1]
    per_head = att.dim // att.n_heads

    def heads(t):
        return tf.transpose(tf.reshape(t, [rows, length, att.n_heads, per_head]), [0, 2, 1, 3])

    q = heads(att.q_lin(x)) * tf.math.rsqrt(tf.cast(per_head, x.dtype))
    scores = tf.matmul(q, heads(att.k_lin(x)), transpose_b=True) + tf.cast(mask, x.dtype)
    weights = att.dropout(tf.nn.softmax(scores, axis=-1), training=training)
    context = tf.matmul(weights, heads(att.v_lin(x)))
    context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [rows, length, att.dim])
    attended = block.sa_layer_norm(att.out_lin(context) + x)
    return block.output_layer_norm(block.ffn(attended, training=training) + attended)


def packed_loss(labels, logits, weights):
    """Mean cross-entropy over the slots with weight > 0 (0 when there are none)."""
    import tensorflow as tf

    logits = tf.cast(logits, tf.float32)  # bfloat16 logits under mixed precision
    per_slot = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    weights = tf.cast(weights, per_slot.dtype)
    return tf.reduce_sum(per_slot * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)


def packed_keras_model(model):
    """A Keras model that trains ``model`` (a covered TF sequence classifier) on packed
    batches with ``fit``: ``call`` gives the packed logits, the loss is the mean
    cross-entropy over the weighted slots (``packed_loss``), the metrics are the loss and
    the accuracy over those slots. Create and compile it inside ``strategy.scope()``; save
    the fine-tuned weights with ``model.save_pretrained`` (the wrapped model)."""
    import tensorflow as tf

    class PackedModel(tf.keras.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner  # tracked: its variables are this model's
            self.packed = PackedClassifier(inner)
            self.loss_tracker = tf.keras.metrics.Mean("loss")
            self.accuracy = tf.keras.metrics.SparseCategoricalAccuracy("accuracy")
            # every weight is the wrapped model's, built by PackedClassifier: a checkpoint
            # (fit_resumable) can be checked against it before the first step
            self.built = True

        @property
        def metrics(self):
            return [self.loss_tracker, self.accuracy]

        def call(self, features, training=False):
            return self.packed(features, training=training)

        def _scores(self, data, training):
            features, labels, weights = data
            logits = self(features, training=training)
            loss = packed_loss(labels, logits, weights)
            return logits, labels, weights, loss

        def train_step(self, data):
            with tf.GradientTape() as tape:
                logits, labels, weights, loss = self._scores(data, True)
                replicas = tf.distribute.get_strategy().num_replicas_in_sync
                scaled = loss / replicas  # the replicas' gradients are summed
            grads = tape.gradient(scaled, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return self._update(logits, labels, weights, loss)

        def test_step(self, data):
            return self._update(*self._scores(data, False))

        def _update(self, logits, labels, weights, loss):
            self.loss_tracker.update_state(loss, sample_weight=tf.reduce_sum(weights))
            self.accuracy.update_state(labels, logits, sample_weight=weights)
            return {m.name: m.result() for m in self.metrics}

    return PackedModel(model)


def packed_train_step(model):
    """``step(features, labels, weights) -> (loss, gradients)`` on packed batches, for
    ``xla.preflight(model, packed_ds, train_step=packed_train_step(model))``: the check of
    a packed model and its data before any TPU time (one shape, the padding share from
    ``segment_ids``, the step compiled with XLA)."""
    import tensorflow as tf

    packed = PackedClassifier(model)

    def step(features, labels, weights):
        with tf.GradientTape() as tape:
            loss = packed_loss(labels, packed(features, training=True), weights)
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, [tf.convert_to_tensor(g) for g in grads if g is not None]

    return step
