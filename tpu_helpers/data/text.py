"""Text data for TPUs: load, tokenize, choose padding, and batch for a strategy.

Padding is where text models waste a TPU. Every distinct batch shape is one XLA
compilation, so shapes must be few; every padding token is computed like a real one, so
padding must be small. This module expresses every padding scheme as a list of
*boundaries* (the widths a batch may have) and picks them from the data:

* ``"max_length"``: one width, the tutorial's ``padding="max_length"``;
* ``"multiple"``: widths ``m, 2m, ...``: sorting by length and padding to a multiple of ``m``;
* ``"buckets"``: at most ``max_shapes`` widths (multiples of 8) chosen from the length
  histogram to minimise padding.

>>> lengths = [5, 6, 7, 9, 12, 12, 30]
>>> choose_boundaries(lengths, max_shapes=2)
[16, 32]
>>> round(padding_report(lengths, [16, 32]).real_token_share, 3)
0.633
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import InputError
from tpu_helpers.core.families import position_limit
from tpu_helpers.core.messages import say
from tpu_helpers.core.validate import check_boundaries, check_labels, check_positive, check_present

__all__ = [
    "SCHEMES",
    "load_text_dataset",
    "check_max_length",
    "tokenize",
    "choose_boundaries",
    "padding_boundaries",
    "PaddingReport",
    "padding_report",
    "global_batch_size",
    "batch_plan",
    "count_steps",
    "text_batches",
]

SCHEMES = ("max_length", "multiple", "buckets")


# --- loading -------------------------------------------------------------------------
def load_text_dataset(
    name_or_path: str,
    config: str | None = None,
    splits: Sequence[str] = ("train", "validation"),
    columns: Sequence[str] = ("sentence", "label"),
):
    """``load_dataset(name, config)`` for a hub name (``"glue", "cola"``) or a local folder,
    checking that the splits and columns the notebook needs are there.

    Raises ``ValueError`` naming the missing split or column and what the data set has.
    """
    from datasets import load_dataset

    try:
        data = load_dataset(name_or_path, config) if config else load_dataset(name_or_path)
    except FileNotFoundError as err:
        raise InputError(
            f"Could not load data set {name_or_path!r} (config {config!r}): {err}. Fix: pass a"
            " hub name such as 'glue' with config 'cola', or a local folder that"
            " datasets.load_dataset can read (python -m tpu_helpers fixtures DIR writes one)."
        ) from err
    for split in splits:
        if split not in data:
            raise InputError(
                f"Data set {name_or_path!r} has no split {split!r}; it has {sorted(data)}."
                " Fix: pass the split names it has."
            )
        missing = [c for c in columns if c not in data[split].column_names]
        if missing:
            raise InputError(
                f"Split {split!r} of {name_or_path!r} has no column {missing[0]!r}; its columns"
                f" are {data[split].column_names}. Fix: rename the column"
                f" (dataset.rename_column) or name it in columns= (a notebook's text_column"
                f" and text_pair_column parameters)."
            )
    return data


def check_max_length(max_length: int, model_config, *, log=say, name: str = "max_length") -> int:
    """Refuse a ``max_length`` the model's position embeddings cannot hold (see
    ``position_limit``; a tokenizer instead of a config raises ``TypeError``). A model
    that names no limit takes ``max_length`` as given, and ``log`` says so. ``name`` is
    the parameter's name in the messages (``block_size`` for notebook 06's blocks)."""
    check_positive(**{name: max_length})
    limit = position_limit(model_config)
    if limit is None:
        log(
            f"The {model_config.model_type} model names no position limit (relative"
            f" positions): {name}={max_length} is used as given; its model card says"
            " how long its training sequences were."
        )
    elif max_length > limit:
        raise InputError(
            f"{name}={max_length} exceeds the {model_config.model_type} model's limit of"
            f" {limit} positions. Fix: {name} <= {limit}."
        )
    return max_length


def tokenize(
    dataset,
    tokenizer,
    max_length: int,
    text_column: str = "sentence",
    batch_size: int = 1000,
    text_pair_column: str | None = None,
):
    """Add ``input_ids`` (truncated to ``max_length``, not padded) and ``length`` columns.

    With ``text_pair_column`` each example is the pair (``text_column``,
    ``text_pair_column``), joined by the tokenizer's own template (``[CLS] a [SEP] b
    [SEP]``, ``<s> a </s></s> b </s>``...) and truncated longest-first; a
    ``token_type_ids`` column is added when the model takes them (the tokenizer's
    ``model_input_names``). Tokenizes in batches with ``Dataset.map(batched=True)``.
    Padding is decided later, per batch, by the boundaries (see ``text_batches``).
    A missing (``None``) text raises ``ValueError`` with its row.
    """
    columns = [text_column] + ([text_pair_column] if text_pair_column else [])
    names = getattr(dataset, "column_names", None)
    missing = [c for c in columns if names is not None and c not in names]
    if missing:
        raise InputError(
            f"The data has no column {missing[0]!r} to tokenize; its columns are {names}."
            " Fix: text_column= (and text_pair_column= for pairs) naming the text columns,"
            " e.g. text_column='text' for IMDb-like data."
        )
    types = bool(text_pair_column) and "token_type_ids" in tokenizer.model_input_names

    def encode(batch, rows):
        texts = [batch[c] for c in columns]
        for column, values in zip(columns, texts, strict=True):
            check_present(values, column, first_row=rows[0])
        enc = tokenizer(
            *texts,
            truncation=True,
            max_length=max_length,
            return_attention_mask=False,
            return_token_type_ids=types,
        )
        out = {"input_ids": enc["input_ids"], "length": [len(x) for x in enc["input_ids"]]}
        if types:
            out["token_type_ids"] = enc["token_type_ids"]
        return out

    return dataset.map(
        encode, batched=True, batch_size=batch_size, with_indices=True, desc="tokenize"
    )


# --- choosing the padding ------------------------------------------------------------
def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def _check_max_shapes(max_shapes) -> None:
    """``InputError`` unless ``max_shapes`` is a whole number of batch widths, at least 1."""
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int | np.integer):
        raise InputError(
            f"max_shapes={max_shapes!r} is a {type(max_shapes).__name__}, not a whole number"
            " of batch widths. Fix: an int such as max_shapes=4 (each width is one XLA"
            " compilation; 2 to 8 is usual)."
        )
    if max_shapes < 1:
        raise InputError(
            f"max_shapes={max_shapes} must be at least 1. Fix: an int such as max_shapes=4"
            " (each width is one XLA compilation; 2 to 8 is usual)."
        )


def _least_padding_widths(
    widths: np.ndarray, count: np.ndarray, total: np.ndarray, max_shapes: int
) -> list[int]:
    """At most ``max_shapes`` of the candidate ``widths`` (fewer than them), the widest
    always among them, that pad least, sorted: ``count[j]`` and ``total[j]`` are the
    examples, and their tokens, that fit ``widths[j]``. Dynamic programming; ties go to
    fewer widths, then to narrower ones."""
    s = len(widths)
    # best[k, j]: least padding of the examples up to widths[j] with k + 1 widths, the
    # widest widths[j]; one numpy pass per k (float64 counts tokens exactly below 2**53)
    best = np.full((max_shapes, s), np.inf)
    back = np.full((max_shapes, s), -1)
    best[0] = count * widths - total
    rows = np.arange(s)
    block = max(1, 2**21 // s)  # columns at once: at most 2M cells (16 MB) an array
    for k in range(1, max_shapes):
        for start in range(0, s, block):
            cols = rows[start : start + block]
            # cost[i, j]: k widths up to widths[i], then those after it padded to widths[j]
            pad = (count[cols] - count[:, None]) * widths[cols] - (total[cols] - total[:, None])
            cost = np.where(rows[:, None] < cols, best[k - 1][:, None] + pad, np.inf)
            arg = cost.argmin(axis=0)  # the first minimum: the narrower width on ties
            best[k, cols] = cost[arg, np.arange(len(cols))]
            back[k, cols] = np.where(np.isfinite(best[k, cols]), arg, -1)
    k, j, bounds = int(np.argmin(best[:, -1])), s - 1, []  # first minimum: fewest widths
    while j >= 0 and k >= 0:
        bounds.append(int(widths[j]))
        j, k = back[k, j], k - 1
    bounds.sort()
    return bounds


def choose_boundaries(
    lengths: Sequence[int], max_shapes: int = 4, multiple: int = 8, max_length: int | None = None
) -> list[int]:
    """At most ``max_shapes`` batch widths, each a multiple of ``multiple``, that minimise
    the padding of ``lengths`` when each example goes to the narrowest width that fits.

    Exact: dynamic programming over the candidate widths ``multiple, 2*multiple, ...``
    that some example rounds up to (a width no example rounds up to saves no padding).
    The widest boundary always covers the longest example (capped at ``max_length``).
    With at least as many shapes as candidates, each candidate is a width (no padding
    beyond the multiple), so the work never grows with ``max_shapes``. Ties go to fewer
    widths, then to narrower ones.

    >>> choose_boundaries([5, 6, 7, 9, 12, 12, 30], max_shapes=2)
    [16, 32]
    >>> choose_boundaries([5, 6, 7, 9, 12, 12, 30], max_shapes=2000)
    [8, 16, 32]
    """
    _check_max_shapes(max_shapes)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise InputError("choose_boundaries needs at least one length.")
    top = _round_up(int(lengths.max()), multiple)
    if max_length is not None:
        top = min(top, max_length)
    candidates = np.array([*range(multiple, top, multiple), top], dtype=np.int64)
    # the examples, and their tokens, with 0 < length <= each candidate (a group is the
    # lengths between two neighbouring candidates)
    held = np.sort(lengths[(lengths > 0) & (lengths <= top)])
    count = np.searchsorted(held, candidates, side="right")
    total = np.concatenate([[0], np.cumsum(held)])[count]
    # Only the widths some example rounds up to, and the widest: a width over an empty
    # group pads more than the width below it, or is a shape that saves nothing.
    keep = np.flatnonzero(np.diff(count, prepend=0) > 0)
    if keep.size == 0 or keep[-1] != len(candidates) - 1:
        keep = np.append(keep, len(candidates) - 1)
    widths, count, total = candidates[keep], count[keep].astype(float), total[keep].astype(float)
    if max_shapes >= len(widths):
        bounds = widths.tolist()  # each its own width: no padding beyond the multiple
    else:
        bounds = _least_padding_widths(widths, count, total, max_shapes)
    # Widths no example uses are dropped: they would add a shape and save nothing.
    used = np.unique(np.searchsorted(bounds, np.minimum(lengths, bounds[-1])))
    return [int(bounds[i]) for i in used]


def padding_boundaries(
    lengths: Sequence[int],
    scheme: str = "buckets",
    max_length: int = 128,
    multiple_of: int = 32,
    max_shapes: int = 4,
) -> list[int]:
    """The batch widths of ``scheme`` (see the module docstring) for these lengths."""
    if scheme == "max_length":
        return [max_length]
    if scheme == "multiple":
        top = min(_round_up(int(max(lengths)), multiple_of), _round_up(max_length, multiple_of))
        return list(range(multiple_of, top + 1, multiple_of))
    if scheme == "buckets":
        return choose_boundaries(lengths, max_shapes=max_shapes, max_length=max_length)
    raise InputError(f"padding scheme {scheme!r} is not one of {SCHEMES}.")


@dataclass(frozen=True)
class PaddingReport:
    boundaries: tuple[int, ...]
    real_tokens: int
    padded_tokens: int

    @property
    def shapes(self) -> int:
        return len(self.boundaries)

    @property
    def real_token_share(self) -> float:
        return self.real_tokens / self.padded_tokens

    def __str__(self) -> str:
        return (
            f"widths {list(self.boundaries)}: {self.shapes} shape(s),"
            f" {self.real_token_share:.1%} real tokens"
        )


def padding_report(lengths: Sequence[int], boundaries: Sequence[int]) -> PaddingReport:
    """Real (non-padding) tokens against tokens computed, when each example is padded to the
    narrowest boundary that holds it (longer ones are truncated to the widest)."""
    boundaries = check_boundaries(boundaries)
    if len(lengths) == 0:
        raise InputError("padding_report needs at least one length. Fix: pass the split's lengths.")
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), boundaries[-1])
    widths = np.asarray(boundaries)[np.searchsorted(boundaries, lengths)]
    return PaddingReport(tuple(int(b) for b in boundaries), int(lengths.sum()), int(widths.sum()))


# --- batching for a strategy ---------------------------------------------------------
def global_batch_size(per_replica_batch: int, replicas: int) -> int:
    """``per_replica_batch x replicas``, refusing a batch that is not a positive integer."""
    if (
        isinstance(per_replica_batch, bool)
        or not isinstance(per_replica_batch, int)
        or per_replica_batch < 1
    ):
        raise InputError(
            f"per_replica_batch={per_replica_batch!r} is not a positive integer. Fix: pass the"
            f" batch for ONE replica (e.g. 8 or 16); the global batch is that x {replicas} replicas."
        )
    check_positive(replicas=replicas)
    return per_replica_batch * replicas


def batch_plan(
    lengths: Sequence[int],
    boundaries: Sequence[int],
    global_batch: int,
    seed: int = 0,
    shuffle: bool = True,
    group_widths: int = 1,
):
    """Group example indices into batches of exactly ``global_batch`` rows and one width each.

    Examples go to the narrowest boundary that holds them; a bucket's leftover (fewer than
    a batch) moves up to the next wider bucket; the last partial batch is completed with
    copies weighted 0. So every example appears exactly once with weight 1, every batch
    has the static size a TPU needs, and nothing is silently dropped. The batches come in
    a shuffled order; with ``group_widths`` > 1 that order is arranged in runs of
    ``group_widths`` batches of one width (``runs_of_one_width``).

    Returns ``(indices [n, B], widths [n], weights [n, B])`` as numpy arrays.
    """
    boundaries = check_boundaries(boundaries)
    check_positive(global_batch=global_batch)
    lengths = np.minimum(np.asarray(lengths), boundaries[-1])
    if len(lengths) < global_batch:
        raise InputError(
            f"The data set has {len(lengths)} examples, fewer than one global batch of"
            f" {global_batch}. Fix: a smaller per-replica batch or more data."
        )
    rng = np.random.default_rng(seed)
    bucket_of = np.searchsorted(boundaries, lengths)
    batches, widths, weights = [], [], []
    carry = np.empty(0, dtype=np.int64)
    for b, width in enumerate(boundaries):
        members = np.flatnonzero(bucket_of == b)
        if shuffle:
            members = rng.permutation(members)
        pool = np.concatenate([carry, members])
        full = len(pool) // global_batch * global_batch
        for start in range(0, full, global_batch):
            batches.append(pool[start : start + global_batch])
            widths.append(width)
            weights.append(np.ones(global_batch, np.float32))
        carry = pool[full:]
    if len(carry):
        fill = rng.choice(len(lengths), global_batch - len(carry), replace=False)
        # fillers must fit the widest width, which every example does
        batches.append(np.concatenate([carry, fill]))
        widths.append(boundaries[-1])
        weights.append(
            np.concatenate([np.ones(len(carry)), np.zeros(len(fill))]).astype(np.float32)
        )
    order = rng.permutation(len(batches)) if shuffle else np.arange(len(batches))
    widths = np.asarray(widths, np.int32)
    order = order[runs_of_one_width(widths[order], group_widths)]
    return np.stack(batches)[order], widths[order], np.stack(weights)[order]


def runs_of_one_width(widths: Sequence[int], run: int) -> np.ndarray:
    """An order of ``widths`` (positions into it) in runs of ``run`` equal widths, for
    engines that fuse ``run`` steps of one shape into one compiled call
    (``steps_per_execution`` on JAX): each width's positions keep their order, a run is
    placed when its last member is reached, and the rest of each width (fewer than
    ``run``) comes at the end, in the order of their first members. ``run=1`` keeps the order.

    >>> runs_of_one_width([8, 16, 8, 16, 8], 2).tolist()
    [0, 2, 1, 3, 4]
    """
    check_positive(group_widths=run)
    order, pending = [], {}
    for position, width in enumerate(np.asarray(widths).tolist()):
        members = pending.setdefault(width, [])
        members.append(position)
        if len(members) == run:
            order.extend(members)
            members.clear()
    rest = sorted((m for m in pending.values() if m), key=lambda m: m[0])
    return np.asarray(order + [p for m in rest for p in m], np.int64)


def count_steps(lengths: Sequence[int], boundaries: Sequence[int], global_batch: int) -> int:
    """Batches per epoch that ``batch_plan`` makes (the same for every seed)."""
    return len(batch_plan(lengths, boundaries, global_batch, shuffle=False)[1])


def _columns(split) -> list[str]:
    names = getattr(split, "column_names", None)
    return list(names) if names is not None else list(split)


def _checked_lengths(split, label_column: str) -> np.ndarray:
    """The ``length`` column of a tokenized split with a label column and examples, or a
    ``ValueError`` that names what is missing and the fix."""
    missing = [c for c in ("input_ids", "length", label_column) if c not in _columns(split)]
    if missing:
        raise InputError(
            f"The split has no column {missing[0]!r} (it has {_columns(split)}). Fix:"
            " text.tokenize(split, tokenizer, max_length) adds input_ids and length; name"
            " the label column with label_column=."
        )
    lengths = np.asarray(split["length"])
    if not len(lengths):
        raise InputError(
            "The split has no examples. Fix: check the split name and any filter applied to it."
        )
    return lengths


def _say_cut(lengths: np.ndarray, widest: int) -> None:
    """Says how many examples are longer than ``widest`` (kept, but cut to it: widths
    chosen on another split, say), with the fix; nothing when none is."""
    cut = int(np.count_nonzero(lengths > widest))
    if cut:
        say(
            f"[text] {cut} of {len(lengths)} examples are longer than the widest width"
            f" {widest} and are cut to it. Fix: widths that end at the longest example"
            " of every split (or at max_length)."
        )


def _this_pipelines_rows(indices, widths, weights, input_context):
    """Global steps' ``(indices, widths, weights)`` cut into per-replica batches for the
    replicas of ``input_context``'s pipeline, in replica order, one width per step."""
    replicas = input_context.num_replicas_in_sync
    rows = indices.shape[1] // replicas
    local = replicas // input_context.num_input_pipelines
    first = input_context.input_pipeline_id * local
    steps = len(indices)
    indices = indices.reshape(steps, replicas, rows)[:, first : first + local].reshape(-1, rows)
    weights = weights.reshape(steps, replicas, rows)[:, first : first + local].reshape(-1, rows)
    return indices, np.repeat(widths, local), weights


def text_batches(
    split,
    *,
    global_batch: int,
    boundaries: Sequence[int],
    shuffle: bool = True,
    seed: int = 0,
    label_column: str = "label",
    num_labels: int | None = None,
    transform=None,
    group_widths: int = 1,
):
    """The ``pipeline.Batches`` of a tokenized split (``tokenize``): elements
    ``({"input_ids", "attention_mask"}, labels, weights)`` (features with
    ``token_type_ids`` too when the split has them: sentence pairs).

    Each epoch is planned with ``batch_plan`` (seed ``pipeline.seed_pair(seed, epoch)``),
    so shuffling differs per epoch, every batch has one of ``boundaries`` as width, and
    the weights mark the fillers (0) that keep batches full. On a strategy
    (``batches.distribute``) each host builds the per-replica batches of its own replicas,
    in replica order, all replicas of one step sharing one width: replicas that disagree
    on shapes cannot reduce their gradients.

    Labels are checked once, here: missing, fractional, negative (GLUE test splits carry
    -1) or, with ``num_labels``, too large values raise ``ValueError`` with the row.
    Examples longer than the widest width are cut to it, and said.
    ``transform`` (a function of the dataset, such as ``observe.CompileWatch.watch``) is
    applied to the batches before prefetching. ``group_widths`` (the model's
    ``steps_per_execution`` on the Keras 3 engine) orders each epoch in runs of that many
    batches of one width, so that each compiled call fuses a full run (``batch_plan``).
    """
    import tensorflow as tf

    from tpu_helpers.core.pipeline import Batches, seed_pair

    boundaries = check_boundaries(boundaries)
    check_positive(global_batch=global_batch, group_widths=group_widths)
    lengths = _checked_lengths(split, label_column)
    _say_cut(lengths, boundaries[-1])
    # per token columns: input_ids and, for sentence pairs, token_type_ids
    per_token = [c for c in ("input_ids", "token_type_ids") if c in _columns(split)]
    ragged = {c: _ragged(split[c], lengths, boundaries[-1]) for c in per_token}
    label_values = check_labels(split[label_column], num_labels, label_column)
    labels = tf.constant(label_values, tf.int32)

    def build(epoch, skip_steps, input_context):
        plan = batch_plan(
            lengths, boundaries, global_batch, seed_pair(seed, epoch), shuffle, group_widths
        )
        indices, widths, weights = (part[skip_steps:] for part in plan)
        rows = global_batch
        if input_context is not None:
            rows = input_context.get_per_replica_batch_size(global_batch)
            indices, widths, weights = _this_pipelines_rows(indices, widths, weights, input_context)

        ds = tf.data.Dataset.from_tensor_slices((indices, widths, weights))
        gather = _batch_gatherer(ragged, labels, rows)
        ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if transform is not None:
            ds = transform(ds)
        return ds.prefetch(tf.data.AUTOTUNE)

    steps = count_steps(lengths, boundaries, global_batch)
    order = {"seed": seed, "shuffle": shuffle, "group_widths": group_widths}
    details = _text_batches_details(lengths, boundaries, order, label_values, ragged)
    return Batches(build, steps, global_batch, **details)


def _text_batches_details(
    lengths: np.ndarray, boundaries: list[int], order: dict, label_values: np.ndarray, ragged
) -> dict:
    """The keyword arguments of ``text_batches``' ``Batches``: the examples, their padding
    and widths, the ``order`` options, the largest label and token id, the name, and that
    each host reads its own replicas' rows."""
    import tensorflow as tf

    return {
        "examples": len(lengths),
        "padding": padding_report(lengths, boundaries),
        "max_width": boundaries[-1],
        "widths": tuple(boundaries),
        "order": order,
        "max_label": int(label_values.max()) if label_values.size else None,
        "max_token_id": int(tf.reduce_max(ragged["input_ids"].flat_values)),
        "name": "text batches",
        "reads_per_host": True,
    }


def _batch_gatherer(ragged: dict, labels, rows: int):
    """``(indices, width, weights) -> (features, labels, weights)``: one batch of ``rows``
    rows padded to ``width``, with its attention mask. The batch dimension is static (a
    TPU needs it); the width is one of the boundaries."""
    import tensorflow as tf

    def gather(idx, width, weight):
        features = {}
        for column, values in ragged.items():
            batch = tf.gather(values, idx)
            features[column] = tf.ensure_shape(batch.to_tensor(shape=[rows, width]), [rows, None])
        mask = tf.sequence_mask(batch.row_lengths(), width, dtype=tf.int32)
        features["attention_mask"] = tf.ensure_shape(mask, [rows, None])
        labels_ = tf.ensure_shape(tf.gather(labels, idx), [rows])
        return features, labels_, tf.ensure_shape(weight, [rows])

    return gather


def _ragged(column, lengths, width: int):
    """A ``tf.RaggedTensor`` of a per-token column, each row cut to ``width``."""
    import tensorflow as tf

    tokens = np.concatenate([np.asarray(x[:width], np.int32) for x in column])
    return tf.RaggedTensor.from_row_lengths(tokens, np.minimum(lengths, width))
