"""Which shards each input pipeline reads for each width, and how many steps of each
width every pipeline runs: from the metadata alone, so the hosts of a pod slice agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.validate import check_boundaries, check_int32
from tpu_helpers.data.records.layout import SHARED_SCHEMES, RecordsError
from tpu_helpers.data.records.source import RecordSource, Shard, length_histogram


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


def length_key(features: Mapping) -> tuple[list[str], str | None]:
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
    key = length_key(source.features)[1]
    if key is None:
        widths: tuple = (None,)
    else:
        if boundaries is None:
            hist = length_histogram(source, key)
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


def check_for_reading(
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
    largest = largest_value(source, label_column)
    if largest is not None and num_labels is not None and largest >= num_labels:
        raise RecordsError(
            f"Feature {label_column!r} holds label {largest}, and the model has"
            f" {num_labels} labels (0 to {num_labels - 1}). Fix: num_labels={largest + 1}"
            " for the model (and its id2label), or check the records' label column."
        )


def largest_value(source: RecordSource, name: str | None, scalar: bool = False) -> int | None:
    """The largest value of integer feature ``name`` from the records' metadata; ``None``
    without it (or, with ``scalar``, for a feature of several values per record)."""
    feature = source.features.get(name) if name else None
    if not feature or feature.get("dtype") != "int64" or "max" not in feature:
        return None
    if scalar and feature.get("shape") != []:
        return None
    return int(feature["max"])


def check_hosts(source: RecordSource, pipelines: int, shared_filesystem: bool) -> None:
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
