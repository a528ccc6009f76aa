"""Packed fine-tuning: several short examples per row, attention kept inside each one.

Padding each example to one of a few widths keeps about 70-75 % of the computed tokens
real on sentence-classification data; packing several examples into each row of one width,
with a block-diagonal attention mask and positions that restart at every example, makes
nearly all of them real, at one shape.

* ``pack_rows``: which examples share a row (best-fit decreasing bin packing, at most
  ``max_per_row`` examples a row; ties broken by a seed, so each epoch packs differently).
* ``packed_arrays``: per token ``input_ids``, ``segment_ids`` (1, 2, ... per example, 0 for
  padding), restarted ``position_ids`` and, for sentence pairs, ``token_type_ids`` (0 for
  the first sentence of each example, 1 for the second); per row the ``starts`` of its
  examples; labels and weights per slot (``[rows, max_per_row]``, weight 0 for empty slots).
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import InputError
from tpu_helpers.core.families import FAMILIES as FAMILY_TABLE
from tpu_helpers.core.families import PACKED
from tpu_helpers.core.validate import (
    check_labels,
    check_positive,
    check_same_length,
    check_token_counts,
)

__all__ = [
    "FAMILY",
    "pack_rows",
    "PackReport",
    "pack_report",
    "rows_per_replica",
    "row_width",
    "packed_arrays",
    "unsupported_reason",
    "block_mask",
    "same_example",
    "PackedClassifier",
    "packed_loss",
    "packed_batches",
    "packed_keras_model",
    "packed_train_step",
]


#: How each family it covers is packed (``families.FAMILIES``' ``packed``).
FAMILY = {name: FAMILY_TABLE[name].packed for name in PACKED}


# --- packing ------------------------------------------------------------------------------
def pack_rows(
    lengths: Sequence[int], width: int, max_per_row: int = 8, seed: int | None = 0
) -> list[list[int]]:
    """Example indices per row: best-fit decreasing (each example, longest first, goes to
    the open row it fills most tightly), at most ``max_per_row`` per row.

    Examples longer than ``width`` raise ``ValueError`` (truncate them when tokenizing).
    ``seed`` orders examples of equal length (``None``: by index), so the rows differ
    from one seed to the next while the packing stays as tight.
    """
    check_positive(width=width, max_per_row=max_per_row)
    lengths = check_token_counts(lengths)
    too_long = np.flatnonzero(lengths > width)
    if too_long.size:
        raise InputError(
            f"{too_long.size} example(s) are longer than width={width} (the first, index"
            f" {int(too_long[0])}, has {int(lengths[too_long[0]])} tokens). Fix: tokenize with"
            f" max_length={width} (truncation=True), or pack into wider rows."
        )
    tie = (
        np.arange(len(lengths))
        if seed is None
        else np.random.default_rng(seed).permutation(len(lengths))
    )
    order = np.lexsort((tie, -lengths))
    rows: list[list[int]] = []
    # open[c]: rows with exactly c free positions and room for another example
    open_rows: list[list[int]] = [[] for _ in range(width + 1)]
    free = []
    for index in order.tolist():
        need = int(lengths[index])
        room = next((c for c in range(need, width + 1) if open_rows[c]), None)
        if room is None:
            row = len(rows)
            rows.append([])
            free.append(width)
        else:
            row = open_rows[room].pop()
        rows[row].append(index)
        free[row] -= need
        if len(rows[row]) < max_per_row and free[row] > 0:
            open_rows[free[row]].append(row)
    return rows


def _check_some(lengths: Sequence[int]) -> None:
    if len(lengths) == 0:
        raise InputError(
            "There are no examples to pack (lengths is empty). Fix: check the split and any"
            " filter or max_examples before packing."
        )


@dataclass
class PackReport:
    rows: int
    examples: int
    real_tokens: int
    width: int

    @property
    def real_token_share(self) -> float:
        return self.real_tokens / (self.rows * self.width)

    def __str__(self) -> str:
        return (
            f"{self.examples} examples in {self.rows} rows of {self.width}:"
            f" {self.real_token_share:.1%} real tokens, {self.examples / self.rows:.2f} per row"
        )


def pack_report(lengths: Sequence[int], rows: list[list[int]], width: int) -> PackReport:
    lengths = np.asarray(lengths)
    used = sum(len(r) for r in rows)
    return PackReport(len(rows), used, int(sum(lengths[i] for r in rows for i in r)), width)


def rows_per_replica(lengths: Sequence[int], per_replica_batch: int, width: int) -> int:
    """Packed rows a replica takes per step to see about as many examples as an unpacked
    batch of ``per_replica_batch`` (rows hold ``width / mean length`` examples): the same
    number of steps per epoch, so a learning rate and schedule carry over."""
    check_positive(per_replica_batch=per_replica_batch, width=width)
    _check_some(lengths)
    return max(1, round(per_replica_batch * float(np.mean(lengths)) / width))


def row_width(lengths: Sequence[int], width: int, multiple: int = 8) -> int:
    """``width``, or the narrowest multiple of ``multiple`` above it that holds the longest
    example: rows must hold every example whole (a cut would drop its final separator
    token, and a pair its second sentence's end)."""
    _check_some(lengths)
    longest = int(max(lengths))
    return max(int(width), -(-longest // multiple) * multiple)


def packed_arrays(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[int],
    rows: list[list[int]],
    width: int,
    max_per_row: int,
    pad_token_id: int = 0,
    token_type_ids: Sequence[Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """The packed tensors of ``rows`` (from ``pack_rows``), as int32 numpy arrays:
    ``input_ids``, ``segment_ids``, ``position_ids`` ``[rows, width]``; ``starts``,
    ``labels``, ``weights`` ``[rows, max_per_row]`` (empty slots: start 0, weight 0).
    With ``token_type_ids`` (one list per example, as a tokenizer gives for sentence
    pairs) also ``token_type_ids`` ``[rows, width]``, 0 on padding."""
    check_same_length(input_ids=input_ids, labels=labels, token_type_ids=token_type_ids)
    n = len(rows)
    order, lengths, row_of, slot, start = _layout(input_ids, rows, width, max_per_row)
    out = {
        "input_ids": np.full((n, width), pad_token_id, np.int32),
        "segment_ids": np.zeros((n, width), np.int32),
        "position_ids": np.zeros((n, width), np.int32),
        "starts": np.zeros((n, max_per_row), np.int32),
        "labels": np.zeros((n, max_per_row), np.int32),
        "weights": np.zeros((n, max_per_row), np.float32),
    }
    tokens = np.concatenate([np.asarray(input_ids[i]) for i in order]) if n else np.zeros(0)
    token_row = np.repeat(row_of, lengths)
    token_pos = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    token_col = np.repeat(start, lengths) + token_pos  # token_pos: within its example
    out["input_ids"][token_row, token_col] = tokens
    if token_type_ids is not None:
        out["token_type_ids"] = np.zeros((n, width), np.int32)
        if n:
            types = _types_in_order(token_type_ids, input_ids, order, lengths)
            out["token_type_ids"][token_row, token_col] = types
    out["segment_ids"][token_row, token_col] = np.repeat(slot + 1, lengths)
    out["position_ids"][token_row, token_col] = token_pos
    out["starts"][row_of, slot] = start
    out["labels"][row_of, slot] = np.asarray(labels)[order]
    out["weights"][row_of, slot] = 1.0
    return out


def _layout(input_ids, rows: list[list[int]], width: int, max_per_row: int):
    """Where every example goes, in row order: ``(order, lengths, row, slot, start)`` per
    example (its index, its length, its row, its place among the row's examples, its first
    column); refuses rows with more than ``max_per_row`` examples or ``width`` tokens."""
    n = len(rows)
    per_row = np.array([len(r) for r in rows], dtype=np.int64)
    if n and per_row.max() > max_per_row:
        raise InputError(
            f"A row holds {per_row.max()} examples, more than max_per_row={max_per_row}. Fix:"
            " pack_rows(lengths, width, max_per_row) with the same max_per_row."
        )
    order = np.concatenate([np.asarray(r, np.int64) for r in rows]) if n else np.zeros(0, int)
    lengths = np.array([len(input_ids[i]) for i in order], dtype=np.int64)
    row_of = np.repeat(np.arange(n), per_row)
    slot = np.arange(len(order)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    ends = np.cumsum(lengths)  # in the concatenation of all rows' examples
    row_tokens = np.bincount(row_of, weights=lengths, minlength=n).astype(np.int64)
    if n and row_tokens.max() > width:
        raise InputError(
            f"Row {int(row_tokens.argmax())} holds {int(row_tokens.max())} tokens, more than"
            f" width={width}. Fix: pack_rows(lengths, width) with the same width."
        )
    row_offset = np.cumsum(row_tokens) - row_tokens
    start = ends - lengths - row_offset[row_of]
    return order, lengths, row_of, slot, start


def _types_in_order(token_type_ids, input_ids, order, lengths) -> np.ndarray:
    """The examples' ``token_type_ids`` concatenated in ``order``; each list must be as
    long as the example's ``input_ids``."""
    types = [np.asarray(token_type_ids[i]) for i in order]
    wrong = np.flatnonzero(np.array([len(t) for t in types]) != lengths)
    if len(wrong):
        i = int(order[wrong[0]])
        raise InputError(
            f"Example {i} has {len(input_ids[i])} input_ids but"
            f" {len(token_type_ids[i])} token_type_ids. Fix: take both from the same"
            " tokenizer call."
        )
    return np.concatenate(types)


# --- the model -----------------------------------------------------------------------------
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


# --- data and training ------------------------------------------------------------------------
def _epoch_rows(lengths: Sequence[int], width: int, max_per_row: int, seed: int, epoch: int):
    """One epoch's rows: packed with ``pipeline.rng(seed, epoch)``'s draws, then shuffled."""
    from tpu_helpers.core.pipeline import STREAMS, rng, seed_pair

    pair = seed_pair(seed, epoch, 0, STREAMS["order"])
    rows = pack_rows(lengths, width, max_per_row, pair)
    return [rows[i] for i in rng(seed, epoch, STREAMS["fill"]).permutation(len(rows))]


def _filled(arrays: dict, rows: int, pad_token_id: int) -> dict:
    """``arrays`` completed to ``rows`` rows with empty ones (every weight 0)."""
    out = {}
    for name, values in arrays.items():
        fill = pad_token_id if name == "input_ids" else 0
        filler = np.full((rows - len(values), *values.shape[1:]), fill, values.dtype)
        out[name] = np.concatenate([values, filler])
    return out


def packed_batches(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[int],
    *,
    width: int,
    global_batch: int,
    epochs: int,
    max_per_row: int = 8,
    seed: int = 0,
    pad_token_id: int = 0,
    token_type_ids: Sequence[Sequence[int]] | None = None,
    num_labels: int | None = None,
):
    """The ``pipeline.Batches`` of packed rows: batches of ``global_batch`` rows of
    ``width`` tokens, one shape, ``(features, labels, weights)`` with labels and weights
    per slot (features with ``token_type_ids`` when they are given: sentence pairs).

    Epoch ``e`` is packed and its rows shuffled with ``pipeline.rng(seed, e)``, so each
    epoch groups the examples differently; each of the run's ``epochs`` epochs has the same
    number of steps (the most any epoch's packing needs), its last batches completed with
    empty rows (every weight 0): each example is used exactly once per epoch with weight 1.
    ``batches.padding`` describes the packing of the first epoch (``pack_report``). Labels
    are checked (whole numbers from 0, below ``num_labels`` when it is given)."""
    import tensorflow as tf

    from tpu_helpers.core.pipeline import Batches

    check_positive(width=width, global_batch=global_batch, max_per_row=max_per_row, epochs=epochs)
    check_same_length(input_ids=input_ids, labels=labels, token_type_ids=token_type_ids)
    labels = check_labels(labels, num_labels, "labels")
    lengths = [len(ids) for ids in input_ids]
    _check_some(lengths)
    if token_type_ids is not None:  # one type per token, refused here rather than at a step
        _types_in_order(token_type_ids, input_ids, np.arange(len(lengths)), np.asarray(lengths))
    packings = [_epoch_rows(lengths, width, max_per_row, seed, e) for e in range(epochs)]
    steps = max(-(-len(rows) // global_batch) for rows in packings)

    def build(epoch, skip_steps, input_context):
        if epoch >= epochs:
            raise InputError(
                f"epoch={epoch}: the packing was planned for {epochs} epochs (0 to"
                f" {epochs - 1}). Fix: packed_batches(..., epochs=) the run's epochs."
            )
        arrays = _filled(
            packed_arrays(
                input_ids,
                labels,
                packings[epoch],
                width,
                max_per_row,
                pad_token_id,
                token_type_ids,
            ),
            steps * global_batch,
            pad_token_id,
        )
        arrays = {k: v[skip_steps * global_batch :] for k, v in arrays.items()}
        features = {k: v for k, v in arrays.items() if k not in ("labels", "weights")}
        ds = tf.data.Dataset.from_tensor_slices((features, arrays["labels"], arrays["weights"]))
        return ds.batch(global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    return Batches(
        build,
        steps,
        global_batch,
        examples=len(lengths),
        padding=pack_report(lengths, packings[0], width),
        max_width=width,
        name="packed batches",
    )


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
