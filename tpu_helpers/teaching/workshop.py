"""Checks behind the "check your answer" cells of the exercise notebooks.

Each ``check_*`` function tests the property one exercise is about, prints one line
starting with ``OK`` when it holds, and raises ``ExerciseCheckError`` (an
``AssertionError``) otherwise, with a message that says what is wrong and how to look at
it. The same cells run after the solutions in ``notebooks/``, so every check is exercised
by the notebooks' own runs; ``tests/test_workshop.py`` feeds each one wrong answers.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from tpu_helpers.core.errors import TpuHelpersError
from tpu_helpers.core.messages import say

__all__ = [
    "values_match",
    "ExerciseCheckError",
    "check_replica_total",
    "check_split",
    "check_widths",
    "check_compiled",
    "check_in_memory",
    "check_limit",
    "check_global_batch",
    "check_replica_loss",
    "check_parse_spec",
    "check_record_batches",
    "check_normalize",
    "check_head",
    "check_same_values",
    "check_static_loss",
    "check_positions",
    "check_schedule",
    "packed_segments",
    "check_attention_mask",
    "check_mask",
    "check_restarted_positions",
]


class ExerciseCheckError(TpuHelpersError, AssertionError):
    """An exercise's answer does not have the property the exercise is about."""


def _fail(exercise: str, message: str) -> None:
    raise ExerciseCheckError(f"Exercise {exercise}: {message}")


def _ok(exercise: str, message: str) -> None:
    say(f"OK  exercise {exercise}: {message}")


def _learners(function: Callable, exercise: str, *args):
    """``function(*args)`` (the learner's code), or a failed check that says where it broke."""
    from tpu_helpers.core.checks import first_line

    try:
        return function(*args)
    except Exception as err:  # noqa: BLE001  (any error of the learner's code)
        name = getattr(function, "__name__", "the function")
        _fail(exercise, f"{name}(...) raised {type(err).__name__}: {first_line(err)}")


# --- 00 ---------------------------------------------------------------------------------
def check_replica_total(total, replicas: int, exercise: str = "00.1") -> None:
    """Replica i contributed i + 1, summed over the replicas: N(N+1)/2."""
    expected = replicas * (replicas + 1) // 2
    try:
        value = float(np.asarray(total))
    except (TypeError, ValueError):
        _fail(exercise, f"total={total!r} is not one number: reduce the per-replica values.")
    if value == replicas != expected:  # on one replica, 1 is both: the right answer
        _fail(
            exercise,
            f"total is {value:g}, the number of replicas: every replica returned 1. Return"
            " tf.distribute.get_replica_context().replica_id_in_sync_group + 1.",
        )
    if value != expected:
        if replicas > 1 and value == expected / replicas:
            hint = " (that is the MEAN over the replicas: reduce with tf.distribute.ReduceOp.SUM)"
        elif replicas > 1 and value == expected - replicas:
            hint = " (replica ids count from 0: each replica returns its id + 1)"
        elif 1 <= value <= replicas:
            hint = (
                " (that is one replica's value: reduce with strategy.reduce(SUM, ..., axis=None))"
            )
        else:
            hint = ""
        _fail(exercise, f"total is {value:g}; {replicas} replica(s) give {expected}{hint}.")
    _ok(exercise, f"{replicas} replica(s) each ran the function; total {expected}")


def check_split(rows_per_replica, replicas: int, global_batch: int, exercise: str = "00.2"):
    """The first global batch, split: ``replicas`` lists of ``global_batch / replicas``
    distinct rows that together are rows 0 .. global_batch - 1."""
    try:
        rows = [sorted(int(v) for v in np.asarray(r).reshape(-1)) for r in rows_per_replica]
    except TypeError:
        _fail(exercise, "rows_per_replica must be a list with one list of rows per replica.")
    if len(rows) != replicas:
        _fail(
            exercise,
            f"{len(rows)} list(s) of rows for {replicas} replica(s): take"
            " strategy.experimental_local_results(batch), one value per replica.",
        )
    sizes = [len(r) for r in rows]
    if any(s != global_batch // replicas for s in sizes):
        _fail(
            exercise,
            f"replicas got {sizes} rows; a global batch of {global_batch} gives each of the"
            f" {replicas} replicas {global_batch // replicas}. Batch the dataset with the"
            " GLOBAL batch size before distributing it.",
        )
    every = sorted(v for r in rows for v in r)
    if every != list(range(global_batch)):
        _fail(
            exercise, f"the replicas' rows {every} are not the first batch 0..{global_batch - 1}."
        )
    _ok(exercise, f"{global_batch} rows split as {sizes[0]} per replica, none twice")


# --- 01 ---------------------------------------------------------------------------------
def check_widths(
    boundaries: Sequence[int],
    lengths: Sequence[int],
    max_length: int,
    max_shapes: int = 4,
    exercise: str = "01.1",
    one_width: bool = False,
) -> float:
    """Batch widths for a TPU: few (each one is an XLA compilation), multiples of 8,
    increasing, the widest holding the longest example (up to ``max_length``), and less
    padding than padding everything to the widest; a single width only with
    ``one_width`` (a run asked for ``padding="max_length"``) or when several would not
    help. Returns the real-token share and prints it next to the share of the helper's
    data-chosen widths."""
    from tpu_helpers.data import text

    widths = _checked_widths(boundaries, lengths, max_length, max_shapes, exercise)
    share = text.padding_report(lengths, widths).real_token_share
    single = text.padding_report(lengths, [widths[-1]]).real_token_share
    several = text.choose_boundaries(lengths, max_shapes=max_shapes, max_length=max_length)
    several_share = text.padding_report(lengths, several).real_token_share
    if len(widths) == 1 and not one_width and several_share > single + 0.05:
        _fail(
            exercise,
            f"one width pads every batch to {widths[0]}: {single:.1%} real tokens, while"
            f" {len(several)} widths can keep {several_share:.1%}. That padding is what this"
            f" exercise removes: choose 2 to {max_shapes} widths.",
        )
    if len(widths) > 1 and share <= single:
        _fail(
            exercise,
            f"these widths keep {share:.1%} real tokens, no better than padding everything to"
            f" {widths[-1]} ({single:.1%}). Put the narrow widths where most lengths are.",
        )
    best = text.padding_report(
        lengths, text.choose_boundaries(lengths, max_shapes=len(widths), max_length=max_length)
    ).real_token_share
    if len(widths) > 1 and share < single + 0.5 * (best - single):
        _fail(
            exercise,
            f"these widths keep {share:.1%} real tokens, little more than one width"
            f" ({single:.1%}), while {len(widths)} widths can keep {best:.1%}. Put the narrow"
            " widths where most lengths are (np.percentile of the lengths, rounded up to 8).",
        )
    _ok(
        exercise,
        f"widths {widths}: {share:.1%} real tokens (the best {len(widths)} width(s):"
        f" {best:.1%}, one width: {single:.1%})",
    )
    return share


def _checked_widths(
    boundaries: Sequence[int], lengths, max_length: int, max_shapes: int, exercise: str
) -> list[int]:
    """The widths of ``boundaries`` as a list, or a failed check when they are no widths
    or break the TPU's rules (see ``_tpu_width_problem``)."""
    from tpu_helpers.core.validate import check_boundaries

    try:
        widths = check_boundaries(boundaries)
    except (TypeError, ValueError) as err:
        _fail(exercise, str(err))
    problem = _tpu_width_problem(widths, lengths, max_length, max_shapes)
    if problem:
        _fail(exercise, problem)
    return widths


def _tpu_width_problem(widths: list[int], lengths, max_length: int, max_shapes: int) -> str | None:
    """What breaks the TPU's rules for widths, whatever the padding: too many of them, not
    multiples of 8, the widest too narrow for the longest example or past ``max_length``."""
    if len(widths) > max_shapes:
        return f"{len(widths)} widths: each is one more XLA compilation; use at most {max_shapes}."
    odd = [w for w in widths if w % 8]
    if odd:
        return (
            f"widths {odd} are not multiples of 8: a TPU lays tensors out in tiles of 8"
            " (x 128), so other widths are padded again on the chip. Round them up."
        )
    longest = min(int(np.max(lengths)), max_length)
    if widths[-1] < longest:
        return (
            f"the widest width {widths[-1]} is shorter than the longest example ({longest}"
            " tokens): those examples would be cut. Make the last width at least that."
        )
    if widths[-1] > max(max_length, longest) + 7:
        return f"the widest width {widths[-1]} exceeds max_length={max_length}."
    return None


def check_compiled(
    model, learning_rate: float, steps_per_execution: int | None = None, exercise: str = "01.2"
) -> None:
    """Compiled with Adam at the chosen learning rate (not Keras' default), a loss of class
    ids that takes logits, metrics that count the weight-0 filler rows as nothing and,
    when given, ``steps_per_execution`` steps per call."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        _fail(exercise, "the model is not compiled: call model.compile(...).")
    per_call = getattr(model, "_steps_per_execution", None)  # tf-keras: a variable
    if per_call is not None:
        per_call = int(per_call.numpy())
    else:  # Keras 3
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
    problem = (
        _optimizer_problem(optimizer, learning_rate)
        or _loss_problem(getattr(model, "loss", None), bool(getattr(model, "_using_dummy_loss", 0)))
        or _weighted_metrics_problem(model)
        or _steps_per_call_problem(per_call, steps_per_execution)
    )
    if problem:
        _fail(exercise, problem)
    rate = _learning_rate_of(optimizer)
    _ok(exercise, f"Adam at {rate:g}, loss from logits, weighted metrics, {per_call} steps a call")


def _learning_rate_of(optimizer) -> float:
    rate = optimizer.learning_rate
    return float(rate(0)) if callable(rate) else float(np.asarray(rate))


def _optimizer_problem(optimizer, learning_rate: float) -> str | None:
    if "adam" not in type(optimizer).__name__.lower():
        return (
            f"the optimizer is {type(optimizer).__name__}; the task asks for Adam, what"
            " BERT-style models are fine-tuned with: tf.keras.optimizers.Adam(learning_rate=...)."
        )
    rate = _learning_rate_of(optimizer)
    if not math.isclose(rate, learning_rate, rel_tol=1e-6):
        return (
            f"the optimizer's learning rate is {rate:g}, not learning_rate={learning_rate:g}"
            " (optimizer='adam' uses Keras' 1e-3, far too high for fine-tuning). Pass"
            " tf.keras.optimizers.Adam(learning_rate=learning_rate)."
        )
    return None


def _loss_problem(loss, models_own_loss: bool = False) -> str | None:
    """``loss`` as passed to ``compile``. ``models_own_loss``: none was, and a transformers
    model computes its own from the labels (the Hugging Face idiom): a right answer, the
    sample weights apply to it as to Keras' loss (the same values, seen on a batch with
    fillers)."""
    if models_own_loss:
        return None
    if loss is None or isinstance(loss, str):
        return (
            f"loss={loss!r}: the model returns logits, so pass"
            " tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)."
        )
    kind = type(loss).__name__
    if "Sparse" not in kind:
        return (
            f"{kind} expects one-hot label rows, and these labels are class ids (0, 1, ...):"
            " use tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)."
        )
    if not getattr(loss, "get_config", lambda: {})().get("from_logits", False):
        return (
            "the loss does not take logits: the classifier's outputs are logits, so use"
            " from_logits=True (the loss would be computed on the wrong numbers)."
        )
    return None


def _weighted_metrics_problem(model) -> str | None:
    compiled = getattr(model, "_compile_config", None)  # Keras 3: compile's own arguments
    if compiled is not None:
        weighted = compiled.config.get("weighted_metrics")
    else:  # tf-keras
        weighted = getattr(model.compiled_metrics, "_user_weighted_metrics", None)
    if not weighted:
        return (
            "no weighted_metrics: the last batch is completed with copies weighted 0, and"
            " plain metrics count them. Pass weighted_metrics=['accuracy']."
        )
    return None


def _steps_per_call_problem(per_call: int, steps_per_execution: int | None) -> str | None:
    if steps_per_execution is not None and per_call != steps_per_execution:
        return (
            f"the model runs {per_call} step(s) per call to the TPU, not"
            f" steps_per_execution={steps_per_execution}: pass"
            " steps_per_execution=steps_per_execution to compile (fewer round trips from the"
            " host)."
        )
    return None


# --- 02 ---------------------------------------------------------------------------------
def check_global_batch(
    global_batch, per_replica_batch: int, replicas: int, exercise: str = "02.1"
) -> None:
    """The global batch is the per-replica batch times the replicas."""
    if global_batch == per_replica_batch and replicas > 1:
        _fail(
            exercise,
            f"global_batch={global_batch} is one replica's batch: each of the {replicas}"
            f" replicas takes {per_replica_batch} rows, so a step takes"
            f" {per_replica_batch * replicas}.",
        )
    if global_batch != per_replica_batch * replicas:
        _fail(
            exercise,
            f"global_batch={global_batch!r}; {replicas} replica(s) x {per_replica_batch} rows"
            f" = {per_replica_batch * replicas}.",
        )
    _ok(exercise, f"{replicas} x {per_replica_batch} = {global_batch} rows per step")


def check_replica_loss(
    replica_loss: Callable, global_batch: int, replicas, exercise: str = "02.2"
) -> None:
    """Summed over the replicas (as the gradients are), each replica's loss must give the
    weighted mean over the global batch: per-example losses summed and divided by the
    GLOBAL batch, not averaged per replica.

    ``replicas``: the strategy the loop runs on (the answer is called as the loop calls
    it, inside ``strategy.run`` on every replica, where ``tf.nn.compute_average_loss``
    finds the replicas itself), or a number of replicas (called on each replica's rows
    outside any strategy)."""
    import tensorflow as tf

    strategy = None if isinstance(replicas, int) else replicas
    if strategy is not None:
        replicas = strategy.num_replicas_in_sync
    rows = global_batch // replicas
    rng = np.random.default_rng(0)
    per_example = rng.uniform(0.1, 3.0, size=(replicas, rows)).astype(np.float32)
    per_example[-1, -1] = 0.0  # a weight-0 filler row: its loss arrives multiplied by 0
    expected = per_example.sum() / global_batch
    try:
        if strategy is None:
            parts = [float(replica_loss(tf.constant(p), global_batch)) for p in per_example]
        else:
            parts = _on_every_replica(strategy, replica_loss, per_example, global_batch)
    except Exception as err:  # noqa: BLE001  (the learner's code: say where it failed)
        _fail(exercise, f"replica_loss(per_example, global_batch) raised {err!r}.")
    total = sum(parts)
    if math.isclose(total, expected * replicas, rel_tol=1e-4) and replicas > 1:
        _fail(
            exercise,
            f"summed over {replicas} replicas the loss is {total:.4f}, {replicas}x the mean"
            f" ({expected:.4f}): each replica divided by its own {rows} rows. Divide by"
            " global_batch (tf.nn.compute_average_loss(..., global_batch_size=global_batch)).",
        )
    if not math.isclose(total, expected, rel_tol=1e-4):
        _fail(
            exercise,
            f"summed over {replicas} replica(s) the loss is {total:.4f}; the mean over the"
            f" global batch is {expected:.4f}. Sum the per-example losses and divide by"
            " global_batch.",
        )
    _ok(exercise, f"the replicas' losses add up to the global mean ({expected:.4f})")


def _on_every_replica(strategy, replica_loss, per_example, global_batch) -> list[float]:
    """``replica_loss`` run by ``strategy.run`` on every replica, replica ``i`` given row
    ``i`` of ``per_example``: each replica's value."""
    import tensorflow as tf

    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(per_example[context.replica_id_in_sync_group])
    )

    @tf.function
    def run(values):
        return strategy.run(lambda p: replica_loss(p, global_batch), args=(values,))

    return [float(x) for x in strategy.experimental_local_results(run(values))]


# --- 03 ---------------------------------------------------------------------------------
def check_record_batches(
    batches, source, boundaries, global_batch: int, seed: int = 0, exercise: str = "03.2"
) -> None:
    """The training stream of ``source``: a ``pipeline.Batches`` (what ``read_records``
    returns: any epoch from any step, which resuming needs), of ``global_batch`` rows per
    step (all replicas, not one), padded to ``boundaries``, shuffled with ``seed``."""
    from tpu_helpers.data import records

    _check_batches_of_global_steps(batches, global_batch, exercise)

    def first_epoch(plan):  # each step's width and labels
        return [(f["input_ids"].shape[1], y.numpy().tolist()) for f, y, _ in plan.dataset(0)]

    def read(**options):
        plan = records.read_records(
            source, global_batch=global_batch, boundaries=boundaries, **options
        )
        return first_epoch(plan)

    mine, expected = first_epoch(batches), read(seed=seed)
    if sorted(w for w, _ in mine) != sorted(w for w, _ in expected):
        widths = sorted({w for w, _ in mine})
        _fail(
            exercise,
            f"its batches are padded to {widths}, not to the widths chosen, {list(boundaries)}."
            " Fix: boundaries=boundaries.",
        )
    if mine != expected:
        why = f"it is shuffled with another seed than {seed}"
        if mine == read(shuffle=False):
            why = "it is not shuffled"
        _fail(
            exercise,
            f"the epoch's batches are not those of the run: {why} (a run that resumes must"
            f" draw the same order from the same seed). Fix: seed={seed}, and leave shuffle on.",
        )
    steps = f"{batches.steps_per_epoch} steps of {global_batch} rows"
    _ok(exercise, f"{steps}, widths {list(boundaries)}, seed {seed}")


def _check_batches_of_global_steps(batches, global_batch: int, exercise: str) -> None:
    """``batches`` is a ``pipeline.Batches`` whose steps take ``global_batch`` rows (the
    rows of all replicas, not one replica's share)."""
    from tpu_helpers.core.pipeline import Batches

    if not isinstance(batches, Batches):
        _fail(
            exercise,
            f"`train_batches` is a {type(batches).__name__}, not the pipeline.Batches that"
            " records.read_records returns: training needs every epoch from any step (to"
            " resume) and the steps per epoch. Fix: records.read_records(source,"
            " global_batch=..., boundaries=..., seed=...).",
        )
    if batches.global_batch != global_batch:
        share = global_batch // batches.global_batch
        one_replica = share > 1 and share * batches.global_batch == global_batch
        _fail(
            exercise,
            f"its steps take {batches.global_batch} rows, the global batch is {global_batch}"
            + (f" (that is one replica's share of {share})" if one_replica else "")
            + ": read_records takes the rows of a whole step over every replica. Fix:"
            " global_batch=global_batch.",
        )


def check_parse_spec(
    spec: dict,
    source,
    rows,
    exercise: str = "03.1",
    records: int = 64,
    *,
    compression: str = "",
):
    """``spec`` parses the first ``records`` records of the first shard of ``source`` into
    examples that are rows of ``rows`` (``input_ids`` and ``label``, as written).
    ``source`` is an ``open_records`` result, or the path of a shard written by hand (its
    ``compression`` then given), whose features are read from its first record."""
    import tensorflow as tf

    if not isinstance(spec, dict) or not spec:
        _fail(exercise, "spec must be a dict from feature name to tf.io.*Feature.")
    columns, shard, compression = _columns_shard_compression(source, compression)
    missing = [c for c in columns if c not in spec]
    if missing:
        _fail(exercise, f"spec has no entry for {missing}; the records hold {columns}.")
    extra = [k for k in spec if k not in columns]
    if extra:
        _fail(exercise, f"spec names {extra}, which the records do not hold ({columns}).")
    raw = tf.data.TFRecordDataset([shard], compression_type=compression or "")
    known = {
        (tuple(ids), int(label))
        for ids, label in zip(rows["input_ids"], rows["label"], strict=True)
    }
    parsed_count = 0
    for serialized in raw.take(records):
        parsed_count += 1
        ids, label = _parsed_ids_and_label(serialized, spec, exercise)
        if (ids, label) not in known:
            _fail(
                exercise,
                f"a record parsed to input_ids {list(ids)[:12]}... label {label},"
                " which is no row of the data written: check the dtypes (tf.int64) and that"
                " nothing is padded or cut.",
            )
    _ok(
        exercise,
        f"{parsed_count} record(s) of {shard.rsplit('/', 1)[-1]} parse to rows written",
    )


def _columns_shard_compression(source, compression: str) -> tuple[list[str], str, str]:
    """``(columns, shard, compression)`` of ``source``: an ``open_records`` result (its
    features, first shard and compression), or the path of a shard written by hand
    (``compression`` as given, the features read from its first record)."""
    import tensorflow as tf

    if isinstance(source, str):
        shard = source
        first = next(iter(tf.data.TFRecordDataset([shard], compression_type=compression or "")))
        columns = sorted(tf.train.Example.FromString(first.numpy()).features.feature)
        return columns, shard, compression
    return list(source.features), source.shards[0].path, source.compression


def _parsed_ids_and_label(serialized, spec: dict, exercise: str) -> tuple[tuple[int, ...], int]:
    """``(input_ids, label)`` of one record parsed with the learner's ``spec``, or a failed
    check when it does not parse or holds other than one label."""
    import tensorflow as tf

    try:
        parsed = tf.io.parse_single_example(serialized, spec)
    except (tf.errors.InvalidArgumentError, ValueError, TypeError) as err:
        first = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(err).strip())
        first = first.splitlines()[0][:300]
        _fail(
            exercise,
            f"parsing a record with this spec failed: {first}. Each record holds"
            " input_ids of ITS OWN length (unpadded) and one label: a fixed-length"
            " feature needs that exact length.",
        )
    ids = parsed["input_ids"]
    if isinstance(ids, tf.SparseTensor):
        ids = tf.sparse.to_dense(ids)
    elif isinstance(ids, tf.RaggedTensor):
        ids = ids.to_tensor()
    label = np.asarray(parsed["label"]).reshape(-1)
    if label.size != 1:
        _fail(exercise, f"label parsed to {label.size} values; each record has one.")
    return tuple(int(v) for v in np.asarray(ids).reshape(-1)), int(label[0])


# --- 04 ---------------------------------------------------------------------------------
def check_normalize(
    normalize: Callable,
    spec,
    pixel_values,
    processor=None,
    exercise: str = "04.1",
    channels_last: bool = False,
) -> None:
    """``normalize`` takes 0-255 pixels ``[B, H, W, 3]`` and gives what the model takes,
    ``[B, 3, H, W]`` (``channels_last=True``: ``[B, H, W, 3]``, as KerasHub's ViT takes
    them), as the pipeline (``spec``) made ``pixel_values`` (channels first). With the
    ``processor`` that ``normalize`` reads, it is also run with other constants put in
    the processor for a moment: numbers written into the code (ViT's 0.5) fail then. Pass
    ``spec`` itself as the processor where the learner reads the constants from it."""
    from tpu_helpers.data.images import pixels_of

    expected = np.asarray(pixel_values, np.float64)
    pixels = pixels_of(expected, spec)
    if channels_last:
        normalize = _channels_first_of(normalize, pixels.shape, exercise)
    got = _normalized(normalize, pixels, exercise)
    _compare_normalized(got, expected, pixels, spec, exercise)
    if processor is not None:
        _check_reads_processor(normalize, pixels, processor, spec, exercise)
    error = float(np.abs(got - expected).max())
    _ok(exercise, f"normalize reproduces the processor's numbers (max difference {error:.1e})")


def _channels_first_of(normalize: Callable, shape, exercise: str) -> Callable:
    """``normalize`` that keeps the images' layout, its result read channels first (as the
    pipeline's ``pixel_values`` are compared); a result in another layout is refused."""

    def channels_first(pixels):
        got = np.asarray(normalize(pixels), np.float64)
        if got.shape != tuple(shape):
            raise _LayoutChanged(
                f"normalize gave shape {got.shape}; KerasHub's ViT takes the images' own"
                f" layout, {tuple(shape)} (channels last): leave the axes where they are."
            )
        return np.moveaxis(got, -1, -3)

    return channels_first


class _LayoutChanged(TpuHelpersError, ValueError):
    """The learner's normalize moved the axes where the model takes them as they are."""


def _normalized(normalize: Callable, pixels, exercise: str):
    try:
        return np.asarray(normalize(pixels), np.float64)
    except _LayoutChanged as err:
        _fail(exercise, str(err))
    except Exception as err:  # noqa: BLE001  (the learner's code: say where it failed)
        _fail(exercise, f"normalize(pixels) raised {err!r}.")


def _check_reads_processor(normalize: Callable, pixels, processor, spec, exercise: str) -> None:
    """Run ``normalize`` with other constants in ``processor`` and in ``spec`` (read from
    it: ``spec.mean`` is as right as ``processor.image_mean``), then put them back."""
    other = {
        "rescale_factor": 1 / 127.5,
        "image_mean": [0.1, 0.2, 0.3],
        "image_std": [0.3, 0.4, 0.5],
    }
    swapped = {**other, "do_rescale": True, "do_normalize": True}
    in_spec = {"rescale_factor": other["rescale_factor"], "do_normalize": True}
    in_spec.update(mean=tuple(other["image_mean"]), std=tuple(other["image_std"]))
    with _swapped(processor, swapped), _swapped(spec, in_spec):
        got = _normalized(normalize, pixels, exercise)
    x = np.asarray(pixels, np.float64) * other["rescale_factor"]
    want = np.moveaxis((x - other["image_mean"]) / np.asarray(other["image_std"]), -1, -3)
    if got.shape != want.shape or float(np.abs(got - want).max()) > 1e-3:
        where = (  # the main track gives the spec alone (no processor without PyTorch)
            "spec.rescale_factor, spec.mean and spec.std"
            if processor is spec
            else "processor.rescale_factor, processor.image_mean and processor.image_std"
        )
        _fail(
            exercise,
            "with other constants in the processor (mean, std, rescale factor of another"
            " checkpoint) normalize gave the same kind of numbers as before: the constants are"
            f" written into the code. Read them from {where}, so the code fits any checkpoint.",
        )


@contextlib.contextmanager
def _swapped(obj, values: dict):
    """``obj`` with ``values`` set for a moment (a frozen dataclass too), then as it was:
    the values it had, and no attribute it did not have."""
    missing = object()
    saved = {name: getattr(obj, name, missing) for name in values}
    try:
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, value)


def _compare_normalized(got, expected, pixels, spec, exercise: str) -> None:
    if got.shape != expected.shape:
        hint = " Channels go first: np.moveaxis(x, -1, -3)." if got.shape == pixels.shape else ""
        _fail(
            exercise, f"normalize gave shape {got.shape}, the model takes {expected.shape}.{hint}"
        )
    error = float(np.abs(got - expected).max())
    channels_last = np.moveaxis(expected, -3, -1)  # the right numbers, laid out wrong:
    layouts = {  # what a reshape or another transpose makes of them
        "a reshape, which keeps the numbers' order and so mixes the channels": (
            channels_last.reshape(expected.shape)
        ),
        "a transpose that swaps height and width": np.transpose(channels_last, (0, 3, 2, 1)),
    }
    for how, laid_out in layouts.items():
        if error > 1e-3 and laid_out.shape == got.shape and np.abs(got - laid_out).max() < 1e-3:
            _fail(
                exercise,
                f"the numbers are right, their layout is not: channels were put first by {how}."
                " Fix: np.moveaxis(x, -1, 1) (or np.transpose(x, (0, 3, 1, 2))).",
            )
    if error > 1e-3:
        per_channel = np.abs(got - expected).mean(axis=(0, 2, 3))
        _fail(
            exercise,
            f"off by up to {error:.3f} (mean per channel {np.round(per_channel, 3).tolist()})."
            f" The processor rescales by {spec.rescale_factor:g}, then"
            + (
                f" subtracts mean {list(spec.mean)} and divides by std {list(spec.std)}"
                if spec.do_normalize
                else " does not normalize"
            )
            + " (processor.rescale_factor, processor.image_mean, processor.image_std).",
        )


def _main_layer_weights(model) -> dict[str, np.ndarray]:
    """The weights of a transformers TF model's main layer (``model.<base_model_prefix>``,
    the encoder without any head), by name without the model's own scope."""
    main = getattr(model, model.base_model_prefix)
    return {w.name.split("/", 1)[-1]: w for w in main.weights}


def _pretrained_share(model, checkpoint: str) -> tuple[int, int]:
    """(weights of ``model``'s encoder equal to ``checkpoint``'s, weights compared)."""
    from transformers import TFAutoModel

    from tpu_helpers.tf_engine import tf_classes

    reference = _main_layer_weights(tf_classes.from_pretrained(TFAutoModel, checkpoint))
    mine = _main_layer_weights(model)
    common = sorted(set(reference) & set(mine))
    same = sum(np.array_equal(reference[n].numpy(), mine[n].numpy()) for n in common)
    return same, len(common)


def check_head(
    model, class_names: Sequence[str], checkpoint: str | None = None, exercise: str = "04.2"
) -> None:
    """A new classification head: one output per class, named by ``id2label`` and
    ``label2id``, on the encoder of ``checkpoint`` (when given: its weights, not a random
    start such as ``from_config`` makes)."""
    config = model.config
    if config.num_labels != len(class_names):
        _fail(
            exercise,
            f"the model has {config.num_labels} outputs for {len(class_names)} classes: pass"
            " num_labels=len(class_names) and ignore_mismatched_sizes=True.",
        )
    names = [config.id2label[i] for i in range(config.num_labels)]
    if names != list(class_names):
        _fail(
            exercise,
            f"id2label gives {names}, the data's classes are {list(class_names)}: pass"
            " id2label=dict(enumerate(class_names)) (and label2id) so predictions read as"
            " class names.",
        )
    wanted = {name: i for i, name in enumerate(class_names)}
    if dict(getattr(config, "label2id", {}) or {}) != wanted:
        shown = dict(list((config.label2id or {}).items())[:3])
        _fail(
            exercise,
            f"label2id is {shown}{' ...' if len(config.label2id or {}) > 3 else ''}, not"
            f" {wanted}: pass label2id={{name: i for i, name in enumerate(class_names)}} too"
            " (pipelines and the saved config map names back to ids with it).",
        )
    if checkpoint is not None:
        same, compared = _pretrained_share(model, checkpoint)
        if compared == 0 or same < compared:
            _fail(
                exercise,
                f"{compared - same} of the encoder's {compared} weights differ from"
                f" {checkpoint}'s: the model starts from random weights (from_config builds"
                " an untrained model). Fix: TFAutoModelForImageClassification.from_pretrained"
                "(model_checkpoint, ...) keeps the pretrained encoder and replaces only the"
                " head.",
            )
    _ok(exercise, f"{len(class_names)} outputs named {names}, on the pretrained encoder")


# --- 05 ---------------------------------------------------------------------------------
def values_match(run: Callable, reference: Callable, inputs, exercise: str, fix: str) -> None:
    """``run(*args)`` (the learner's function, called as the check calls it) equals
    ``reference(*args)`` for each of ``inputs`` (a tuple of arguments, or one argument);
    the first input that differs fails the check with ``fix``."""
    for args in inputs:
        args = args if isinstance(args, tuple) else (args,)
        want = np.asarray(reference(*args))
        got = np.asarray(run(*args))
        if want.shape != got.shape or not np.allclose(want, got, rtol=1e-5, atol=1e-6):
            _fail(
                exercise,
                f"for input {np.asarray(args[0]).tolist()} it gives {got.tolist()}, the"
                f" original gives {want.tolist()}: {fix}.",
            )


def check_same_values(function: Callable, reference: Callable, inputs, exercise: str = "05.1"):
    """``function`` gives ``reference``'s value (run eagerly, where a Python ``if`` works)
    on each of ``inputs`` (both sides of the condition, and its edge, belong there), and
    XLA compiles it as written, without AutoGraph's rewriting of a Python ``if``."""
    import tensorflow as tf

    from tpu_helpers.tf_engine import xla

    run = lambda *args: _learners(function, exercise, *args)  # noqa: E731
    values_match(run, reference, inputs, exercise, "both branches must still be computed")
    first = inputs[0] if isinstance(inputs[0], tuple) else (inputs[0],)
    try:
        xla.compiled_hlo(function, *first)
    except Exception as err:  # noqa: BLE001  (the compiler's error, translated)
        rule, _, fix = xla.translate_xla_error(err)
        _fail(exercise, f"XLA cannot compile it: {rule}. Fix: {fix}")
    try:  # as written, without AutoGraph turning a Python `if` into tf.cond
        xla.compiled_hlo(tf.autograph.experimental.do_not_convert(function), *first)
    except Exception:  # noqa: BLE001  (the learner's code: say what it relies on)
        _fail(
            exercise,
            "it still branches with a Python `if` on a tensor's value: it compiles only"
            " because AutoGraph rewrites that `if` into tf.cond in a tf.function (code"
            " AutoGraph does not convert, or a value read with .numpy(), fails). Fix:"
            " compute the count whatever the condition, and pick with tf.where.",
        )
    _ok(exercise, f"same values as the original on {len(inputs)} inputs, and XLA compiles it")


def check_static_loss(
    loss_fn: Callable, labels, logits, reference: float, exercise: str = "05.2"
) -> None:
    """The loss equals ``reference`` (the boolean-mask loss), compiles without
    value-dependent shapes, and gives 0 (not NaN) when every label is masked."""
    import tensorflow as tf

    from tpu_helpers.tf_engine import xla

    value = float(_learners(loss_fn, exercise, labels, logits))
    if not math.isclose(value, float(reference), rel_tol=1e-5, abs_tol=1e-6):
        _fail(
            exercise,
            f"the loss is {value:.5f}, the boolean-mask loss {float(reference):.5f}: multiply"
            " each position's loss by a 0/1 mask and divide by the mask's sum.",
        )
    dynamic = xla.dynamic_shape_ops(xla.compiled_hlo(loss_fn, labels, logits))
    if dynamic:
        _fail(exercise, f"the compiled program still has value-dependent shapes: {dynamic}.")
    empty = float(_learners(loss_fn, exercise, tf.fill(tf.shape(labels), -100), logits))
    if not math.isfinite(empty):
        _fail(
            exercise,
            f"a batch with every label masked gives {empty}: divide by tf.maximum(mask_sum, 1.0).",
        )
    _ok(exercise, "same loss, static shapes, an all-masked batch gives 0")


# --- 06 ---------------------------------------------------------------------------------
def check_positions(
    positions, model_type: str, block_size: int, pad_token_id=None, exercise: str = "06.1"
):
    """Position embeddings that hold a block: RoBERTa numbers positions from
    ``pad_token_id + 1`` (2 with its usual pad id 1), so it needs ``block_size + 2``;
    BERT ``block_size``."""
    from transformers import AutoConfig

    from tpu_helpers.core.families import position_limit

    if not isinstance(positions, int | np.integer) or positions < 1:
        _fail(exercise, f"positions={positions!r} must be a positive integer.")
    extra = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    config = AutoConfig.for_model(model_type, max_position_embeddings=int(positions), **extra)
    limit = position_limit(config)
    offset = 0 if limit is None else int(positions) - limit  # rows no token position uses
    if limit is not None and limit < block_size:
        _fail(
            exercise,
            f"{positions} positions hold {limit} tokens of a {model_type} model (it skips"
            f" the first {offset}), fewer than block_size={block_size}. Fix:"
            f" {block_size + offset}.",
        )
    if int(positions) > block_size + offset:
        _fail(
            exercise,
            f"{positions} positions, {int(positions) - block_size - offset} never used:"
            f" embeddings that no block reaches stay random. {block_size + offset} is enough.",
        )
    _ok(exercise, f"{positions} positions hold blocks of {block_size} for {model_type}")


def check_schedule(
    schedule: Callable,
    learning_rate: float,
    total_steps: int,
    warmup_fraction: float,
    exercise: str = "06.2",
    optimizer=None,
    weight_decay: float | None = None,
) -> None:
    """Warm up linearly from 0 to ``learning_rate`` over ``warmup_fraction`` of the steps
    (halfway there at half the warmup), then decay to 0 at ``total_steps``; with
    ``optimizer``, its weight decay is ``weight_decay``."""
    warmup = int(warmup_fraction * total_steps)

    def at(step):
        return float(schedule(step))

    _check_warmup(at, learning_rate, warmup, exercise)
    if optimizer is not None and weight_decay is not None:
        _check_weight_decay(optimizer, weight_decay, exercise)
    _check_decay(at, learning_rate, warmup, total_steps, exercise)
    _ok(exercise, f"0 -> {learning_rate:g} in {warmup} steps, 0 at step {total_steps}")


def _check_warmup(at: Callable, learning_rate: float, warmup: int, exercise: str) -> None:
    """The rate ``at(step)`` rises linearly from 0 to ``learning_rate`` over ``warmup``
    steps (halfway there at half the warmup)."""
    start = at(0)
    # round() or ceil() for the warmup's steps end it one step later: also right
    peak = max(at(warmup), at(warmup + 1), key=lambda rate: -abs(rate - learning_rate))
    if warmup > 1 and start > 0.5 * learning_rate:
        _fail(
            exercise,
            f"the rate starts at {start:g}: training, whether from scratch or from a"
            f" checkpoint with a new optimizer, needs a warmup from 0 over {warmup} steps"
            " (num_warmup_steps).",
        )
    if not math.isclose(peak, learning_rate, rel_tol=0.01):
        _fail(
            exercise,
            f"after warmup ({warmup} steps) the rate is {peak:g}, not {learning_rate:g}: the"
            f" warmup must end at step {warmup} (num_warmup_steps is a number of steps,"
            " int(warmup_fraction * total_steps)).",
        )
    if warmup < 4:  # too few steps to judge the rise by (a short run has none at all)
        return
    half = warmup // 2
    rising = [learning_rate * half / steps for steps in (warmup, warmup + 1)]
    if not any(math.isclose(at(half), r, rel_tol=0.1) for r in rising):
        _fail(
            exercise,
            f"halfway through the warmup (step {half}) the rate is {at(half):g}, not about"
            f" {learning_rate * half / warmup:g}: the warmup must rise over {warmup} steps."
            " num_warmup_steps is a number of steps, int(warmup_fraction * total_steps).",
        )


def _check_decay(
    at: Callable, learning_rate: float, warmup: int, total_steps: int, exercise: str
) -> None:
    """After ``warmup`` steps the rate ``at(step)`` decays (linearly or as a cosine) to 0
    at ``total_steps``, the last step of the whole run."""
    end = at(total_steps)
    if end > 0.05 * learning_rate:
        _fail(
            exercise,
            f"at the last step ({total_steps}) the rate is still {end:g}: decay it to 0 over"
            " num_train_steps=total_steps.",
        )
    # three quarters into the decay a quarter of the peak is left (a linear decay; a
    # cosine one leaves 15 %): a decay that ends early (num_train_steps of one epoch, or
    # less the warmup) has reached 0 or nearly, one that ends late has more left
    if total_steps - warmup < 8:  # too few steps to judge the decay's shape by
        return
    late = warmup + 3 * (total_steps - warmup) // 4
    left = [(total_steps - late) / (total_steps - w) for w in (warmup, warmup + 1)]
    expected = [learning_rate * f for f in left]
    expected += [learning_rate * 0.5 * (1 + math.cos(math.pi * (1 - f))) for f in left]
    if not any(math.isclose(at(late), e, rel_tol=0.05) for e in expected):
        _fail(
            exercise,
            f"at step {late}, three quarters into the decay, the rate is {at(late):g}, not"
            f" about {expected[0]:g} (a linear decay) or {expected[2]:g} (a cosine one): the"
            " decay must reach 0 at the last step of the whole run, num_train_steps="
            f"total_steps ({total_steps}: every epoch, warmup included); Keras' CosineDecay"
            " decays over decay_steps after its warmup_steps.",
        )


def _check_weight_decay(optimizer, weight_decay: float, exercise: str) -> None:
    """transformers' ``AdamWeightDecay`` keeps it in ``weight_decay_rate``, Keras' AdamW in
    ``weight_decay``."""
    rate = getattr(optimizer, "weight_decay_rate", None)
    if rate is None:
        rate = getattr(optimizer, "weight_decay", None)
    rate = float(rate or 0.0)
    if not math.isclose(rate, weight_decay, rel_tol=1e-6, abs_tol=1e-12):
        _fail(
            exercise,
            f"the optimizer's weight decay is {rate:g}, not weight_decay={weight_decay:g}:"
            " create_optimizer(..., weight_decay_rate=weight_decay), or on Keras 3"
            " keras.optimizers.AdamW(schedule, weight_decay=weight_decay).",
        )


# --- 07 ---------------------------------------------------------------------------------
def packed_segments() -> np.ndarray:
    """Segment ids of three packed rows of 10 tokens, as ``packing.packed_arrays`` makes
    them: 1, 2, ... per example, 0 for padding (a full row, a padded one, one example)."""
    return np.array(
        [
            [1, 1, 1, 2, 2, 3, 3, 3, 3, 3],
            [1, 1, 2, 2, 2, 2, 3, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        ],
        np.int32,
    )


def _answer_array(function: Callable, segments: np.ndarray, exercise: str) -> np.ndarray:
    got = _learners(function, exercise, segments)
    return np.asarray(got.numpy() if hasattr(got, "numpy") else got)


def check_attention_mask(allowed: Callable, exercise: str = "07.1") -> None:
    """``allowed(segment_ids)`` gives ``[rows, T, T]`` booleans: query ``i`` may see key
    ``j`` when both are tokens of the same example (padding is seen by no one)."""
    segments = packed_segments()  # the rule in NumPy: the check serves both tracks
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)

    def why(i, j, kj, wanted):
        if wanted:
            return "tokens of the same example must see each other"
        if kj == 0:
            return "a padding key must be hidden (segment 0): and-combine with segment_ids > 0"
        return "tokens of different examples must not see each other"

    check_mask(allowed, same, why, exercise)
    _ok(exercise, "each token sees exactly the tokens of its own example")


def check_mask(allowed: Callable, want: np.ndarray, why: Callable, exercise: str) -> None:
    """``allowed(packed_segments())`` against ``want`` (``[rows, T, T]`` booleans); at the
    first wrong entry ``why(i, j, key's segment, wanted)`` says the rule it breaks."""
    segments = packed_segments()
    got = _answer_array(allowed, segments, exercise)
    rows, width = segments.shape
    if got.shape != want.shape:
        _fail(
            exercise,
            f"the mask has shape {list(got.shape)}; it needs one row per query token:"
            f" [rows, T, T] = {[rows, width, width]} (compare segment_ids[:, :, None] with"
            " segment_ids[:, None, :]).",
        )
    got = got.astype(bool)
    wrong = np.argwhere(got != want)
    if len(wrong):
        r, i, j = (int(v) for v in wrong[0])
        qi, kj = int(segments[r, i]), int(segments[r, j])
        _fail(
            exercise,
            f"row {r}, query {i} (segment {qi}) and key {j} (segment {kj}): the mask says"
            f" {bool(got[r, i, j])}, but {why(i, j, kj, bool(want[r, i, j]))}."
            f" {len(wrong)} of {got.size} entries differ.",
        )


def check_restarted_positions(positions: Callable, exercise: str = "07.2") -> None:
    """``positions(segment_ids)`` gives each token's position inside its example (0 at
    every example's first token) and 0 on padding: what ``packed_arrays`` makes."""
    segments = packed_segments()
    want = np.zeros_like(segments)
    for r, row in enumerate(segments):
        for i in range(1, len(row)):
            want[r, i] = want[r, i - 1] + 1 if row[i] == row[i - 1] and row[i] > 0 else 0
    got = _answer_array(positions, segments, exercise)
    if got.shape != want.shape:
        _fail(exercise, f"the positions have shape {list(got.shape)}, not {list(want.shape)}.")
    if np.array_equal(got, np.broadcast_to(np.arange(segments.shape[1]), segments.shape)):
        _fail(
            exercise,
            "positions count along the whole row: they must restart at 0 at each example,"
            " as if it were alone (the model learned positions of single sentences).",
        )
    wrong = np.argwhere(got != want)
    if len(wrong):
        r, i = (int(v) for v in wrong[0])
        hint = (
            " Padding (segment 0) gets position 0."
            if segments[r, i] == 0
            else " The first token of each example is at 0."
        )
        _fail(
            exercise,
            f"row {r}, token {i} (segment {int(segments[r, i])}): position {int(got[r, i])},"
            f" not {int(want[r, i])}.{hint}",
        )
    _ok(exercise, "positions restart at 0 at every example")


# --- 09 ---------------------------------------------------------------------------------
def check_in_memory(dataset, features: dict, labels, global_batch: int, exercise: str = "09.1"):
    """The tutorial's pipeline made for a TPU: ``(features, label)`` elements of the arrays
    in ``features`` and ``labels``, the rows shuffled over the whole set (not batches, not
    a window), in batches of ``global_batch`` rows that all have one shape."""
    _check_in_memory_dataset(dataset, exercise)
    ids, labels = np.asarray(features["input_ids"]), np.asarray(labels)
    if len(ids) < global_batch:
        _fail(
            exercise,
            f"the data set has {len(ids)} rows, fewer than one global batch of"
            f" {global_batch}: no full batch exists. Fix: a smaller per_replica_batch or more"
            " data.",
        )
    batches = [(f["input_ids"], y) for f, y in dataset.as_numpy_iterator()]
    _check_in_memory_rows([len(y) for _, y in batches], global_batch, exercise)
    first = _row_indices(ids, labels, *batches[0], exercise)
    if first == list(range(first[0], first[0] + len(first))):
        _fail(
            exercise,
            f"the first batch is rows {first[0]}..{first[-1]} in the data set's order: "
            + ("it is not shuffled" if first[0] == 0 else "whole batches are shuffled")
            + ", so every epoch puts the same rows together. Fix: .shuffle(...) before"
            " .batch(...).",
        )
    if len(ids) >= 8 * global_batch and max(first) < len(ids) // 4:
        _fail(
            exercise,
            f"the first batch comes from the first {max(first) + 1} of {len(ids)} rows: the"
            " shuffle buffer holds only part of the set, so rows move only within a window."
            " Fix: .shuffle(len(labels)), a buffer as large as the set (it is in memory).",
        )
    again = next(dataset.as_numpy_iterator())[0]["input_ids"]
    if np.array_equal(again, batches[0][0]):
        _fail(
            exercise,
            "a second epoch starts with the same batch as the first: the order is drawn once"
            " (reshuffle_each_iteration=False, or a .cache() after the shuffle), so every"
            " epoch repeats it. Fix: shuffle last before batching, reshuffling each epoch.",
        )
    width = {batch.shape[1] for batch, _ in batches}
    _ok(exercise, f"{len(batches)} batches of {global_batch} rows, one width {width}, shuffled")


def _check_in_memory_dataset(dataset, exercise: str) -> None:
    """``dataset`` is a ``tf.data.Dataset`` of ``(features dict, label)`` batches (not
    single rows) that ends (does not repeat)."""
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        _fail(
            exercise,
            f"`in_memory` is a {type(dataset).__name__}, not a tf.data.Dataset. Fix:"
            " tf.data.Dataset.from_tensor_slices((dict(enc), labels)), then shuffle and batch.",
        )
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], dict)):
        _fail(
            exercise,
            f"its elements are {spec}, not (features, label) pairs with the features a dict:"
            " fit splits each element into the model's inputs and its targets. Fix:"
            " from_tensor_slices((dict(enc), labels)).",
        )
    if spec[1].shape.rank == 0:
        _fail(
            exercise,
            "its elements are single rows, not batches: a step takes global_batch rows."
            " Fix: .batch(global_batch, drop_remainder=True) after the shuffle.",
        )
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        _fail(
            exercise,
            "it repeats without end: fit's epochs go over it again each epoch, and a"
            " repeated set has no epochs to count. Fix: leave out .repeat().",
        )


def _check_in_memory_rows(rows: list[int], global_batch: int, exercise: str) -> None:
    """Every batch holds ``global_batch`` rows: none of one replica's share, and no
    smaller last one."""
    if any(n != global_batch for n in rows[:-1]) or rows[0] != global_batch and len(rows) == 1:
        share = global_batch // rows[0] if rows[0] else 0
        _fail(
            exercise,
            f"its batches have {rows[0]} rows, a step takes global_batch={global_batch}"
            + (f" (that is one replica's share of {share})" if share > 1 else "")
            + ": fit splits each batch over the replicas. Fix: .batch(global_batch, ...).",
        )
    if rows[-1] != global_batch:
        _fail(
            exercise,
            f"its last batch has {rows[-1]} rows: a second shape, so a second compilation on"
            " a TPU, and a step whose rows do not split evenly over the replicas. Fix:"
            " .batch(global_batch, drop_remainder=True).",
        )


def _row_indices(ids, labels, batch_ids, batch_labels, exercise: str) -> list[int]:
    """Where each row of a batch is in the data set (the first unused of equal rows),
    its label checked against that row's."""
    where: dict[bytes, list[int]] = {}
    for index, row in enumerate(ids):
        where.setdefault(row.tobytes(), []).append(index)
    found = []
    for row, label in zip(batch_ids, batch_labels, strict=True):
        candidates = [i for i in where.get(row.tobytes(), []) if labels[i] == label]
        if not candidates:
            _fail(
                exercise,
                "the first batch holds rows that are not the tokenized ones, or labels of"
                " other rows: features and labels must stay together. Fix: one"
                " from_tensor_slices of the pair, shuffled as one.",
            )
        found.append(candidates[0])
        where[row.tobytes()].remove(candidates[0])
    return found


def check_limit(limited_by: Callable, exercise: str = "09.2") -> None:
    """``limited_by(report)`` says "input" when the pipeline alone delivers fewer batches
    per second than the step alone takes, else "step"; "together" cannot tell."""
    from tpu_helpers.core.pipeline import InputBoundReport

    cases = [  # (input alone, step alone, together) batches per second, and the limit
        (100.0, 300.0, 95.0, "input"),
        (900.0, 300.0, 290.0, "step"),
        (280.0, 300.0, 200.0, "input"),
        (450.0, 300.0, 180.0, "step"),
        (400.0, 300.0, 260.0, "step"),  # the input only just keeps up: still the step
    ]
    for rate_in, rate_step, together, right in cases:
        report = InputBoundReport(rate_in, rate_step, together, steps=30)
        answer = _learners(limited_by, exercise, report)
        if answer != right:
            _fail(
                exercise,
                f"with the input alone at {rate_in:g} batches/s, the step alone at"
                f" {rate_step:g}/s and both together at {together:g}/s, limited_by says"
                f" {answer!r}, not {right!r}: compare the input pipeline alone with the step"
                " alone (together is at most the slower of the two, whichever it is).",
            )
    _ok(exercise, f"the slower of the input alone and the step alone, in all {len(cases)} cases")
