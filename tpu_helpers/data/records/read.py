"""``read_records``: per-width readers, shuffling, batched parsing and padding, and the
schedule of widths per step, as a ``pipeline.Batches``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tpu_helpers.core.errors import SKIP_DAMAGED_SHARD, InputError
from tpu_helpers.core.messages import say
from tpu_helpers.core.pipeline import STREAMS, Batches, seed_pair, seeded_shuffle
from tpu_helpers.core.validate import check_boundaries, check_positive
from tpu_helpers.data.records.layout import RecordsError
from tpu_helpers.data.records.plan import (
    ReadPlan,
    check_for_reading,
    check_hosts,
    largest_value,
    length_key,
    plan_reads,
)
from tpu_helpers.data.records.source import (
    RecordSource,
    open_records,
    scan_shard,
    spec_to_tf,
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
    record of the batch). Without ``label_column`` the labels are zeros."""
    import tensorflow as tf

    spec = spec_to_tf(source.features)
    variable, key = length_key(source.features)

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
            return out, tf.zeros([rows], tf.int32), weights
        labels = out.pop(label_column)
        return out, labels, weights

    return parse


def _checked_shard(path, expected, compression: str):
    """The ``expected`` records of one shard (its metadata's count), or an error that names
    it: a shard that ends early (a corrupt record, a file cut short or replaced, a read
    cut off) stops the stream with an ``InvalidArgumentError`` naming the shard and the
    fix, in whatever reads it (``fit_resumable``, Keras' own ``fit``, a loop of one's own),
    before any record after the damage; TensorFlow's own ``DataLossError`` names no file.
    No function runs per record: the records are taken up to the count, and only a shard
    that ends first reaches the dataset that fails. A shard holding more records than
    counted gives the counted ones (``open_records`` checks each shard's bytes against
    the metadata's, which a replaced shard fails); a shard gone since is named too."""
    import tensorflow as tf

    def records():
        read = tf.data.TFRecordDataset(path, compression, buffer_size=1 << 18)
        return read.ignore_errors().take(expected)  # a read error ends the shard there

    # A file that is gone cannot be opened, and ignore_errors would retry its open for good
    there = tf.debugging.Assert(
        tf.equal(tf.size(tf.io.matching_files(path)), 1),
        [
            tf.strings.join(
                ["The record file ", path, " is gone (deleted or moved since the records were"]
                + [" opened). Fix: write the split again, or ", SKIP_DAMAGED_SHARD]
            )
        ],
    )

    def fail(_):
        got = records().reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)  # read again
        counts = tf.strings.as_string([got, expected])
        what = tf.where(
            got < expected,
            " records its metadata counts (a corrupt record, or a file cut short or replaced;"
            " records.verify_records names the problem). Fix: copy the shard again (or write"
            " the split again), or ",
            " records its metadata counts, on a second read: the first was cut off (the"
            " storage or the network failed). Fix: run again; if it recurs, copy the shard"
            " again, or ",
        )
        message = tf.strings.join(
            ["The record file ", path, " ends after ", counts[0], " of the ", counts[1]]
            + [what, SKIP_DAMAGED_SHARD]
        )
        tf.debugging.Assert(False, [message])
        return tf.constant("", tf.string)

    short = tf.data.Dataset.from_tensors(0).map(fail)
    with tf.control_dependencies([there]):
        return records().concatenate(short).take(expected)


def checked_records(names, expected, compression: str | None = None, parallel_reads: int = 1):
    """The records of the shards ``names`` (a string tensor), each held to its
    ``expected`` count (``_checked_shard``): one shard after another, or
    ``parallel_reads`` of them interleaved (in a fixed order)."""
    import tensorflow as tf

    files = tf.data.Dataset.from_tensor_slices((names, expected))
    read = lambda path, count: _checked_shard(path, count, compression or "")  # noqa: E731
    if parallel_reads > 1 and int(names.shape[0]) > 1:
        return files.interleave(
            read,
            cycle_length=min(parallel_reads, int(names.shape[0])),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
    return files.flat_map(read)


def _seed(seed: int, epoch, salt: int):
    """The records' stream ``salt`` of ``seed`` in ``epoch`` (``pipeline.seed_pair``)."""
    import tensorflow as tf

    return seed_pair(seed, tf.constant(epoch, tf.int64), 0, STREAMS["records"] + salt)


def read_records(
    source: str | Sequence[str] | RecordSource,
    *,
    global_batch: int,
    label_column: str | None = "label",
    boundaries: Sequence[int] | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    shuffle_buffer: int = 8192,
    parallel_reads: int | None = None,
    spec: Mapping | None = None,
    on_corrupt: str = "raise",
    shared_filesystem: bool = False,
    transform=None,
    num_labels: int | None = None,
    log=say,
) -> Batches:
    """The ``pipeline.Batches`` of TFRecord shards (``open_records`` explains ``source``,
    ``spec``, ``on_corrupt``): ``(features, labels, weights)`` batches of ``global_batch``
    rows (labels of zeros with ``label_column=None``), integers as int32. Every record is
    read once per epoch with weight 1; copies weighted 0 complete a short batch.

    Variable-length features are padded to one of ``boundaries`` per batch (default: the
    longest record), with an ``attention_mask`` when the records have none. Each width
    reads its own shards (``write_records`` groups records by length), so any host makes a
    batch of any width; the widths of the steps follow a schedule of ``(seed, epoch)``
    (``plan_reads``). A batch of serialized records is parsed and padded in one op.

    Shuffled from ``pipeline.seed_pair(seed, epoch, ...)`` alone (a resumed epoch is the
    uninterrupted one's; TensorFlow's global seed plays no part): the file order, the
    records through a buffer of ``shuffle_buffer`` per width, the order of the widths.
    ``seed=None``: a random seed, drawn once for the plan (every epoch and host share it).

    ``parallel_reads``: files read at once (default 8 on ``storage.is_shared`` paths,
    where reads wait on the network; else 1). On a strategy (``batches.distribute``) each
    host reads its own shards and makes one batch per local replica per step, one width
    per step, the same steps on every host (``batches.steps_on``); several hosts need the
    files on a bucket (or ``shared_filesystem=True``). ``transform`` (such as
    ``observe.CompileWatch.watch``) applies to the batches before prefetching;
    ``num_labels`` refuses records whose labels reach it before any step. Files without
    metadata are counted first (one read of every record), and ``log`` says so.
    """
    check_positive(global_batch=global_batch)
    source = _readable(source, spec, on_corrupt, label_column, num_labels, log)
    if boundaries is not None:
        boundaries = check_boundaries(boundaries)
    one_host = plan_reads(source, global_batch, boundaries)
    _say_what_the_plan_costs(one_host, 0, 1, log)
    if one_host.steps_per_epoch == 0:
        raise InputError(f"The records make no batch of {global_batch}. Fix: check the source.")
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**31)
    reading = _Reading(
        source,
        boundaries,
        label_column,
        shuffle,
        seed,
        shuffle_buffer,
        parallel_reads,
        shared_filesystem,
        transform,
        global_batch,
        log,
    )
    return _batches(source, one_host, reading, label_column, global_batch)


def _batches(source: RecordSource, one_host, reading, label_column, global_batch: int) -> Batches:
    """The ``Batches`` of a planned read: its steps and widths (``plan_reads``), and the
    largest class label and token id of the records' metadata, which ``check_model``
    holds against the model before any step."""
    widths = [w for w in one_host.widths if w]
    return Batches(
        reading.build,
        one_host.steps_per_epoch,
        global_batch,
        examples=source.num_records,
        max_width=max(widths) if widths else None,
        widths=tuple(sorted(set(widths))) or None,
        # a sequence of labels per record (a masked LM's) holds no class ids
        max_label=largest_value(source, label_column, scalar=True),
        max_token_id=largest_value(source, "input_ids"),
        name=f"records of {source.shards[0].path.rsplit('/', 1)[0]}",
        reads_per_host=True,
        steps_for=reading.steps_for,
    )


def _readable(source, spec, on_corrupt, label_column, num_labels, log) -> RecordSource:
    """``source`` opened (``open_records``), its records counted, its labels checked."""
    if not isinstance(source, RecordSource):
        source = open_records(source, spec=spec, on_corrupt=on_corrupt)
    source = with_counts(source, log)
    check_for_reading(source, label_column, num_labels)
    return source


def with_counts(source: RecordSource, log=say) -> RecordSource:
    """``source`` with every shard's record count: files without metadata are read once."""
    import dataclasses

    if source.num_records is not None:
        return source
    log(
        f"records: {len(source.shards)} file(s) without metadata: counting their records"
        " (one read of every record; write_records' metadata saves it)."
    )
    shards = []
    for shard in source.shards:
        count, error = scan_shard(shard.path, source.compression)
        if error:
            raise RecordsError(
                f"{shard.path} cannot be read through: {error} (after {count} records). Fix:"
                " copy the file again, or open_records(..., on_corrupt='skip')."
            )
        shards.append(dataclasses.replace(shard, num_records=count))
    return dataclasses.replace(source, shards=shards)


@dataclass(frozen=True)
class _Reading:
    """What ``read_records`` was asked, and the epoch datasets it builds from it."""

    source: RecordSource
    boundaries: tuple | None
    label_column: str | None
    shuffle: bool
    seed: int
    shuffle_buffer: int
    parallel_reads: int | None
    shared_filesystem: bool
    transform: object
    global_batch: int
    log: object

    def steps_for(self, pipelines: int, replicas: int) -> int:
        plan = plan_reads(
            self.source,
            self.global_batch // replicas,
            self.boundaries,
            pipelines,
            max(1, replicas // pipelines),
        )
        return plan.steps_per_epoch

    def build(self, epoch: int, skip_steps: int, input_context):
        import tensorflow as tf

        from tpu_helpers.core.storage import is_shared

        pipelines, pipeline, local = _pipelines(input_context)
        check_hosts(self.source, pipelines, self.shared_filesystem)
        batch = self.global_batch
        if input_context is not None:
            batch = input_context.get_per_replica_batch_size(self.global_batch)
        plan = plan_reads(self.source, batch, self.boundaries, pipelines, local)
        if pipelines > 1:
            _say_what_the_plan_costs(plan, pipeline, pipelines, self.log)
        parallel = self.parallel_reads
        if parallel is None:
            parallel = 8 if is_shared(self.source.shards[0].path) else 1
        reader = _EpochReader(
            self.source,
            plan,
            pipeline,
            local,
            batch,
            self.shuffle,
            self.seed,
            self.shuffle_buffer,
            parallel,
        )
        ds = reader.one_epoch(epoch)
        ds = ds.apply(tf.data.experimental.assert_cardinality(plan.steps_per_epoch * local))
        if skip_steps:
            ds = ds.skip(skip_steps * local)
        # one parallel map parses the raw batches (skipped steps are not parsed)
        parse = _batch_maker(self.source, batch, self.label_column)
        ds = ds.map(lambda r, tag: parse(r, *tag), num_parallel_calls=tf.data.AUTOTUNE)
        if self.transform is not None:
            ds = self.transform(ds)
        return _with_read_options(ds, input_context)


def _pipelines(input_context) -> tuple[int, int, int]:
    """(input pipelines, this one's index, replicas it feeds)."""
    if input_context is None:
        return 1, 0, 1
    pipelines = input_context.num_input_pipelines
    local = max(1, input_context.num_replicas_in_sync // pipelines)
    return pipelines, input_context.input_pipeline_id, local


def _say_what_the_plan_costs(plan: ReadPlan, pipeline: int, pipelines: int, log) -> None:
    """Log (from pipeline 0) what the records' layout costs and how to fix it."""
    if pipeline != 0:
        return
    if plan.mixed:
        log(
            f"records: {len(plan.mixed)} shard(s) hold records of several widths (written"
            " without length groups, or without metadata); their batches are padded to the"
            f" widest of them. Fix: write the records again with write_records (groups by"
            f" length). First: {plan.mixed[0]}"
        )
    if pipelines > 1 and plan.filler_share > 0.25:
        log(
            f"records: {plan.filler_share:.0%} of the rows of an epoch are weight-0 fillers:"
            f" some widths have fewer shards than the {pipelines} hosts, whose steps the"
            " others wait through. Fix: write the records with smaller shards"
            f" (write_records(..., shard_records={plan.shard_records_hint()}))."
        )


@dataclass(frozen=True)
class _EpochReader:
    """The raw batches of one pipeline: per width its shards, shuffled, batched as
    serialized records tagged ``(width, real rows)``; per epoch the widths in the
    schedule's order, the same on every pipeline."""

    source: RecordSource
    plan: ReadPlan
    pipeline: int
    local: int
    batch_size: int
    shuffle: bool
    seed: int
    shuffle_buffer: int
    parallel_reads: int

    @property
    def counts(self) -> dict:
        """Each shard's records, by path (``read_records`` counts files without metadata)."""
        return {shard.path: shard.num_records for shard in self.source.shards}

    def width_batches(self, slot: int, e):
        import tensorflow as tf

        plan, pipeline = self.plan, self.pipeline
        width = tf.constant(plan.widths[slot] or 0, tf.int32)
        paths = plan.files[pipeline][slot]
        wanted = None if plan.steps is None else int(plan.steps[slot]) * self.local
        filler = tf.fill([self.batch_size], _filler_record(self.source.features))
        fillers = tf.data.Dataset.from_tensors((filler, (width, tf.constant(0))))
        if not paths:
            return fillers.repeat(wanted)  # only with several widths
        salt = (pipeline + 1) * 1000 + slot
        names = tf.constant(list(paths))
        counts = self.counts
        expected = tf.constant([counts[path] for path in paths], tf.int64)
        if self.shuffle:
            order = tf.random.experimental.stateless_shuffle(
                tf.range(len(paths)), _seed(self.seed, e, salt)
            )
            names, expected = tf.gather(names, order), tf.gather(expected, order)
        ds = checked_records(names, expected, self.source.compression, self.parallel_reads)
        if self.shuffle:
            ds = seeded_shuffle(ds, self.shuffle_buffer, _seed(self.seed, e, salt + 500))
        ds = ds.batch(self.batch_size)
        # each batch carries its width and real rows (-1: all), by zip: no function
        tag = tf.data.Dataset.from_tensors((width, tf.constant(-1))).repeat()
        ds = tf.data.Dataset.zip((ds, tag))
        if wanted is not None:
            have = -(-int(plan.counts[pipeline, slot]) // self.batch_size)
            if wanted > have:
                ds = ds.concatenate(fillers.repeat(wanted - have))
        return ds

    def one_epoch(self, e):
        import tensorflow as tf

        parts = [self.width_batches(i, e) for i in range(len(self.plan.widths))]
        if len(parts) == 1:
            return parts[0]
        order = tf.constant(self.plan.schedule(), tf.int64)
        if self.shuffle:
            order = tf.random.experimental.stateless_shuffle(order, _seed(self.seed, e, 0))
        choice = tf.data.Dataset.from_tensor_slices(tf.repeat(order, self.local))
        return tf.data.Dataset.choose_from_datasets(parts, choice)


def _with_read_options(ds, input_context):
    """No auto-sharding where each pipeline reads its own shards (by file otherwise), no
    static rewrites (the parse map is parallel and the end prefetched already; running
    tf.data's rewrites costs every new iterator, each epoch of fit, time that grows with
    the graph), then a prefetch."""
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
        if input_context is not None
        else tf.data.experimental.AutoShardPolicy.FILE
    )
    options.experimental_optimization.apply_default_optimizations = False
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)
