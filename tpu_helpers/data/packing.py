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
The TF classes that train on these rows are in ``tpu_helpers.tf_engine.packed_classes``; the Keras 3
engine's in ``keras3.packed_classifier``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import InputError
from tpu_helpers.core.validate import (
    check_labels,
    check_positive,
    check_same_length,
    check_token_counts,
)

__all__ = [
    "pack_rows",
    "PackReport",
    "pack_report",
    "rows_per_replica",
    "row_width",
    "packed_arrays",
    "packed_batches",
]


# --- packing ------------------------------------------------------------------------------
def pack_rows(
    lengths: Sequence[int], width: int, max_per_row: int = 8, seed: int | None = 0
) -> list[list[int]]:
    """Example indices per row: best-fit decreasing (each example, longest first, goes to
    the open row it fills most tightly, the first opened of those), at most
    ``max_per_row`` per row. Notebook 07 writes the same packing with NumPy, row by row.

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
    # open[c]: a heap of the rows with exactly c free positions and room for an example
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
            row = heapq.heappop(open_rows[room])
        rows[row].append(index)
        free[row] -= need
        if len(rows[row]) < max_per_row and free[row] > 0:
            heapq.heappush(open_rows[free[row]], row)
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
    from tpu_helpers.core.pipeline import Batches

    check_positive(width=width, global_batch=global_batch, max_per_row=max_per_row, epochs=epochs)
    labels, lengths = _checked_labels_and_lengths(input_ids, labels, token_type_ids, num_labels)
    packings = [_epoch_rows(lengths, width, max_per_row, seed, e) for e in range(epochs)]
    steps = max(-(-len(rows) // global_batch) for rows in packings)
    planned = _PackedEpochs(
        input_ids=input_ids,
        labels=labels,
        token_type_ids=token_type_ids,
        packings=packings,
        width=width,
        max_per_row=max_per_row,
        pad_token_id=pad_token_id,
        global_batch=global_batch,
        steps=steps,
    )
    return Batches(
        planned.build,
        steps,
        global_batch,
        examples=len(lengths),
        padding=pack_report(lengths, packings[0], width),
        max_width=width,
        name="packed batches",
    )


def _checked_labels_and_lengths(input_ids, labels, token_type_ids, num_labels):
    """``(labels, lengths)``: the labels checked (whole numbers from 0, below
    ``num_labels`` when it is given) and the examples' lengths; refuses no examples and,
    with ``token_type_ids``, other than one type per token."""
    check_same_length(input_ids=input_ids, labels=labels, token_type_ids=token_type_ids)
    labels = check_labels(labels, num_labels, "labels")
    lengths = [len(ids) for ids in input_ids]
    _check_some(lengths)
    if token_type_ids is not None:  # one type per token, refused here rather than at a step
        _types_in_order(token_type_ids, input_ids, np.arange(len(lengths)), np.asarray(lengths))
    return labels, lengths


@dataclass(frozen=True, eq=False)
class _PackedEpochs:
    """The epochs of ``packed_batches``: epoch ``e`` is the rows ``packings[e]``, completed
    to ``steps`` batches of ``global_batch`` rows with empty ones."""

    input_ids: Sequence[Sequence[int]]
    labels: np.ndarray
    token_type_ids: Sequence[Sequence[int]] | None
    packings: list[list[list[int]]]
    width: int
    max_per_row: int
    pad_token_id: int
    global_batch: int
    steps: int

    def build(self, epoch: int, skip_steps: int, input_context):
        import tensorflow as tf

        epochs, global_batch = len(self.packings), self.global_batch
        if epoch >= epochs:
            raise InputError(
                f"epoch={epoch}: the packing was planned for {epochs} epochs (0 to"
                f" {epochs - 1}). Fix: packed_batches(..., epochs=) the run's epochs."
            )
        arrays = _filled(
            packed_arrays(
                self.input_ids,
                self.labels,
                self.packings[epoch],
                self.width,
                self.max_per_row,
                self.pad_token_id,
                self.token_type_ids,
            ),
            self.steps * global_batch,
            self.pad_token_id,
        )
        arrays = {k: v[skip_steps * global_batch :] for k, v in arrays.items()}
        features = {k: v for k, v in arrays.items() if k not in ("labels", "weights")}
        ds = tf.data.Dataset.from_tensor_slices((features, arrays["labels"], arrays["weights"]))
        return ds.batch(global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
