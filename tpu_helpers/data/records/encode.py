"""Columns to ``tf.train.Example`` bytes with numpy: varints, payloads and a whole chunk
of examples encoded at once; column typing (dtype, missing values) and chunking of the
rows, lists or Arrow tables a writer is given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import InputError, InputTypeError

# --- the tf.train.Example wire format --------------------------------------------------
# Example{features=1: Features{feature=1 (map entry: key=1, value=2): Feature{
#   bytes_list=1 | float_list=2 | int64_list=3: XList{value=1 (packed for numbers)}}}}
_LIST_TAG = {"bytes": b"\x0a", "float32": b"\x12", "int64": b"\x1a"}
_SMALL = [bytes([n]) if n < 128 else bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(16384)]


def _varint(n: int) -> bytes:
    if n < 16384:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_array(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Protobuf varints of int64 ``values``: (all bytes concatenated, byte count of each
    as uint8)."""
    v = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64).reshape(-1)
    if v.size == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    top = int(v.max())
    width = max(1, (top.bit_length() + 6) // 7)  # bytes of the largest value
    if width == 1:
        return v.astype(np.uint8), np.ones(v.size, np.uint8)
    if top < 1 << 32:  # token ids and lengths: half the memory traffic
        v = v.astype(np.uint32)
    out = np.empty((v.size, width), np.uint8)
    keep = np.empty((v.size, width), np.bool_)  # byte k exists
    keep[:, 0] = True
    nbytes = np.ones(v.size, np.uint8)
    for k in range(width):
        byte = ((v >> (7 * k)) & 0x7F).astype(np.uint8)
        if k < width - 1:
            more = v >= (1 << (7 * (k + 1)))  # another byte follows
            byte |= more.view(np.uint8) << 7
            keep[:, k + 1] = more
            nbytes += more
        out[:, k] = byte
    return out.reshape(-1)[keep.reshape(-1)], nbytes


def _interleave(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Row ``i`` of the result is row ``i`` of every piece, concatenated in order.

    Each piece is ``(flat bytes, bytes per row)`` or, for the same bytes in every row,
    ``(bytes, None)``. Returns ``(flat bytes, bytes per row)``.
    """
    rows = next(len(c) for _, c in pieces if c is not None)
    counts = np.stack([np.full(rows, len(f)) if c is None else c for f, c in pieces])
    row_lengths = counts.sum(axis=0)
    # where each piece of each row starts in the output
    offsets = np.cumsum(counts, axis=0) - counts + (np.cumsum(row_lengths) - row_lengths)
    out = np.empty(int(row_lengths.sum()), np.uint8)
    for (flat, count), offset in zip(pieces, offsets, strict=True):
        if count is None:  # constant bytes: one strided write per byte
            for j, byte in enumerate(flat):
                out[offset + j] = byte
        elif flat.size:
            out[np.arange(flat.size) + np.repeat(offset - (np.cumsum(count) - count), count)] = flat
    return out, row_lengths


def _const(value: bytes, rows: int) -> tuple[bytes, None]:
    return value, None


def _varints(lengths: np.ndarray, where: np.ndarray | None = None):
    flat, nbytes = _varint_array(lengths)
    nbytes = nbytes.astype(np.int64)
    if where is None:
        return flat, nbytes
    return flat[np.repeat(where, nbytes)], np.where(where, nbytes, 0)


def _size(nbytes_of: np.ndarray) -> np.ndarray:
    return _varint_array(nbytes_of)[1].astype(np.int64)


def _payload(dtype: str, flat, row_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The packed values of each row (numbers) or its length-prefixed strings (bytes)."""
    if dtype == "int64":
        data, nbytes = _varint_array(np.asarray(flat))
        if row_lengths.size and row_lengths.min() == row_lengths.max() > 0:  # fixed shape
            return data, nbytes.reshape(len(row_lengths), -1).sum(axis=1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(row_lengths)])
        ends = np.concatenate([[0], np.cumsum(nbytes, dtype=np.int64)])[starts]
        return data, np.diff(ends)
    if dtype == "float32":
        return np.asarray(flat, dtype="<f4").view(np.uint8).reshape(-1), row_lengths * 4
    rows, pos = [], 0
    for n in row_lengths.tolist():
        rows.append(b"".join(b"\x0a" + _varint(len(x)) + x for x in flat[pos : pos + n]))
        pos += n
    return np.frombuffer(b"".join(rows), np.uint8), np.array([len(r) for r in rows], np.int64)


def encode_examples(columns: Mapping[str, tuple[str, object, np.ndarray]]) -> list[bytes]:
    """Serialized ``tf.train.Example`` records for a chunk of rows.

    ``columns`` maps a feature name to ``(dtype, flat values, row lengths)``. The bytes
    parse with ``tf.io.parse_example`` and ``tf.train.Example.FromString`` exactly like
    those of ``tf.train.Example(...).SerializeToString()``; they are built for the whole
    chunk at once with numpy instead of one proto object per example.
    """
    rows = len(next(iter(columns.values()))[2])
    pieces, body = [], np.zeros(rows, np.int64)
    for name, (dtype, flat, lengths) in columns.items():
        data, plen = _payload(dtype, flat, np.asarray(lengths, np.int64))
        # numbers are one packed field (tag, size, values) unless empty; strings are
        # already their own fields (tag, size, bytes each)
        has = plen > 0 if dtype != "bytes" else np.zeros(rows, np.bool_)
        inner = np.where(has, 1 + _size(plen) + plen, plen)
        feature = 1 + _size(inner) + inner
        key = name.encode()
        head = b"\x0a" + _varint(len(key)) + key + b"\x12"
        entry = len(head) + _size(feature) + feature
        body += 1 + _size(entry) + entry
        pieces += [
            _const(b"\x0a", rows),
            _varints(entry),
            _const(head, rows),
            _varints(feature),
            _const(_LIST_TAG[dtype], rows),
            _varints(inner),
            (np.full(int(has.sum()), 0x0A, np.uint8), has.astype(np.int64)),
            _varints(plen, where=has),
            (data, plen),
        ]
    flat, record_lengths = _interleave([_const(b"\x0a", rows), _varints(body), *pieces])
    buf = flat.tobytes()
    ends = np.cumsum(record_lengths).tolist()
    return [buf[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


# --- feature specs -------------------------------------------------------------------
@dataclass
class Column:
    """What the writer learns about one feature while streaming."""

    dtype: str
    scalar: bool
    lengths: Counter
    low: int | None = None
    high: int | None = None

    def see(self, flat) -> None:
        """Track the range of an integer column (the reader casts to int32)."""
        if self.dtype != "int64" or len(flat) == 0:
            return
        array = np.asarray(flat)
        low, high = int(array.min()), int(array.max())
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def spec(self) -> dict:
        if self.scalar:
            shape: list = []
        elif len(self.lengths) == 1:
            shape = [next(iter(self.lengths))]
        else:
            shape = [None]
        spec = {"dtype": self.dtype, "shape": shape}
        if shape == [None]:
            spec["min_length"], spec["max_length"] = min(self.lengths), max(self.lengths)
        if self.low is not None:
            spec["min"], spec["max"] = self.low, self.high
        return spec


def _dtype_of(values: np.ndarray, name: str) -> str:
    if values.dtype.kind in "iub":
        return "int64"
    if values.dtype.kind == "f":
        return "float32"
    if values.dtype.kind in "SUO":
        return "bytes"
    raise InputTypeError(
        f"Column {name!r} has dtype {values.dtype}, which a tf.train.Example cannot hold."
        " Fix: convert it to integers, floats or bytes, or leave it out with columns=[...]."
    )


def _missing_row(values) -> int | None:
    """Index of the first ``None`` (or NaN in a list of Python numbers), else ``None``."""
    if isinstance(values, _Lists) or (isinstance(values, np.ndarray) and values.dtype != object):
        return None  # Arrow list columns are checked for nulls in _from_arrow
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and v != v):
            return i
    return None


def as_column(name: str, values, first_row: int = 0) -> tuple[str, bool, object, np.ndarray]:
    """``(dtype, scalar, flat values, row lengths)`` of one column of a chunk."""
    missing = _missing_row(values)
    if missing is not None:
        raise InputError(
            f"Column {name!r} has a missing value at row {first_row + missing}: written as is,"
            " an integer column would turn into floats and read back as NaN. Fix: fill or"
            " drop those rows before writing (dataset.filter(lambda x: x[name] is not None))."
        )
    if isinstance(values, _Lists):
        flat = values.flat
        if isinstance(flat, list):
            flat = [x.encode() if isinstance(x, str) else bytes(x) for x in flat]
            return "bytes", False, flat, values.lengths
        return _dtype_of(np.asarray(flat), name), False, flat, values.lengths
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype != object:
        return _dtype_of(values, name), True, values, np.ones(len(values), np.int64)
    first = values[0] if len(values) else None
    if isinstance(first, (str, bytes)) or not hasattr(first, "__len__"):
        scalar = True
        if isinstance(first, (str, bytes)):
            flat = [v.encode() if isinstance(v, str) else bytes(v) for v in values]
            return "bytes", True, flat, np.ones(len(flat), np.int64)
        arr = np.asarray(values)
        return _dtype_of(arr, name), scalar, arr.reshape(-1), np.ones(len(arr), np.int64)
    if isinstance(values, np.ndarray) and values.dtype != object:  # rectangular already
        arr = values.reshape(len(values), -1)
        return _dtype_of(arr, name), False, arr.reshape(-1), np.full(len(arr), arr.shape[1])
    rows = [np.asarray(v) for v in values]
    lengths = np.array([r.size for r in rows], np.int64)
    nonempty = [r.reshape(-1) for r in rows if r.size]
    if nonempty and nonempty[0].dtype.kind in "SUO":
        flat = [x.encode() if isinstance(x, str) else bytes(x) for r in nonempty for x in r]
        return "bytes", False, flat, lengths
    flat = np.concatenate(nonempty) if nonempty else np.zeros(0, np.int64)
    return _dtype_of(flat, name), False, flat, lengths


def _from_arrow(column):
    """A column of an Arrow table as ``as_column`` takes it: ``(flat, row lengths)`` for
    a list column, else a numpy array or a Python list of strings."""
    import pyarrow as pa

    column = column.combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        if column.null_count:
            raise InputError("A list column has missing (null) rows. Fix: fill or drop them.")
        offsets = column.offsets.to_numpy()
        values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            values = values.flatten()  # nested lists: [rows, a, b] -> rows of a*b values
            per_row = np.diff(offsets) * (len(values) // max(1, offsets[-1] - offsets[0]))
        else:
            per_row = np.diff(offsets)
        flat = (
            values.to_pylist()
            if pa.types.is_binary(values.type) or pa.types.is_string(values.type)
            else values.to_numpy(zero_copy_only=False)
        )
        return _Lists(flat, per_row.astype(np.int64))
    if pa.types.is_binary(column.type) or pa.types.is_string(column.type) or column.null_count:
        return column.to_pylist()  # nulls stay None, which as_column names with their row
    return column.to_numpy(zero_copy_only=False)


@dataclass
class _Lists:
    """A chunk of a list column: all values in one array, and each row's count."""

    flat: object
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def row_chunks(examples, chunk_size: int, columns: Sequence[str] | None):
    """Dicts of column -> list, ``chunk_size`` rows at a time, from a ``datasets.Dataset``
    or any iterable of dicts."""
    if hasattr(examples, "iter") and hasattr(examples, "column_names"):  # datasets.Dataset
        names = list(columns or examples.column_names)
        missing = [c for c in names if c not in examples.column_names]
        if missing:
            raise InputError(
                f"The data set has no column {missing[0]!r}; its columns are"
                f" {examples.column_names}. Fix: pass columns=[...] from those."
            )
        # Arrow batches: list columns become (values, row lengths) without a per-row step
        for table in examples.select_columns(names).with_format("arrow").iter(chunk_size):
            yield {name: _from_arrow(table.column(name)) for name in names}
        return
    batch: dict[str, list] = {}
    count, names = 0, list(columns) if columns else None
    for row in examples:
        if names is None:
            names = list(row)  # every row must have the first row's columns
        elif not columns and len(row) != len(names):
            extra = sorted(set(row) - set(names))
            if extra:
                raise InputError(
                    f"Example {count} has columns {extra} that example 0 has not (it has"
                    f" {sorted(names)}). Fix: give every row the same columns, or choose them"
                    " with columns=[...]."
                )
        for c in names:
            if c not in row:
                raise InputError(
                    f"Example {count} has no column {c!r}; it has {sorted(row)}. Fix: give"
                    " every row the same columns, or choose them with columns=[...]."
                )
            batch.setdefault(c, []).append(row[c])
        count += 1
        if count % chunk_size == 0:
            yield batch
            batch = {}
    if batch:
        yield batch
