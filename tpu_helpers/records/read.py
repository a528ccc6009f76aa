"""``read_records``: per-width readers, shuffling, batched parsing and padding, and the
schedule of widths per step; ``distribute_records`` for a strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import tpu_helpers._env  # noqa: F401
from tpu_helpers.records.plan import (
    ReadPlan,
    check_for_reading,
    check_hosts,
    length_key,
    plan_reads,
)
from tpu_helpers.records.source import RecordSource, open_records, spec_to_tf
from tpu_helpers.validate import check_boundaries, check_positive


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
    check_for_reading(source, label_column, num_labels)
    if boundaries is not None:
        boundaries = check_boundaries(boundaries)
    pipelines, pipeline, local = _pipelines(input_context)
    check_hosts(source, pipelines, shared_filesystem)
    plan = plan_reads(source, batch_size, boundaries, pipelines, local)
    _say_what_the_plan_costs(plan, pipeline, pipelines)
    if plan.steps_per_epoch == 0:
        raise ValueError(f"The records make no batch of {batch_size}. Fix: check the source.")
    if seed is None:
        seed = 0 if pipelines > 1 else int(np.random.SeedSequence().entropy % 2**31)
    if parallel_reads is None:
        parallel_reads = 8 if is_remote(source.shards[0].path) else 1
    reader = _EpochReader(
        source, plan, pipeline, local, batch_size, shuffle, seed, shuffle_buffer, parallel_reads
    )
    ds = reader.epochs(epoch, repeat)
    if skip_steps:
        ds = ds.skip(skip_steps * local)
    # one parallel map parses the raw batches (once per iterator, not per epoch; skipped
    # steps are not parsed)
    parse = _batch_maker(source, batch_size, label_column)
    ds = ds.map(lambda r, tag: parse(r, *tag), num_parallel_calls=tf.data.AUTOTUNE)
    if transform is not None:
        ds = transform(ds)
    ds = _with_read_options(ds, input_context)
    ds.steps = plan.steps_per_epoch
    ds.plan = plan
    return ds


def _pipelines(input_context) -> tuple[int, int, int]:
    """(input pipelines, this one's index, replicas it feeds)."""
    if input_context is None:
        return 1, 0, 1
    pipelines = input_context.num_input_pipelines
    local = max(1, input_context.num_replicas_in_sync // pipelines)
    return pipelines, input_context.input_pipeline_id, local


def _say_what_the_plan_costs(plan: ReadPlan, pipeline: int, pipelines: int) -> None:
    """Print (once, from pipeline 0) what the records' layout costs and how to fix it."""
    if pipeline != 0:
        return
    if plan.mixed:
        print(
            f"records: {len(plan.mixed)} shard(s) hold records of several widths (written"
            " without length groups, or without metadata); their batches are padded to the"
            f" widest of them. Fix: write the records again with write_records (groups by"
            f" length). First: {plan.mixed[0]}"
        )
    if pipelines > 1 and plan.filler_share > 0.25:
        print(
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

    def _files(self, names):
        import tensorflow as tf

        compression = self.source.compression or ""
        if self.parallel_reads > 1 and int(names.shape[0]) > 1:
            return tf.data.Dataset.from_tensor_slices(names).interleave(
                lambda f: tf.data.TFRecordDataset(f, compression_type=compression),
                cycle_length=min(self.parallel_reads, int(names.shape[0])),
                num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True,
            )
        return _file_reader(names, compression)

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
        if self.shuffle:
            names = tf.random.experimental.stateless_shuffle(names, _epoch_seed(self.seed, salt, e))
        ds = self._files(names)
        if self.shuffle:
            ds = _shuffled(ds, self.shuffle_buffer, _epoch_seed(self.seed, salt + 500, e))
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
            order = tf.random.experimental.stateless_shuffle(order, _epoch_seed(self.seed, 0, e))
        choice = tf.data.Dataset.from_tensor_slices(tf.repeat(order, self.local))
        return tf.data.Dataset.choose_from_datasets(parts, choice)

    def epochs(self, epoch: int, repeat: bool):
        """Epoch ``epoch`` (its length asserted when the counts are known), or with
        ``repeat`` every epoch from it on."""
        import tensorflow as tf

        if repeat:
            return tf.data.Dataset.range(epoch, 2**62).flat_map(self.one_epoch)
        ds = self.one_epoch(tf.constant(epoch, tf.int64))
        steps = self.plan.steps_per_epoch
        if steps is not None:
            ds = ds.apply(tf.data.experimental.assert_cardinality(steps * self.local))
        return ds


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
