"""Checks on data where it enters ``tpu_helpers``: labels, padding widths, integer ranges.

Each check looks at a whole column at once (numpy, no Python loop per row) and raises
``ValueError`` naming the column, the first bad row, its value and the fix. Values that
would otherwise train silently wrong: a label of -1 (GLUE test splits) gives a NaN loss
under XLA, a missing label turns an integer column into floats, an unsorted width list
cuts examples, an int64 beyond the int32 range wraps when cast.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpu_helpers.core.errors import InputError

__all__ = [
    "INT32",
    "check_positive",
    "check_learning_rate",
    "check_same_length",
    "check_token_counts",
    "check_present",
    "check_labels",
    "check_boundaries",
    "check_int32",
]

INT32 = (-(2**31), 2**31 - 1)


def check_positive(**counts) -> None:
    """``ValueError`` naming the first of ``counts`` (name=value) that is not a whole
    number of at least 1 (``True`` is not a count).

    >>> check_positive(batch_size=0)
    Traceback (most recent call last):
    ...
    ValueError: batch_size=0 must be a positive integer. Fix: pass a whole number of 1 or more.
    """
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(
                f"{name}={value!r} must be a positive integer. Fix: pass a whole number of 1"
                " or more."
            )


def check_learning_rate(learning_rate) -> None:
    """``ValueError`` unless ``learning_rate`` is a finite number above 0 (a schedule, any
    object with a ``__call__``, is the optimizer's to check).

    >>> check_learning_rate(-1e-3)
    Traceback (most recent call last):
    ...
    ValueError: learning_rate=-0.001 must be a number above 0 (a negative or zero rate climbs the loss or stands still). Fix: 3e-5 to fine-tune a base checkpoint, 1e-3 for a tiny one trained from scratch.
    """
    if callable(learning_rate):
        return
    number = isinstance(learning_rate, (int, float, np.number)) and not isinstance(
        learning_rate, bool
    )
    if not (number and np.isfinite(learning_rate) and learning_rate > 0):
        raise InputError(
            f"learning_rate={learning_rate!r} must be a number above 0 (a negative or zero"
            " rate climbs the loss or stands still). Fix: 3e-5 to fine-tune a base"
            " checkpoint, 1e-3 for a tiny one trained from scratch."
        )


def check_same_length(**columns) -> int:
    """The common length of ``columns`` (name=sequence; ``None`` is left out), or
    ``ValueError`` naming the two that differ.

    >>> check_same_length(labels=[0, 1, 1], predictions=[0, 1])
    Traceback (most recent call last):
    ...
    ValueError: labels has 3 rows but predictions has 2. Fix: pass one value of predictions per row of labels (the same rows, in the same order).
    """
    lengths = [(name, len(values)) for name, values in columns.items() if values is not None]
    (first, rows), *rest = lengths
    for name, n in rest:
        if n != rows:
            raise InputError(
                f"{first} has {rows} rows but {name} has {n}. Fix: pass one value of {name}"
                f" per row of {first} (the same rows, in the same order)."
            )
    return rows


def check_token_counts(lengths, column: str = "lengths") -> np.ndarray:
    """Token counts as int64, or ``ValueError`` naming the first that is not a whole
    number of at least 1.

    >>> check_token_counts([12, 0, 7])
    Traceback (most recent call last):
    ...
    ValueError: lengths has 0 at row 1: every example needs at least one token. Fix: drop empty examples before packing (dataset.filter(lambda x: len(x['input_ids']) > 0)).
    """
    array = np.asarray(lengths)
    if array.size and array.dtype.kind not in "iu":
        raise InputError(
            f"{column} holds {array.dtype} values ({array.reshape(-1)[0]!r} at row 0), not"
            f" token counts. Fix: {column}=[len(ids) for ids in input_ids]."
        )
    bad = np.flatnonzero(array < 1)
    if len(bad):
        row = int(bad[0])
        raise InputError(
            f"{column} has {int(array[row])} at row {row}: every example needs at least one"
            " token. Fix: drop empty examples before packing"
            " (dataset.filter(lambda x: len(x['input_ids']) > 0))."
        )
    return array.astype(np.int64)


def check_present(values, column: str, first_row: int = 0) -> None:
    """Refuse a column with missing values (``None``), naming the first one's row
    (``first_row`` is the row of ``values[0]``, for a column checked in batches).

    >>> check_present(["a", None], "sentence", first_row=10)
    Traceback (most recent call last):
    ...
    ValueError: Column 'sentence' has a missing value (None) at row 11 (1 in all here). Fix: fill or drop those rows (dataset.filter(lambda x: x['sentence'] is not None)).
    """
    missing = np.flatnonzero([v is None for v in values])
    if len(missing):
        raise InputError(
            f"Column {column!r} has a missing value (None) at row {first_row + int(missing[0])}"
            f" ({len(missing)} in all here). Fix: fill or drop those rows"
            f" (dataset.filter(lambda x: x[{column!r}] is not None))."
        )


def _as_array(values, column: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype == object:
        check_present(array.reshape(-1), column)
        array = array.astype(np.float64)
    return array


def check_labels(labels, num_labels: int | None = None, column: str = "label") -> np.ndarray:
    """Class labels as int32, or ``ValueError``: missing, NaN, fractional, negative or
    ``>= num_labels`` values are named with their row.

    >>> check_labels([0, 1, 1], num_labels=2).tolist()
    [0, 1, 1]
    >>> check_labels([0, -1], num_labels=2)
    Traceback (most recent call last):
    ...
    ValueError: Column 'label' has label -1 at row 1, outside [0, 2). A split without labels (GLUE test splits use -1) cannot be trained on. Fix: train on a labelled split, or drop those rows (dataset.filter(lambda x: x['label'] >= 0)).
    """
    array = _as_array(labels, column)
    if array.size == 0:
        return array.astype(np.int32)
    if array.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if len(bad):
            row = int(bad[0])
            raise InputError(
                f"Column {column!r} has label {float(array[row])} at row {row}: class labels are"
                " whole numbers. Fix: fill missing labels or drop those rows, then cast the"
                " column to int (dataset.cast_column)."
            )
    elif array.dtype.kind not in "iub":
        raise InputError(
            f"Column {column!r} holds {array.dtype} values ({array.reshape(-1)[0]!r} at row 0),"
            " not class numbers. Fix: map the names to ids (ClassLabel.str2int) first."
        )
    high = num_labels if num_labels is not None else None
    bad = np.flatnonzero((array < 0) | ((array >= high) if high is not None else False))
    if len(bad):
        row = int(bad[0])
        value = int(array[row])
        span = f"[0, {high})" if high is not None else "[0, ...)"
        fix = (
            " A split without labels (GLUE test splits use -1) cannot be trained on. Fix:"
            " train on a labelled split, or drop those rows"
            f" (dataset.filter(lambda x: x[{column!r}] >= 0))."
            if value < 0
            else f" Fix: num_labels={int(array.max()) + 1} for the model, or check the column."
        )
        raise InputError(f"Column {column!r} has label {value} at row {row}, outside {span}.{fix}")
    return array.astype(np.int32)


def check_boundaries(boundaries: Sequence[int]) -> list[int]:
    """Padding widths as a list of increasing positive ints, or ``ValueError`` with the
    sorted list to use.

    >>> check_boundaries([16, 32, 64])
    [16, 32, 64]
    """
    widths = list(boundaries) if boundaries is not None else []
    if not widths:
        raise InputError("boundaries is empty. Fix: text.choose_boundaries(lengths).")
    if not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in widths):
        try:
            shown = [float(w) for w in widths]
            rounded = sorted({int(np.ceil(w / 8)) * 8 for w in shown})
        except (TypeError, ValueError):
            raise InputError(f"boundaries={widths} must be whole numbers of tokens.") from None
        raise InputError(
            f"boundaries={shown} must be whole numbers of tokens (np.percentile and np.mean"
            f" give floats). Fix: round them up to multiples of 8: boundaries={rounded}."
        )
    if any(w < 1 for w in widths) or any(b <= a for a, b in zip(widths, widths[1:], strict=False)):
        good = sorted({int(w) for w in widths if w >= 1})
        fix = f"boundaries={good}" if good else "text.choose_boundaries(lengths)"
        raise InputError(
            f"boundaries={widths} must be positive and increasing (each batch takes the"
            f" narrowest width its rows fit). Fix: {fix}."
        )
    return [int(w) for w in widths]


def check_int32(low: int, high: int, column: str) -> None:
    """``ValueError`` when ``[low, high]`` does not fit int32 (what a TPU model takes)."""
    if low < INT32[0] or high > INT32[1]:
        value = low if low < INT32[0] else high
        raise InputError(
            f"Column {column!r} holds {value}, beyond the int32 range the reader casts"
            " integers to (values would wrap around). Fix: store it as float or bytes, or"
            " map it to smaller ids before writing."
        )
