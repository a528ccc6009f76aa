"""Opening a record set (metadata, a folder, a glob or files) into shards and a spec,
checked against the folder before any step; verifying every record.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.checks import first_line
from tpu_helpers.core.errors import InputError, MissingFileError
from tpu_helpers.core.messages import say
from tpu_helpers.data.records.layout import (
    DTYPES,
    FORMAT,
    LIST_KIND,
    RecordsError,
    metadata_path,
    split_files,
    tf_dtypes,
)


def spec_to_tf(features: Mapping[str, Mapping]) -> dict:
    import tensorflow as tf

    tf_dtype = tf_dtypes()
    spec = {}
    for name, f in features.items():
        if f["dtype"] not in DTYPES:
            raise RecordsError(f"Feature {name!r} has dtype {f['dtype']!r}, not one of {DTYPES}.")
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
            raise MissingFileError(
                f"{path} holds {len(found)} metadata files"
                f" ({[p.rsplit('/', 1)[-1] for p in found]}). Fix: pass the path of one"
                " <split>.metadata.json, or files= and spec= for records without metadata."
            )
        path = found[0]
    if not tf.io.gfile.exists(path):
        raise MissingFileError(f"{path} does not exist. Fix: check the path or bucket.")
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
        for key in ("num_records", "bytes"):  # "bytes": optional, write_records adds it
            value = shard.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"shards[{i}]", f"has {key} {value!r}, not a count (an int from 0)")
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
        if check_sizes:
            size = tf.io.gfile.stat(path).length
            if "bytes" in s and size != s["bytes"]:
                raise RecordsError(
                    f"{path} has {size:,} bytes, the metadata says {s['bytes']:,}: the shard is"
                    " truncated or was replaced. Fix: copy it again, or"
                    " on_corrupt='skip' to train without it."
                )
            _check_count_fits(path, size, s["num_records"], metadata)
        shards.append(Shard(path, s["num_records"], s.get("lengths")))
    return shards


#: Bytes a TFRecord record takes besides its data: its length (8), the length's CRC (4)
#: and the data's CRC (4).
RECORD_FRAMING_BYTES = 16


def _check_count_fits(path: str, size: int, count: int, metadata: dict) -> None:
    """Refuse a shard whose metadata count its file cannot hold (fewer than 16 bytes a
    record), or a count of 0 for a file with records: found here, the wrong count would
    otherwise stop the run at the end of the first epoch, inside tf.data. ``size`` is
    the shard's ``stat``, which the check of the metadata's ``bytes`` makes anyway. A GZIP
    shard has no such bound (records compress): only a count of 0 is checked, by reading
    one record."""
    import tensorflow as tf

    split = metadata["split"]
    meta_file = metadata_path(metadata["_dir"], split)
    fix = (
        f" Fix: records.verify_records({meta_file!r}) counts every shard's records; then"
        " write the split again (write_records(..., overwrite=True)) or copy the folder"
        " again as it was written."
    )
    compression = metadata.get("compression") or ("GZIP" if path.endswith(".gz") else None)
    if compression:
        if count > 0 or size == 0:
            return
        try:
            holds = list(tf.data.TFRecordDataset(path, compression_type=compression).take(1))
        except tf.errors.OpError:
            return  # unreadable: the reading names that, with its own fix
        if holds:
            raise RecordsError(
                f"{path} holds records, but {split}.metadata.json says 0: the count is wrong"
                " (hand-edited?) or the shard was replaced." + fix
            )
        return
    if size >= RECORD_FRAMING_BYTES * count and (count > 0 or size == 0):
        return
    with tf.io.gfile.GFile(path, "rb") as f:
        if f.read(3) == b"\x1f\x8b\x08":  # a GZIP header (deflate)
            raise RecordsError(
                f"{path} is GZIP-compressed, and {split}.metadata.json has no"
                ' "compression": "GZIP". Fix: write the split again (write_records'
                " records the compression it used)."
            )
    if count == 0:
        raise RecordsError(
            f"{path} has {size:,} bytes, but {split}.metadata.json says it holds 0 records:"
            " the count is wrong (hand-edited?) or the shard was replaced." + fix
        )
    raise RecordsError(
        f"{path} has {size:,} bytes, too few for the {count:,} records {split}.metadata.json"
        f" says it holds (a TFRecord record takes at least {RECORD_FRAMING_BYTES} bytes, so"
        f" at most {size // RECORD_FRAMING_BYTES:,} fit): the count is wrong (hand-edited?)"
        " or the shard was replaced or cut short." + fix
    )


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
        raise InputError(f"on_corrupt={on_corrupt!r}: use 'raise' or 'skip'.")
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
        shards, features = _files_without_metadata(source, spec)
    skipped, lost = [], 0
    if on_corrupt == "skip":
        shards, skipped, lost = _without_corrupt(shards, compression)
    _check_first_record(shards[0].path, features, compression)
    return RecordSource(shards, features, compression, skipped, lost)


def _files_without_metadata(source, spec: Mapping | None) -> tuple[list[Shard], dict]:
    """The shards of a folder, glob or list of record files without metadata, and ``spec``
    (which is then required) normalised."""
    import tensorflow as tf

    if isinstance(source, str) and tf.io.gfile.isdir(source):
        pattern = f"{source.rstrip('/')}/*.tfrecord*"
        files = sorted(tf.io.gfile.glob(pattern))
    elif isinstance(source, str):
        pattern, files = source, sorted(tf.io.gfile.glob(source))
    else:
        pattern, files = str(list(source)), list(source)
        absent = [f for f in files if not tf.io.gfile.exists(f)]
        if absent:
            raise MissingFileError(f"{absent[0]} does not exist. Fix: check the path.")
    if not files:
        raise MissingFileError(
            f"No record files match {pattern}. Fix: check the path (gs:// paths need the"
            " bucket name), or write the records first with write_records."
        )
    if spec is None:
        raise InputError(
            f"{pattern} has no metadata file, so the feature spec is unknown. Fix: pass"
            " spec={'input_ids': {'dtype': 'int64', 'shape': [128]}, ...}."
        )
    return [Shard(f, None) for f in files], _normalise(spec)


def _without_corrupt(shards: list[Shard], compression) -> tuple[list[Shard], list[str], int]:
    """Read every shard once: the readable ones (with their counted records), what was
    wrong with each of the others, and the records lost with them (printed too)."""
    skipped, lost, good = [], 0, []
    for shard in shards:
        count, problem = shard_problem(shard, compression)
        if problem:
            skipped.append(f"{shard.path}: {problem}")
            lost += shard.num_records if shard.num_records is not None else count
        else:
            good.append(Shard(shard.path, count, shard.lengths))
    if skipped:
        say(
            f"records: skipped {len(skipped)} corrupt shard(s), {lost:,} records not read:\n  "
            + "\n  ".join(skipped)
        )
    if not good:
        raise RecordsError("Every shard is corrupt. Fix: write the records again.")
    return good, skipped, lost


def _normalise(spec: Mapping) -> dict:
    import tensorflow as tf

    out = {}
    for name, f in spec.items():
        if isinstance(f, tf.io.FixedLenFeature):
            dtype = {v: k for k, v in tf_dtypes().items()}[f.dtype]
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
        want = LIST_KIND[f["dtype"]]
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


def length_histogram(source: RecordSource, feature: str) -> Counter | None:
    total: Counter = Counter()
    for shard in source.shards:
        if not shard.lengths or feature not in shard.lengths:
            return None
        total.update({int(k): v for k, v in shard.lengths[feature].items()})
    return total


def record_lengths(source: RecordSource, feature: str = "input_ids") -> np.ndarray:
    """Every record's length of a variable-length ``feature``, from the metadata's
    histograms (no pass over the data): feed it to ``text.choose_boundaries``."""
    hist = length_histogram(source, feature)
    if hist is None:
        raise RecordsError(f"The metadata has no length histogram for {feature!r}.")
    return np.repeat(np.array(list(hist), np.int64), list(hist.values()))
