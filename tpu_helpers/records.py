"""TFRecord shards: write a tokenized data set once, stream it to every TPU host.

Writing (``write_records``) streams the examples in chunks, so memory stays flat however
large the data set is, and encodes each chunk's ``tf.train.Example`` protos with numpy
(building one proto object per example in Python is what makes the usual loop slow).
Shards rotate at a byte size (default 100 MB, the TPU guide's advice) or a record count,
are named ``train-00003-of-00016.tfrecord``, and one ``train.metadata.json`` beside them
records the feature spec, the record count of every shard and where the data came from.
The metadata is written last: a write that stops half-way leaves no data set that looks
complete. Shards are written by one process: at about 190,000 examples/s (CoLA padded to
128, benchmarks/records.py) a worker process would spend its TensorFlow import (4-5 s
here, and forking after TensorFlow is loaded is unsafe) writing nearly a million examples,
so parallel writing pays only for far larger data sets, split across separate jobs.

Unpadded token sequences are written grouped by length: each shard holds records whose
length rounds up to the same multiple of 8, so the padding widths can be chosen when
training, and any width can be filled from its own shards.

Reading (``read_records``) takes that metadata (or a folder, or files and a hand-written
spec) and plans (``plan_reads``) which shards each input pipeline reads for each width and
how many steps of each width every pipeline runs, from the metadata alone, so that the
hosts of a pod slice agree without talking. Each width's shards are read by one reader
op, shuffled through a buffer, batched raw, and parsed and padded with one vectorized op
per batch; a schedule of widths drawn from ``(seed, epoch)`` picks the width of every
step. With files read one after another (the default for local paths) no function runs
per width, so a width costs a few dataset ops: that keeps the bucketed reader as fast as
the fixed-length one (benchmarks/records.py).

Every path goes through ``tf.io.gfile``: a local folder, ``gs://bucket/prefix`` or
``ram://`` all work.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import tpu_helpers._env  # noqa: F401
from tpu_helpers.checks import first_line
from tpu_helpers.validate import check_boundaries, check_int32, check_positive

FORMAT = "tpu_helpers.records/1"
DEFAULT_SHARD_BYTES = 100 * 1024 * 1024
_DTYPES = ("int64", "float32", "bytes")
_LIST_KIND = {"int64": "int64_list", "float32": "float_list", "bytes": "bytes_list"}


def _tf_dtypes() -> dict:
    """Our dtype names -> TensorFlow dtypes (TensorFlow is imported only when needed)."""
    import tensorflow as tf

    return {"int64": tf.int64, "float32": tf.float32, "bytes": tf.string}


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
class _Column:
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
    raise TypeError(
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


def _as_column(name: str, values, first_row: int = 0) -> tuple[str, bool, object, np.ndarray]:
    """``(dtype, scalar, flat values, row lengths)`` of one column of a chunk."""
    missing = _missing_row(values)
    if missing is not None:
        raise ValueError(
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
    """A column of an Arrow table as ``_as_column`` takes it: ``(flat, row lengths)`` for
    a list column, else a numpy array or a Python list of strings."""
    import pyarrow as pa

    column = column.combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        if column.null_count:
            raise ValueError("A list column has missing (null) rows. Fix: fill or drop them.")
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
        return column.to_pylist()  # nulls stay None, which _as_column names with their row
    return column.to_numpy(zero_copy_only=False)


@dataclass
class _Lists:
    """A chunk of a list column: all values in one array, and each row's count."""

    flat: object
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def _chunks(examples, chunk_size: int, columns: Sequence[str] | None):
    """Dicts of column -> list, ``chunk_size`` rows at a time, from a ``datasets.Dataset``
    or any iterable of dicts."""
    if hasattr(examples, "iter") and hasattr(examples, "column_names"):  # datasets.Dataset
        names = list(columns or examples.column_names)
        missing = [c for c in names if c not in examples.column_names]
        if missing:
            raise ValueError(
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
                raise ValueError(
                    f"Example {count} has columns {extra} that example 0 has not (it has"
                    f" {sorted(names)}). Fix: give every row the same columns, or choose them"
                    " with columns=[...]."
                )
        for c in names:
            if c not in row:
                raise ValueError(
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


# --- writing -------------------------------------------------------------------------
def shard_name(split: str, index: int, total: int, compression: str | None = None) -> str:
    """``train-00003-of-00016.tfrecord`` (``.gz`` added for GZIP)."""
    suffix = ".tfrecord.gz" if compression == "GZIP" else ".tfrecord"
    return f"{split}-{index:05d}-of-{total:05d}{suffix}"


def metadata_path(output_dir: str, split: str) -> str:
    return f"{output_dir.rstrip('/')}/{split}.metadata.json"


def split_files(folder: str, split: str) -> list[str]:
    """The shard files of exactly ``split`` in ``folder``: ``train`` does not take the
    shards of ``train-aug``, nor the unfinished files of a writer.

    >>> split_files("ram://nowhere", "train")
    []
    """
    import tensorflow as tf

    exact = re.compile(re.escape(split) + r"-\d{5}-of-\d{5}\.tfrecord(?:\.gz)?$")
    found = tf.io.gfile.glob(f"{folder.rstrip('/')}/{split}-*-of-*.tfrecord*")
    return sorted(p for p in found if exact.match(p.rsplit("/", 1)[-1]))


def _split_state(folder: str, split: str) -> tuple:
    """What a split is now (its metadata's bytes and its shard files): a writer compares it
    before and after writing to find out whether another writer got there in between."""
    import tensorflow as tf

    meta = metadata_path(folder, split)
    content = None
    if tf.io.gfile.exists(meta):
        with tf.io.gfile.GFile(meta, "rb") as f:
            content = f.read()
    return content, tuple(split_files(folder, split))


def _length_groups(encoded: dict, lists: list, rows: int, group_lengths: int | None) -> np.ndarray:
    """Per record, the length group (length rounded up to ``group_lengths``) of the
    ``input_ids`` column, else of the first list column; 0 for all without one."""
    if group_lengths is None or not lists:
        return np.zeros(rows, np.int64)
    key = "input_ids" if "input_ids" in lists else lists[0]
    return -(-np.asarray(encoded[key][2], np.int64) // group_lengths)


def _remove_tree(path: str) -> None:
    import tensorflow as tf

    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


def write_records(
    examples: Iterable,
    output_dir: str,
    split: str = "train",
    columns: Sequence[str] | None = None,
    shard_bytes: int | None = DEFAULT_SHARD_BYTES,
    shard_records: int | None = None,
    compression: str | None = None,
    source: Mapping | None = None,
    chunk_size: int = 4096,
    total: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    group_lengths: int | None = 8,
) -> dict:
    """Write ``examples`` (a ``datasets.Dataset`` or an iterable of dicts) as sharded
    ``tf.train.Example`` records under ``output_dir``; return the metadata written.

    Rows are read ``chunk_size`` at a time; each column becomes a feature (``columns``
    picks them). Lists of equal length become fixed-shape features, lists of varying
    length variable-length ones (with their length histogram in the metadata, so the
    reader can choose padding widths without a pass over the data). A new shard starts
    when the current one would pass ``shard_bytes``, or every ``shard_records`` records if
    that is given. ``compression`` is ``None`` or ``"GZIP"``. ``source`` (tokenizer, max
    length, data set name ...) is stored in the metadata as given.

    Records of varying length are grouped by length as they are written: each shard holds
    records whose length (of ``input_ids``, else of the first list column) rounds up to the
    same multiple of ``group_lengths``, so that a reader, on any number of hosts, can fill
    a batch of any width from shards of that width alone (``read_records``). Widths chosen
    on multiples of ``group_lengths`` (``text.choose_boundaries`` uses 8) then never pad a
    record wider than its own bucket. ``None`` writes records in the order given.
    """
    import tensorflow as tf
    from tqdm.auto import tqdm

    if compression not in (None, "GZIP"):
        raise ValueError(f"compression={compression!r}: use None or 'GZIP'.")
    if shard_records is not None and shard_records < 1:
        raise ValueError(f"shard_records={shard_records} must be a positive number of records.")
    if group_lengths is not None and (
        isinstance(group_lengths, bool) or not isinstance(group_lengths, int) or group_lengths < 1
    ):
        raise ValueError(f"group_lengths={group_lengths!r} must be a positive integer or None.")
    if shard_records is None and (shard_bytes is None or shard_bytes < 1):
        raise ValueError(f"shard_bytes={shard_bytes} must be a positive size in bytes.")
    output_dir = output_dir.rstrip("/")
    before = _split_state(output_dir, split)
    if (before[0] is not None or before[1]) and not overwrite:
        raise FileExistsError(
            f"{output_dir} already holds records of split {split!r}"
            f" ({len(before[1])} shard(s)). Fix: another output_dir or split, or"
            " overwrite=True to replace them (the old ones stay until the new ones are"
            " complete)."
        )
    # Shards are written into a folder of this writer's own, hidden from readers' globs,
    # and move next to the others only once all of them (and their metadata) exist.
    write_id = uuid.uuid4().hex[:12]
    staging = f"{output_dir}/.writing-{split}-{write_id}"
    tf.io.gfile.makedirs(staging)
    if total is None and hasattr(examples, "__len__"):
        total = len(examples)

    options = tf.io.TFRecordOptions(compression_type=compression or "")
    pending: list[tuple[str, int]] = []  # (temporary path, records)
    group_of_shard: list[int] = []
    info: dict[str, _Column] = {}
    shard_lengths: list[dict[str, Counter]] = []
    # one open shard per length group: [writer, shard index, records, bytes]
    open_shards: dict[int, list] = {}

    def open_shard(group: int) -> list:
        path = f"{staging}/{split}-{len(pending):05d}.tfrecord.incomplete"
        pending.append((path, 0))
        group_of_shard.append(group)
        shard_lengths.append({})
        open_shards[group] = [tf.io.TFRecordWriter(path, options), len(pending) - 1, 0, 0]
        return open_shards[group]

    def close_shard(group: int) -> None:
        state = open_shards.pop(group, None)
        if state is not None:
            state[0].close()
            pending[state[1]] = (pending[state[1]][0], state[2])

    bar = tqdm(total=total, unit="ex", desc=f"write {split}", disable=not progress)
    written = 0
    try:
        for chunk in _chunks(examples, chunk_size, columns):
            encoded = {}
            for name, values in chunk.items():
                dtype, scalar, flat, lengths = _as_column(name, values, written)
                known = info.get(name)
                if known is None:
                    known = info[name] = _Column(dtype, scalar, Counter())
                elif (known.dtype, known.scalar) != (dtype, scalar):
                    raise ValueError(
                        f"Column {name!r} changes type at row {written}: {known.dtype}"
                        f"{'' if known.scalar else ' list'} before, {dtype}"
                        f"{'' if scalar else ' list'} now. Fix: cast the column to one type."
                    )
                known.see(flat)
                encoded[name] = (dtype, flat, lengths)
            if set(encoded) != set(info):
                raise ValueError(
                    f"Rows from {written} have columns {sorted(encoded)}, earlier rows"
                    f" {sorted(info)}. Fix: give every example the same columns."
                )
            records = encode_examples(encoded)
            sizes = np.array([len(r) + 16 for r in records])  # + length and two CRCs
            shard_of = np.empty(len(records), np.int64)
            lists = [n for n in encoded if not info[n].scalar]
            groups = _length_groups(encoded, lists, len(records), group_lengths)
            for group in np.unique(groups).tolist():
                rows = np.flatnonzero(groups == group)
                ends = np.cumsum(sizes[rows])
                pos = 0
                while pos < len(rows):
                    state = open_shards.get(group)
                    if shard_records is not None:
                        room = shard_records - state[2] if state else 0
                        take = min(room, len(rows) - pos)
                    else:
                        done = ends[pos - 1] if pos else 0
                        room = shard_bytes - state[3] if state else 0
                        take = int(np.searchsorted(ends, done + room, side="right")) - pos
                        if take == 0 and state and state[2] == 0:
                            take = 1  # one record larger than a shard gets a shard of its own
                    if take <= 0:
                        close_shard(group)
                        open_shard(group)
                        continue
                    write = state[0].write
                    for row in rows[pos : pos + take].tolist():
                        write(records[row])
                    state[2] += take
                    state[3] += int(ends[pos + take - 1] - (ends[pos - 1] if pos else 0))
                    shard_of[rows[pos : pos + take]] = state[1]
                    pos += take
            for name, (_, _, lengths) in encoded.items():
                if info[name].scalar:
                    continue
                for shard in np.unique(shard_of).tolist():
                    values, counts = np.unique(lengths[shard_of == shard], return_counts=True)
                    histogram = dict(zip(values.tolist(), counts.tolist(), strict=True))
                    shard_lengths[shard].setdefault(name, Counter()).update(histogram)
                    info[name].lengths.update(histogram)
            written += len(records)
            bar.update(len(records))
        for group in list(open_shards):
            close_shard(group)
    except BaseException:
        for state in open_shards.values():
            state[0].close()
        _remove_tree(staging)
        raise
    finally:
        bar.close()
    if not written:
        _remove_tree(staging)
        raise ValueError(
            "There were no examples to write. Fix: check the data set or split"
            + (" (the existing records were kept)." if before[1] else ".")
        )

    shards = []
    # shards named in length order: a reader lists them grouped by the widths they need
    order = sorted(range(len(pending)), key=lambda i: (group_of_shard[i], i))
    for index, (path, count) in enumerate(pending[i] for i in order):
        shard_index = order[index]
        final = f"{staging}/{shard_name(split, index, len(pending), compression)}"
        tf.io.gfile.rename(path, final, overwrite=True)
        entry = {
            "file": final.rsplit("/", 1)[-1],
            "num_records": count,
            "bytes": tf.io.gfile.stat(final).length,
        }
        variable = {
            name: {str(k): v for k, v in sorted(c.items())}
            for name, c in shard_lengths[shard_index].items()
            if info[name].spec()["shape"] == [None]
        }
        if variable:
            entry["lengths"] = variable
        shards.append(entry)
    metadata = {
        "format": FORMAT,
        "split": split,
        "num_records": written,
        "compression": compression,
        "features": {name: col.spec() for name, col in info.items()},
        "shards": shards,
        "group_lengths": group_lengths,
        "source": dict(source or {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "write_id": write_id,
    }
    with tf.io.gfile.GFile(f"{staging}/{split}.metadata.json", "w") as f:
        json.dump(metadata, f, indent=1)
    _commit(staging, output_dir, split, before, [s["file"] for s in shards])
    return metadata


def _commit(staging: str, output_dir: str, split: str, before: tuple, files: list) -> None:
    """Replace the split in ``output_dir`` by the complete one in ``staging``.

    The old metadata goes first (a reader then finds no split rather than a mix of old and
    new shards), then the old shards, then the new shards move in, and the new metadata
    last: from that moment readers see the new split. If another writer changed the split
    since this one started, nothing is replaced and this write is dropped.
    """
    import tensorflow as tf

    now = _split_state(output_dir, split)
    if now != before:
        _remove_tree(staging)
        raise FileExistsError(
            f"Another writer changed split {split!r} in {output_dir} while this one was"
            " writing; its records were kept and this write was dropped. Fix: give each"
            " writer its own output_dir or split, or write again to replace them."
        )
    meta_file = metadata_path(output_dir, split)
    if now[0] is not None:
        tf.io.gfile.remove(meta_file)
    for path in now[1]:
        tf.io.gfile.remove(path)
    for name in files:
        tf.io.gfile.rename(f"{staging}/{name}", f"{output_dir}/{name}", overwrite=True)
    tf.io.gfile.rename(f"{staging}/{split}.metadata.json", meta_file, overwrite=True)
    _remove_tree(staging)


# --- reading -------------------------------------------------------------------------
class RecordsError(ValueError):
    """Records and their metadata disagree, or a shard is corrupt."""


def _spec_to_tf(features: Mapping[str, Mapping]) -> dict:
    import tensorflow as tf

    tf_dtype = _tf_dtypes()
    spec = {}
    for name, f in features.items():
        if f["dtype"] not in _DTYPES:
            raise RecordsError(f"Feature {name!r} has dtype {f['dtype']!r}, not one of {_DTYPES}.")
        shape = list(f["shape"])
        if shape == [None]:
            spec[name] = tf.io.RaggedFeature(tf_dtype[f["dtype"]], row_splits_dtype=tf.int32)
        else:
            spec[name] = tf.io.FixedLenFeature(shape, tf_dtype[f["dtype"]])
    return spec


def load_metadata(path: str) -> dict:
    """The metadata of a record set: ``path`` is the JSON file or the folder holding one
    (a folder with several splits needs the file)."""
    import tensorflow as tf

    path = path.rstrip("/")
    if tf.io.gfile.isdir(path):
        found = tf.io.gfile.glob(f"{path}/*.metadata.json")
        if len(found) != 1:
            raise FileNotFoundError(
                f"{path} holds {len(found)} metadata files"
                f" ({[p.rsplit('/', 1)[-1] for p in found]}). Fix: pass the path of one"
                " <split>.metadata.json, or files= and spec= for records without metadata."
            )
        path = found[0]
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"{path} does not exist. Fix: check the path or bucket.")
    with tf.io.gfile.GFile(path) as f:
        try:
            metadata = json.load(f)
        except json.JSONDecodeError as err:
            raise RecordsError(
                f"{path} is not valid JSON ({err}). Fix: restore the file written with the"
                " shards, or write the split again."
            ) from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise RecordsError(f"{path} is not a {FORMAT} metadata file.")
    _check_metadata(metadata, path)
    metadata["_dir"] = path.rsplit("/", 1)[0]
    return metadata


#: What every metadata file holds, and the type of each entry.
_METADATA_KEYS = {"split": str, "num_records": int, "features": dict, "shards": list}
_SHARD_KEYS = {"file": str, "num_records": int}


def _check_metadata(metadata: dict, path: str) -> None:
    """Name the first missing or mistyped entry of a (hand-edited) metadata file."""

    def bad(where: str, what: str) -> RecordsError:
        return RecordsError(
            f"{path}: {where} {what}. Fix: restore the file written with the shards, or"
            " write the split again."
        )

    for key, kind in _METADATA_KEYS.items():
        if key not in metadata:
            raise bad(f"the entry {key!r}", "is missing")
        if not isinstance(metadata[key], kind):
            raise bad(
                f"the entry {key!r}", f"is a {type(metadata[key]).__name__}, not a {kind.__name__}"
            )
    for i, shard in enumerate(metadata["shards"]):
        for key, kind in _SHARD_KEYS.items():
            if not isinstance(shard, dict) or not isinstance(shard.get(key), kind):
                raise bad(f"shards[{i}]", f"has no {kind.__name__} {key!r}")
    for name, feature in metadata["features"].items():
        if not isinstance(feature, dict) or "dtype" not in feature or "shape" not in feature:
            raise bad(f"features[{name!r}]", "needs a 'dtype' and a 'shape'")


@dataclass
class Shard:
    path: str
    num_records: int | None
    lengths: dict | None = None


def _metadata_shards(metadata: dict, check_sizes: bool) -> list[Shard]:
    """The shards the metadata lists, checked against the folder (missing, extra, size)."""
    import tensorflow as tf

    folder, split = metadata["_dir"], metadata["split"]
    listed = {s["file"] for s in metadata["shards"]}
    present = {p.rsplit("/", 1)[-1] for p in split_files(folder, split)}
    missing, extra = sorted(listed - present), sorted(present - listed)
    if missing:
        raise RecordsError(
            f"{len(missing)} shard(s) listed in {split}.metadata.json are missing from"
            f" {folder}: {missing[:3]}. Fix: copy the whole folder again."
        )
    if extra:
        raise RecordsError(
            f"{folder} holds shard(s) {extra[:3]} that {split}.metadata.json does not list"
            " (left from another write?). Fix: remove them or write the split again."
        )
    counted = sum(s["num_records"] for s in metadata["shards"])
    if counted != metadata["num_records"]:
        raise RecordsError(
            f"{split}.metadata.json says {metadata['num_records']} records but its shards"
            f" add up to {counted}. Fix: write the split again."
        )
    shards = []
    for s in metadata["shards"]:
        path = f"{folder}/{s['file']}"
        if check_sizes and "bytes" in s:
            size = tf.io.gfile.stat(path).length
            if size != s["bytes"]:
                raise RecordsError(
                    f"{path} has {size:,} bytes, the metadata says {s['bytes']:,}: the shard is"
                    " truncated or was replaced. Fix: copy it again, or"
                    " on_corrupt='skip' to train without it."
                )
        shards.append(Shard(path, s["num_records"], s.get("lengths")))
    return shards


def scan_shard(path: str, compression: str | None = None) -> tuple[int, str | None]:
    """Read every record of one shard (checking CRCs): ``(records read, error or None)``."""
    import tensorflow as tf

    count = 0
    ds = tf.data.TFRecordDataset(path, compression_type=compression or "").batch(1024)
    try:
        for batch in ds:
            count += int(batch.shape[0])
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as err:
        return count, err.message.split("\n")[0]
    return count, None


def shard_problem(shard: Shard, compression: str | None = None) -> tuple[int, str | None]:
    """Read one shard through (checking CRCs): ``(records read, problem or None)``. A
    problem is a read error (TensorFlow names the offset) or a count that differs from the
    metadata's."""
    count, error = scan_shard(shard.path, compression)
    if error:
        return count, f"{error} (after {count} good records)"
    if shard.num_records is not None and count != shard.num_records:
        return count, f"{count} records, the metadata says {shard.num_records}"
    return count, None


def verify_records(path: str) -> list[str]:
    """Read every shard of a record set and return its problems (empty when sound)."""
    metadata = load_metadata(path)
    problems = []
    for shard in _metadata_shards(metadata, check_sizes=False):
        _, problem = shard_problem(shard, metadata.get("compression"))
        if problem:
            problems.append(f"{shard.path}: {problem}")
    return problems


@dataclass
class RecordSource:
    """The files, parsing spec and counts a reader works from."""

    shards: list[Shard]
    features: dict
    compression: str | None
    skipped: list[str]
    skipped_records: int

    @property
    def num_records(self) -> int | None:
        counts = [s.num_records for s in self.shards]
        return None if None in counts else sum(counts)


def open_records(
    source: str | Sequence[str],
    spec: Mapping | None = None,
    compression: str | None = None,
    on_corrupt: str = "raise",
) -> RecordSource:
    """Resolve ``source`` (a metadata file, a folder with one, a glob or a list of files)
    into shards and a feature spec, checking them before any training step.

    ``spec`` is required for files without metadata (``{"input_ids": {"dtype": "int64",
    "shape": [128]}, ...}``) and, with metadata, must agree with it. ``on_corrupt="skip"``
    reads every shard once, leaves out the corrupt ones and reports the records lost.
    """
    import tensorflow as tf

    if on_corrupt not in ("raise", "skip"):
        raise ValueError(f"on_corrupt={on_corrupt!r}: use 'raise' or 'skip'.")
    metadata = None
    if isinstance(source, str) and (
        source.endswith(".metadata.json")
        or (tf.io.gfile.isdir(source) and tf.io.gfile.glob(f"{source.rstrip('/')}/*.metadata.json"))
    ):
        metadata = load_metadata(source)
    if metadata is not None:
        shards = _metadata_shards(metadata, check_sizes=on_corrupt == "raise")
        features = metadata["features"]
        compression = metadata.get("compression")
        if spec is not None and _normalise(spec) != _normalise(features):
            raise RecordsError(
                f"The spec given ({_normalise(spec)}) differs from the one the records were"
                f" written with ({_normalise(features)}). Fix: leave spec out to use the"
                " metadata's."
            )
    else:
        if isinstance(source, str) and tf.io.gfile.isdir(source):
            pattern = f"{source.rstrip('/')}/*.tfrecord*"
            files = sorted(tf.io.gfile.glob(pattern))
        elif isinstance(source, str):
            pattern, files = source, sorted(tf.io.gfile.glob(source))
        else:
            pattern, files = str(list(source)), list(source)
            absent = [f for f in files if not tf.io.gfile.exists(f)]
            if absent:
                raise FileNotFoundError(f"{absent[0]} does not exist. Fix: check the path.")
        if not files:
            raise FileNotFoundError(
                f"No record files match {pattern}. Fix: check the path (gs:// paths need the"
                " bucket name), or write the records first with write_records."
            )
        if spec is None:
            raise ValueError(
                f"{pattern} has no metadata file, so the feature spec is unknown. Fix: pass"
                " spec={'input_ids': {'dtype': 'int64', 'shape': [128]}, ...}."
            )
        features = _normalise(spec)
        shards = [Shard(f, None) for f in files]
    skipped, lost = [], 0
    if on_corrupt == "skip":
        good = []
        for shard in shards:
            count, problem = shard_problem(shard, compression)
            if problem:
                skipped.append(f"{shard.path}: {problem}")
                lost += shard.num_records if shard.num_records is not None else count
            else:
                good.append(Shard(shard.path, count, shard.lengths))
        if skipped:
            print(
                f"records: skipped {len(skipped)} corrupt shard(s), {lost:,} records not read:\n  "
                + "\n  ".join(skipped)
            )
        if not good:
            raise RecordsError("Every shard is corrupt. Fix: write the records again.")
        shards = good
    _check_first_record(shards[0].path, features, compression)
    return RecordSource(shards, features, compression, skipped, lost)


def _normalise(spec: Mapping) -> dict:
    import tensorflow as tf

    out = {}
    for name, f in spec.items():
        if isinstance(f, tf.io.FixedLenFeature):
            dtype = {v: k for k, v in _tf_dtypes().items()}[f.dtype]
            out[name] = {"dtype": dtype, "shape": list(f.shape)}
        else:
            out[name] = {"dtype": f["dtype"], "shape": list(f["shape"])}
    return out


def _check_first_record(path: str, features: dict, compression: str | None) -> None:
    """Parse one record with the spec, so a wrong spec fails here and names the feature."""
    import tensorflow as tf

    try:
        first = list(tf.data.TFRecordDataset(path, compression_type=compression or "").take(1))
    except tf.errors.DataLossError as err:
        with tf.io.gfile.GFile(path, "rb") as f:
            gzip = f.read(2) == b"\x1f\x8b"
        if gzip and not compression:
            raise RecordsError(
                f"{path} is GZIP-compressed and was read as plain records. Fix:"
                " compression='GZIP' (write_records' metadata says so by itself)."
            ) from None
        raise RecordsError(
            f"{path} cannot be read as {compression or 'uncompressed'} TFRecords"
            f" ({first_line(err, 160)}). Fix: check the compression"
            " (compression='GZIP' or None), or copy the file again."
        ) from None
    if not first:
        return
    example = tf.train.Example.FromString(first[0].numpy()).features.feature
    for name, f in features.items():
        if name not in example:
            raise RecordsError(
                f"The records in {path} have no feature {name!r}; they have"
                f" {sorted(example)}. Fix: correct the spec."
            )
        kind = example[name].WhichOneof("kind")
        want = _LIST_KIND[f["dtype"]]
        if kind != want:
            raise RecordsError(
                f"Feature {name!r} in {path} is a {kind}, the spec says {f['dtype']}."
                " Fix: correct the spec's dtype."
            )
        size = len(getattr(example[name], kind).value)
        expected = math.prod(f["shape"]) if None not in f["shape"] else None
        if expected is not None and size != expected:
            raise RecordsError(
                f"Feature {name!r} in {path} has {size} values, the spec's shape"
                f" {f['shape']} needs {expected}. Fix: correct the spec's shape."
            )


def _length_histogram(source: RecordSource, feature: str) -> Counter | None:
    total: Counter = Counter()
    for shard in source.shards:
        if not shard.lengths or feature not in shard.lengths:
            return None
        total.update({int(k): v for k, v in shard.lengths[feature].items()})
    return total


def record_lengths(source: RecordSource, feature: str = "input_ids") -> np.ndarray:
    """Every record's length of a variable-length ``feature``, from the metadata's
    histograms (no pass over the data): feed it to ``text.choose_boundaries``."""
    hist = _length_histogram(source, feature)
    if hist is None:
        raise RecordsError(f"The metadata has no length histogram for {feature!r}.")
    return np.repeat(np.array(list(hist), np.int64), list(hist.values()))


#: Path schemes every host of a pod slice reads alike (a local path is one host's disk).
SHARED_SCHEMES = ("gs://", "s3://", "hdfs://", "az://", "abfs://", "http://", "https://")


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """What every input pipeline (host) derives alike from the metadata, without talking
    to the others: the batch widths, which shards each pipeline reads for each width, and
    how many steps of each width every pipeline runs.

    ``files[p][i]`` are pipeline ``p``'s shards of width ``widths[i]`` (``widths`` is
    ``(None,)`` for fixed-shape records); ``counts[p][i]`` their records; ``steps[i]`` the
    steps of width ``i`` per epoch, the same on every pipeline: enough for the pipeline
    with the most records of that width, the others completing theirs with weight-0 rows.
    ``counts`` and ``steps`` are ``None`` for files without metadata (no counts).
    """

    widths: tuple
    batch_size: int
    local_replicas: int
    files: tuple
    counts: np.ndarray | None
    steps: np.ndarray | None
    mixed: tuple = ()

    @property
    def steps_per_epoch(self) -> int | None:
        return None if self.steps is None else int(self.steps.sum())

    @property
    def filler_share(self) -> float | None:
        """Share of all rows of an epoch, over every pipeline, that are weight-0 fillers."""
        if self.steps is None:
            return None
        rows = self.steps_per_epoch * self.local_replicas * self.batch_size * len(self.files)
        return 1 - int(self.counts.sum()) / rows

    def shard_records_hint(self) -> int:
        """A ``shard_records`` for ``write_records`` that gives every pipeline about two
        shards of each width (fewer fillers on many hosts)."""
        per_width = self.counts.sum(axis=0)
        return max(1, int(per_width[per_width > 0].min()) // (2 * len(self.files)))

    def schedule(self) -> np.ndarray:
        """Width index of each step, in width order (shuffled per epoch when reading)."""
        return np.repeat(np.arange(len(self.widths)), self.steps)


def _length_key(features: Mapping) -> tuple[list[str], str | None]:
    """The variable-length features, and the one whose length picks a batch's width
    (``input_ids`` if there is one; the writer groups shards by the same feature)."""
    variable = [n for n, f in features.items() if f["shape"] == [None]]
    key = ("input_ids" if "input_ids" in variable else variable[0]) if variable else None
    return variable, key


def _shard_slot(shard: Shard, key: str | None, widths: Sequence) -> tuple[int, bool]:
    """``(width index, mixed)``: the narrowest width that holds the shard's longest record
    (from its length histogram), and whether its records need several widths."""
    if key is None or len(widths) == 1:
        return 0, False
    hist = (shard.lengths or {}).get(key)
    if not hist:
        return len(widths) - 1, True
    lengths = np.minimum(np.array([int(k) for k in hist]), widths[-1])
    slots = np.searchsorted(widths, lengths)
    return int(slots.max()), bool(slots.min() != slots.max())


def plan_reads(
    source: RecordSource,
    batch_size: int,
    boundaries: Sequence[int] | None = None,
    pipelines: int = 1,
    local_replicas: int = 1,
) -> ReadPlan:
    """The ``ReadPlan`` of ``source`` read in batches of ``batch_size`` rows (per replica
    with several replicas) by ``pipelines`` input pipelines of ``local_replicas`` each.

    Shards go to pipelines whole, each width's shards spread so that the records of that
    width are as even as the shard sizes allow (largest first, to the pipeline with the
    fewest so far). Pure arithmetic on the metadata: every host computes the same plan.
    """
    key = _length_key(source.features)[1]
    if key is None:
        widths: tuple = (None,)
    else:
        if boundaries is None:
            hist = _length_histogram(source, key)
            if not hist:
                raise RecordsError(
                    "Pass boundaries= for variable-length records without metadata (for"
                    " example the longest length you allow: boundaries=[128])."
                )
            boundaries = [max(hist)]
        widths = tuple(check_boundaries(boundaries))
    known = all(s.num_records is not None for s in source.shards)
    if not known and len(widths) > 1:
        # without counts no step schedule can be drawn: every batch takes the widest width
        widths = widths[-1:]
    slots = [[[] for _ in widths] for _ in range(pipelines)]
    counts = np.zeros((pipelines, len(widths)), np.int64)
    mixed = []
    by_slot: dict[int, list[Shard]] = {}
    for shard in source.shards:
        slot, spans = _shard_slot(shard, key, widths)
        by_slot.setdefault(slot, []).append(shard)
        if spans or (not known and key is not None and boundaries and len(boundaries) > 1):
            mixed.append(shard.path)
    for slot, shards in by_slot.items():
        for shard in sorted(shards, key=lambda s: (-(s.num_records or 0), s.path)):
            p = int(np.argmin(counts[:, slot])) if known else len(slots[0][slot]) % pipelines
            slots[p][slot].append(shard.path)
            counts[p, slot] += shard.num_records or 0
    files = tuple(tuple(tuple(sorted(paths)) for paths in row) for row in slots)
    if not known:
        return ReadPlan(widths, batch_size, local_replicas, files, None, None, tuple(mixed))
    batches = -(-counts // batch_size)
    steps = (-(-batches // local_replicas)).max(axis=0)
    return ReadPlan(widths, batch_size, local_replicas, files, counts, steps, tuple(mixed))


def _check_for_reading(
    source: RecordSource, label_column: str | None, num_labels: int | None = None
) -> None:
    """The checks every read makes before any record is parsed (labels from the
    metadata's range: under XLA a label out of range is a NaN loss, not an error)."""
    if label_column is not None and label_column not in source.features:
        raise RecordsError(
            f"The records have no label feature {label_column!r}; they have"
            f" {sorted(source.features)}. Fix: pass label_column= one of those, or None."
        )
    for name, f in source.features.items():
        if f.get("dtype") == "int64" and "min" in f:
            try:
                check_int32(f["min"], f["max"], name)
            except ValueError as err:
                raise RecordsError(str(err)) from None
    label = source.features.get(label_column) if label_column else None
    if label and label.get("shape") == [] and label.get("min", 0) < 0:
        raise RecordsError(
            f"Feature {label_column!r} holds label {label['min']}: a split without labels"
            " (GLUE test splits use -1) trains to a NaN loss. Fix: write a labelled split,"
            " or leave out those rows before writing."
        )
    if label and num_labels is not None and label.get("max", 0) >= num_labels:
        raise RecordsError(
            f"Feature {label_column!r} holds label {label['max']}, and the model has"
            f" {num_labels} labels (0 to {num_labels - 1}). Fix: num_labels={label['max'] + 1}"
            " for the model (and its id2label), or check the records' label column."
        )


def _check_hosts(source: RecordSource, pipelines: int, shared_filesystem: bool) -> None:
    """Several input pipelines are several hosts: each must reach the files, and each
    must have files of its own and know how many records all the others have."""
    if pipelines == 1:
        return
    path = source.shards[0].path
    if not shared_filesystem and not path.startswith(SHARED_SCHEMES):
        raise RecordsError(
            f"{path} is a path on this host, and {pipelines} input pipelines run on"
            f" {pipelines} hosts, which cannot read this host's disk. Fix: copy the records"
            " to a bucket (gsutil -m cp -r <folder> gs://<bucket>/<prefix>) and read from"
            " there, or pass shared_filesystem=True if every host mounts this folder"
            " (NFS, Filestore, gcsfuse)."
        )
    if len(source.shards) < pipelines:
        raise RecordsError(
            f"{len(source.shards)} shard(s) cannot feed {pipelines} input pipelines: each host"
            f" reads whole files. Fix: write the records again with shard_records="
            f"{max(1, (source.num_records or pipelines) // (4 * pipelines))} (4 shards per"
            " host or more)."
        )
    if source.num_records is None:
        raise RecordsError(
            f"{pipelines} input pipelines must all run the same number of steps, which needs"
            " each shard's record count, and these files have no metadata. Fix: write them"
            " with write_records, or open them with open_records(..., on_corrupt='skip'),"
            " which counts the records of every shard."
        )


def _filler_record(features: Mapping) -> bytes:
    """One serialized record that parses with ``features``: zeros (one value for each
    variable-length feature, 1 for an ``attention_mask``). Rows made of it carry weight 0."""
    import tensorflow as tf

    feature = {}
    for name, f in features.items():
        size = 1 if f["shape"] == [None] else math.prod(f["shape"])
        value = 1 if name == "attention_mask" else 0
        if f["dtype"] == "int64":
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=[value] * size))
        elif f["dtype"] == "float32":
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=[0.0] * size))
        else:
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[b""] * size))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _batch_maker(source: RecordSource, rows: int, label_column: str | None):
    """``parse(records, width, real)``: one op parses a batch of serialized records and
    pads its variable-length features to ``width`` (a tensor: batches of any width go
    through the same map); a batch shorter than ``rows`` is completed with copies, and
    rows from ``real`` on weigh 0 (``real=0``: a batch of fillers; ``real=-1``: every
    record of the batch)."""
    import tensorflow as tf

    spec = _spec_to_tf(source.features)
    variable, key = _length_key(source.features)

    def parse(serialized, width, real):
        # Few ops per batch: a tf.data function pays for each op it runs, and a cond is
        # lowered to switch and merge nodes; the gather that completes a short batch with
        # copies runs on full batches too (an identity there).
        parsed = tf.io.parse_example(serialized, spec)
        n = tf.shape(serialized)[0]
        shape = tf.stack([n, width])
        if key is not None and "attention_mask" not in parsed:
            parsed["attention_mask"] = tf.ones_like(parsed[key]).to_tensor(shape=shape)
        take = tf.range(rows) % n
        out = {}
        for name, value in parsed.items():
            if name in variable:
                value = value.to_tensor(shape=shape)
            value = tf.gather(value, take)
            value = tf.cast(value, tf.int32) if value.dtype == tf.int64 else value
            out[name] = tf.ensure_shape(value, [rows, *value.shape[1:]])
        real = tf.where(real < 0, n, real)
        weights = tf.ensure_shape(tf.cast(tf.range(rows) < real, tf.float32), [rows])
        if label_column is None:
            return out, weights
        labels = out.pop(label_column)
        return out, labels, weights

    return parse


def _file_reader(names, compression: str):
    """The records of the files ``names`` (a string vector), one file after another, read
    by one reader op: ``tf.data.TFRecordDataset`` wraps each file in a ``flat_map``, whose
    function every new iterator instantiates again (a few milliseconds per width)."""
    import tensorflow as tf

    variant = tf.raw_ops.TFRecordDataset(
        filenames=names, compression_type=compression, buffer_size=256 * 1024
    )
    return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))


def _shuffled(ds, buffer: int, seed):
    """``ds`` (scalar strings) through a shuffle buffer of ``buffer`` records whose order
    depends on ``seed`` (``[2]`` int64, e.g. from ``_epoch_seed``) alone: ``Dataset.shuffle``
    would mix in TensorFlow's global seed, which a resumed run may not share."""
    import tensorflow as tf

    variant = tf.raw_ops.ShuffleDatasetV3(
        input_dataset=tf.data.experimental.to_variant(ds),
        buffer_size=tf.constant(buffer, tf.int64),
        seed=seed[0],
        seed2=seed[1],
        seed_generator=tf.raw_ops.DummySeedGenerator(),
        output_types=[tf.string],
        output_shapes=[[]],
        reshuffle_each_iteration=False,
    )
    return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))


def _epoch_seed(seed: int, salt: int, epoch, index=0):
    """A stateless seed ``[2]`` for ``(seed, salt)`` in ``epoch`` at ``index``."""
    import tensorflow as tf

    base = (seed * 1_000_003 + salt) % 2**62
    return tf.stack(
        [tf.constant(base, tf.int64), tf.cast(epoch, tf.int64) * 2**32 + tf.cast(index, tf.int64)]
    )


def read_records(
    source: str | Sequence[str] | RecordSource,
    batch_size: int,
    label_column: str | None = "label",
    boundaries: Sequence[int] | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    shuffle_buffer: int = 8192,
    parallel_reads: int | None = None,
    input_context=None,
    spec: Mapping | None = None,
    on_corrupt: str = "raise",
    repeat: bool = False,
    epoch: int = 0,
    skip_steps: int = 0,
    shared_filesystem: bool = False,
    transform=None,
    num_labels: int | None = None,
):
    """A ``tf.data.Dataset`` of ``(features, labels, weights)`` batches of exactly
    ``batch_size`` rows from TFRecord shards (see ``open_records`` for ``source``, ``spec``,
    ``on_corrupt``); ``(features, weights)`` with ``label_column=None``. Every record is
    read once per epoch with weight 1; the rows that complete a short batch are copies
    weighted 0 (``fit`` takes weights as sample weights, ``CustomLoop`` as its third
    element). Integers become int32.

    Variable-length features are padded to one of ``boundaries`` per batch (from
    ``text.choose_boundaries(record_lengths(...))``; default: the longest record), and an
    ``attention_mask`` is added when the records have none. Each width reads its own
    shards (``write_records`` groups records by length), so a batch of any width can be
    made on any host: the step widths follow a schedule drawn from ``(seed, epoch)`` alone
    (see ``plan_reads``). Batches of serialized records are parsed and padded in one op.

    Shuffling, from ``(seed, epoch)`` alone (the same epoch gives the same order, so a
    resumed run with ``epoch`` and ``skip_steps`` sees the batches an uninterrupted one
    would; TensorFlow's global seed plays no part): the file order, the records through a
    buffer of ``shuffle_buffer`` records (per width), and the order of the widths. Write
    shards from data that is not sorted by label. ``seed=None``: a random seed (0 with
    several input pipelines, which must agree).

    tf.data's static graph rewrites are turned off on the returned dataset (the pipeline
    has its parallel map and prefetch already, and the rewrites cost each new iterator
    milliseconds per width); ``with_options`` turns them back on for what you add to it.

    ``parallel_reads``: files read at once (default 8 for ``gs://``-like paths, where each
    read waits on the network; 1 for local ones). With ``input_context`` (from
    ``strategy.distribute_datasets_from_function``) ``batch_size`` is per replica, each input
    pipeline reads its own shards, yields one batch per local replica per step, all of one
    width, and all pipelines run the same steps; the files must be on a bucket (or
    ``shared_filesystem=True``). ``repeat`` goes on with epoch ``epoch + 1`` and so on.
    The steps per epoch are on the dataset as ``steps`` (``None`` without record counts).
    ``transform`` (a function of the dataset, such as ``observe.CompileWatch.watch``) is
    applied to the batches before prefetching. ``num_labels``: the model's number of
    labels; records whose labels reach it are refused before any step.
    """
    import tensorflow as tf

    from tpu_helpers.storage import is_remote

    check_positive(batch_size=batch_size)
    if not isinstance(source, RecordSource):
        source = open_records(source, spec=spec, on_corrupt=on_corrupt)
    # 1. check
    _check_for_reading(source, label_column, num_labels)
    if boundaries is not None:
        boundaries = check_boundaries(boundaries)
    pipelines, pipeline, local = 1, 0, 1
    if input_context is not None:
        pipelines, pipeline = input_context.num_input_pipelines, input_context.input_pipeline_id
        local = max(1, input_context.num_replicas_in_sync // pipelines)
    _check_hosts(source, pipelines, shared_filesystem)
    # 2. which shards this pipeline reads, and the steps of each width
    plan = plan_reads(source, batch_size, boundaries, pipelines, local)
    if plan.mixed and pipeline == 0:
        print(
            f"records: {len(plan.mixed)} shard(s) hold records of several widths (written"
            " without length groups, or without metadata); their batches are padded to the"
            f" widest of them. Fix: write the records again with write_records (groups by"
            f" length). First: {plan.mixed[0]}"
        )
    steps = plan.steps_per_epoch
    if pipelines > 1 and pipeline == 0 and plan.filler_share > 0.25:
        print(
            f"records: {plan.filler_share:.0%} of the rows of an epoch are weight-0 fillers:"
            f" some widths have fewer shards than the {pipelines} hosts, whose steps the"
            " others wait through. Fix: write the records with smaller shards"
            f" (write_records(..., shard_records={plan.shard_records_hint()}))."
        )
    if steps == 0:
        raise ValueError(f"The records make no batch of {batch_size}. Fix: check the source.")
    if seed is None:
        seed = 0 if pipelines > 1 else int(np.random.SeedSequence().entropy % 2**31)
    if parallel_reads is None:
        parallel_reads = 8 if is_remote(source.shards[0].path) else 1
    compression = source.compression or ""
    parse = _batch_maker(source, batch_size, label_column)
    filler = tf.fill([batch_size], _filler_record(source.features))
    single = len(plan.widths) == 1

    # 3. per width: this pipeline's shards, shuffled, in batches of serialized records
    def width_batches(slot: int, e):
        width = tf.constant(plan.widths[slot] or 0, tf.int32)
        paths = plan.files[pipeline][slot]
        wanted = None if plan.steps is None else int(plan.steps[slot]) * local
        fillers = tf.data.Dataset.from_tensors((filler, (width, tf.constant(0))))
        if not paths:
            return fillers.repeat(wanted)  # only with several widths
        salt = (pipeline + 1) * 1000 + slot
        names = tf.constant(list(paths))
        if shuffle:
            names = tf.random.experimental.stateless_shuffle(names, _epoch_seed(seed, salt, e))
        if parallel_reads > 1 and len(paths) > 1:
            ds = tf.data.Dataset.from_tensor_slices(names).interleave(
                lambda f: tf.data.TFRecordDataset(f, compression_type=compression),
                cycle_length=min(parallel_reads, len(paths)),
                num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True,
            )
        else:
            ds = _file_reader(names, compression)
        if shuffle:
            ds = _shuffled(ds, shuffle_buffer, _epoch_seed(seed, salt + 500, e))
        ds = ds.batch(batch_size)
        # each batch carries its width and real rows (-1: all), by zip: no function
        tag = tf.data.Dataset.from_tensors((width, tf.constant(-1))).repeat()
        ds = tf.data.Dataset.zip((ds, tag))
        if wanted is not None:
            have = -(-int(plan.counts[pipeline, slot]) // batch_size)
            if wanted > have:
                ds = ds.concatenate(fillers.repeat(wanted - have))
        return ds

    # 4. one epoch: the widths in the order of the schedule, the same on every pipeline
    def one_epoch(e):
        parts = [width_batches(i, e) for i in range(len(plan.widths))]
        if single:
            return parts[0]
        order = tf.constant(plan.schedule(), tf.int64)
        if shuffle:
            order = tf.random.experimental.stateless_shuffle(order, _epoch_seed(seed, 0, e))
        choice = tf.data.Dataset.from_tensor_slices(tf.repeat(order, local))
        return tf.data.Dataset.choose_from_datasets(parts, choice)

    # 5. epochs, resumption, counts; then one parallel map parses the raw batches (once per
    # iterator, not per epoch; skipped steps are not parsed), options
    if repeat:
        ds = tf.data.Dataset.range(epoch, 2**62).flat_map(one_epoch)
    else:
        ds = one_epoch(tf.constant(epoch, tf.int64))
        if steps is not None:
            ds = ds.apply(tf.data.experimental.assert_cardinality(steps * local))
    if skip_steps:
        ds = ds.skip(skip_steps * local)
    ds = ds.map(lambda r, tag: parse(r, *tag), num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
        if input_context is not None
        else tf.data.experimental.AutoShardPolicy.FILE
    )
    # The parse map is parallel and the end prefetched already; running tf.data's static
    # rewrites costs every new iterator (each epoch of fit) time that grows with the graph.
    options.experimental_optimization.apply_default_optimizations = False
    if transform is not None:
        ds = transform(ds)
    ds = ds.with_options(options).prefetch(tf.data.AUTOTUNE)
    ds.steps = steps
    ds.plan = plan
    return ds


def distribute_records(strategy, source, per_replica_batch: int, **kwargs):
    """``read_records`` for every replica of ``strategy``, through
    ``distribute_datasets_from_function``: each input pipeline (host) reads its own shards
    and makes the per-replica batches of its replicas, all replicas of a step share one
    width, and every pipeline runs the same steps. Returns ``(distributed dataset, steps
    per epoch)``. Takes ``read_records``' keyword arguments (``epoch``, ``skip_steps``,
    ``boundaries``, ``seed``, ``shared_filesystem`` ...).
    """
    from tpu_helpers.text import global_batch_size

    global_batch = global_batch_size(per_replica_batch, strategy.num_replicas_in_sync)
    if not isinstance(source, RecordSource):
        source = open_records(
            source, spec=kwargs.pop("spec", None), on_corrupt=kwargs.pop("on_corrupt", "raise")
        )
    steps = {}

    def dataset_fn(input_context):
        ds = read_records(
            source,
            input_context.get_per_replica_batch_size(global_batch),
            input_context=input_context,
            **kwargs,
        )
        steps["per_epoch"] = ds.steps
        return ds

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    return dist, steps.get("per_epoch")
