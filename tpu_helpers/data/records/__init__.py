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

from tpu_helpers.data.records.layout import (
    SHARED_SCHEMES,
    RecordsError,
)
from tpu_helpers.data.records.plan import plan_reads
from tpu_helpers.data.records.read import read_records
from tpu_helpers.data.records.source import (
    open_records,
    record_lengths,
    verify_records,
)
from tpu_helpers.data.records.write import write_records

__all__ = [
    "RecordsError",
    "SHARED_SCHEMES",
    "write_records",
    "verify_records",
    "open_records",
    "record_lengths",
    "plan_reads",
    "read_records",
]
