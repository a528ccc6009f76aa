"""``write_records``: chunks encoded and rotated into shards in a staging folder, then
committed (shards moved, metadata written last).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import ExistingFileError, InputError
from tpu_helpers.data.records.encode import Column, as_column, encode_examples, row_chunks
from tpu_helpers.data.records.layout import (
    DEFAULT_SHARD_BYTES,
    FORMAT,
    metadata_path,
    shard_name,
    split_files,
)


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


def _check_write_options(compression, shard_bytes, shard_records, group_lengths) -> None:
    if compression not in (None, "GZIP"):
        raise InputError(f"compression={compression!r}: use None or 'GZIP'.")
    if shard_records is not None and shard_records < 1:
        raise InputError(f"shard_records={shard_records} must be a positive number of records.")
    if group_lengths is not None and (
        isinstance(group_lengths, bool) or not isinstance(group_lengths, int) or group_lengths < 1
    ):
        raise InputError(f"group_lengths={group_lengths!r} must be a positive integer or None.")
    if shard_records is None and (shard_bytes is None or shard_bytes < 1):
        raise InputError(f"shard_bytes={shard_bytes} must be a positive size in bytes.")


def _typed_chunk(chunk: Mapping, info: dict[str, Column], first_row: int) -> dict:
    """One chunk's columns as ``{name: (dtype, flat values, lengths)}``, each checked
    against the type its column had in earlier chunks (``info``, updated here)."""
    encoded = {}
    for name, values in chunk.items():
        dtype, scalar, flat, lengths = as_column(name, values, first_row)
        known = info.get(name)
        if known is None:
            known = info[name] = Column(dtype, scalar, Counter())
        elif (known.dtype, known.scalar) != (dtype, scalar):
            raise InputError(
                f"Column {name!r} changes type at row {first_row}: {known.dtype}"
                f"{'' if known.scalar else ' list'} before, {dtype}"
                f"{'' if scalar else ' list'} now. Fix: cast the column to one type."
            )
        known.see(flat)
        encoded[name] = (dtype, flat, lengths)
    if set(encoded) != set(info):
        raise InputError(
            f"Rows from {first_row} have columns {sorted(encoded)}, earlier rows"
            f" {sorted(info)}. Fix: give every example the same columns."
        )
    return encoded


@dataclass
class _OpenShard:
    writer: object  # tf.io.TFRecordWriter
    index: int  # in the order shards were opened
    records: int = 0
    bytes: int = 0


class _ShardWriter:
    """Shards in ``staging``: one open shard per length group, rotated when the next
    records would pass ``shard_bytes`` (or ``shard_records``); each shard's length
    histograms, for the metadata."""

    def __init__(self, staging, split, compression, shard_bytes, shard_records):
        import tensorflow as tf

        self.staging, self.split = staging, split
        self.options = tf.io.TFRecordOptions(compression_type=compression or "")
        self.shard_bytes, self.shard_records = shard_bytes, shard_records
        self.paths: list[str] = []  # temporary paths, in the order opened
        self.counts: list[int] = []
        self.group_of: list[int] = []
        self.lengths: list[dict[str, Counter]] = []
        self.open: dict[int, _OpenShard] = {}

    def _rotate(self, group: int) -> _OpenShard:
        import tensorflow as tf

        self._close(group)
        path = f"{self.staging}/{self.split}-{len(self.paths):05d}.tfrecord.incomplete"
        self.paths.append(path)
        self.counts.append(0)
        self.group_of.append(group)
        self.lengths.append({})
        self.open[group] = _OpenShard(tf.io.TFRecordWriter(path, self.options), len(self.paths) - 1)
        return self.open[group]

    def _close(self, group: int) -> None:
        shard = self.open.pop(group, None)
        if shard is not None:
            shard.writer.close()
            self.counts[shard.index] = shard.records

    def _room(self, shard: _OpenShard | None, ends: np.ndarray, pos: int) -> int:
        """How many of the next records (cumulative sizes ``ends``, from ``pos``) fit."""
        if shard is None:
            return 0
        if self.shard_records is not None:
            return min(self.shard_records - shard.records, len(ends) - pos)
        done = ends[pos - 1] if pos else 0
        take = int(np.searchsorted(ends, done + self.shard_bytes - shard.bytes, side="right")) - pos
        return 1 if take == 0 and shard.records == 0 else take  # an oversized record alone

    def write(self, records: list[bytes], groups: np.ndarray) -> np.ndarray:
        """Write a chunk's records, each into its group's shard; return each one's shard."""
        sizes = np.array([len(r) + 16 for r in records])  # + length and two CRCs
        shard_of = np.empty(len(records), np.int64)
        for group in np.unique(groups).tolist():
            rows = np.flatnonzero(groups == group)
            ends = np.cumsum(sizes[rows])
            pos = 0
            while pos < len(rows):
                shard = self.open.get(group)
                take = self._room(shard, ends, pos)
                if take <= 0:
                    self._rotate(group)
                    continue
                for row in rows[pos : pos + take].tolist():
                    shard.writer.write(records[row])
                shard.records += take
                shard.bytes += int(ends[pos + take - 1] - (ends[pos - 1] if pos else 0))
                shard_of[rows[pos : pos + take]] = shard.index
                pos += take
        return shard_of

    def count_lengths(self, encoded: dict, info: dict[str, Column], shard_of) -> None:
        """Add a chunk's list lengths to each shard's histograms and the columns'."""
        for name, (_, _, lengths) in encoded.items():
            if info[name].scalar:
                continue
            for shard in np.unique(shard_of).tolist():
                values, counts = np.unique(lengths[shard_of == shard], return_counts=True)
                histogram = dict(zip(values.tolist(), counts.tolist(), strict=True))
                self.lengths[shard].setdefault(name, Counter()).update(histogram)
                info[name].lengths.update(histogram)

    def close(self) -> None:
        for group in list(self.open):
            self._close(group)

    def abort(self) -> None:
        for shard in self.open.values():
            shard.writer.close()
        _remove_tree(self.staging)

    def name_shards(self, compression, info: dict[str, Column]) -> list[dict]:
        """Give the shards their final names, in length order (a reader lists them grouped
        by the widths they need); return their metadata entries."""
        import tensorflow as tf

        order = sorted(range(len(self.paths)), key=lambda i: (self.group_of[i], i))
        entries = []
        for index, shard in enumerate(order):
            final = f"{self.staging}/{shard_name(self.split, index, len(order), compression)}"
            tf.io.gfile.rename(self.paths[shard], final, overwrite=True)
            entry = {
                "file": final.rsplit("/", 1)[-1],
                "num_records": self.counts[shard],
                "bytes": tf.io.gfile.stat(final).length,
            }
            variable = {
                name: {str(k): v for k, v in sorted(c.items())}
                for name, c in self.lengths[shard].items()
                if info[name].spec()["shape"] == [None]
            }
            if variable:
                entry["lengths"] = variable
            entries.append(entry)
        return entries


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

    _check_write_options(compression, shard_bytes, shard_records, group_lengths)
    output_dir = output_dir.rstrip("/")
    before = _split_state(output_dir, split)
    _refuse_existing(output_dir, split, before, overwrite)
    staging, write_id = _new_staging_folder(output_dir, split)
    if total is None and hasattr(examples, "__len__"):
        total = len(examples)
    shards = _ShardWriter(staging, split, compression, shard_bytes, shard_records)
    info: dict[str, Column] = {}
    rows = row_chunks(examples, chunk_size, columns)
    written = _write_chunks(rows, shards, info, group_lengths, total, progress)
    _refuse_nothing_written(written, staging, before)
    metadata = {
        "format": FORMAT,
        "split": split,
        "num_records": written,
        "compression": compression,
        "features": {name: col.spec() for name, col in info.items()},
        "shards": shards.name_shards(compression, info),
        "group_lengths": group_lengths,
        "source": dict(source or {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "write_id": write_id,
    }
    with tf.io.gfile.GFile(f"{staging}/{split}.metadata.json", "w") as f:
        json.dump(metadata, f, indent=1)
    _commit(staging, output_dir, split, before, [s["file"] for s in metadata["shards"]])
    return metadata


def _new_staging_folder(output_dir: str, split: str) -> tuple[str, str]:
    """``(staging, write_id)``: a new folder of this writer's own under ``output_dir``, and
    the id that names it."""
    import tensorflow as tf

    # Shards are written into a folder of this writer's own, hidden from readers' globs,
    # and move next to the others only once all of them (and their metadata) exist.
    write_id = uuid.uuid4().hex[:12]
    staging = f"{output_dir}/.writing-{split}-{write_id}"
    tf.io.gfile.makedirs(staging)
    return staging, write_id


def _refuse_nothing_written(written: int, staging: str, before: tuple) -> None:
    """``InputError`` (the ``staging`` folder removed) when no example was ``written``;
    ``before`` is the split's state before writing (records it held are kept)."""
    if not written:
        _remove_tree(staging)
        raise InputError(
            "There were no examples to write. Fix: check the data set or split"
            + (" (the existing records were kept)." if before[1] else ".")
        )


def _refuse_existing(output_dir: str, split: str, before: tuple, overwrite: bool) -> None:
    """``FileExistsError`` when ``output_dir`` holds the split already and ``overwrite``
    was not asked for."""
    if (before[0] is not None or before[1]) and not overwrite:
        raise ExistingFileError(
            f"{output_dir} already holds records of split {split!r}"
            f" ({len(before[1])} shard(s)). Fix: another output_dir or split, or"
            " overwrite=True to replace them (the old ones stay until the new ones are"
            " complete)."
        )


def _write_chunks(chunks, shards, info: dict, group_lengths, total, progress: bool) -> int:
    """Type, encode and write every chunk of rows into ``shards`` (grouped by length),
    collecting the columns' types and length histograms in ``info``; return the number of
    records written. On any error, or an interrupt, the shards written so far are removed."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="ex", desc=f"write {shards.split}", disable=not progress)
    written = 0
    try:
        for chunk in chunks:
            encoded = _typed_chunk(chunk, info, written)
            records = encode_examples(encoded)
            lists = [n for n in encoded if not info[n].scalar]
            shard_of = shards.write(
                records, _length_groups(encoded, lists, len(records), group_lengths)
            )
            shards.count_lengths(encoded, info, shard_of)
            written += len(records)
            bar.update(len(records))
        shards.close()
    except BaseException:
        shards.abort()
        raise
    finally:
        bar.close()
    return written


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
        raise ExistingFileError(
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
