import json
import re
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import assert_same_batches, numpy_batches, run_python
from tpu_helpers.data import hub, records
from tpu_helpers.data.records import RecordsError, encode
from tpu_helpers.data.records.layout import metadata_path, split_files


def _proto(row: dict) -> tf.train.Example:
    feature = {}
    for name, value in row.items():
        if isinstance(value, bytes):
            feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        elif np.asarray(value).dtype.kind == "f":
            values = np.asarray(value, np.float32).reshape(-1).tolist()
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
        else:
            values = np.asarray(value, np.int64).reshape(-1).tolist()
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature))


def test_encoded_records_equal_protobuf_serialization():
    rng = np.random.default_rng(0)
    rows = []
    for i in range(400):
        top = [2, 200, 30000, 2**40, 2**62][i % 5]
        ids = rng.integers(0, top, rng.integers(0, 40))
        if i % 9 == 0:
            ids = np.concatenate([ids, [-1, -100, -(2**63)]])  # negatives take ten bytes
        rows.append(
            {
                "ids": ids,
                "score": rng.normal(size=i % 4).astype(np.float32),
                "label": int(rng.integers(0, 3)),
                "text": b"x" * (i % 300),
            }
        )
    columns = {
        name: (lambda c: (c[0], c[2], c[3]))(encode.as_column(name, [r[name] for r in rows]))
        for name in rows[0]
    }
    encoded = encode.encode_examples(columns)
    assert len(encoded) == len(rows)
    for row, data in zip(rows, encoded, strict=True):
        assert tf.train.Example.FromString(data) == _proto(row)


def test_varints_match_the_protobuf_rule():
    values = np.array([0, 1, 127, 128, 300, 16383, 16384, 2**21, 2**35, 2**63 - 1, -1])
    flat, sizes = encode._varint_array(values)
    expected = [encode._varint(int(v) & (2**64 - 1)) for v in values]
    assert sizes.tolist() == [len(e) for e in expected]
    assert flat.tobytes() == b"".join(expected)


def _fixed_dataset(n=300, width=16, seed=0):
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 1000, (n, width))
    return Dataset.from_dict(
        {
            "input_ids": ids,
            "attention_mask": np.ones((n, width), np.int64),
            "label": np.arange(n) % 2,
            "idx": np.arange(n),
        }
    )


def test_fixed_records_round_trip_on_ram_bucket():
    data = _fixed_dataset()
    out = "ram://records-test/fixed"
    meta = records.write_records(data, out, shard_records=70, source={"tokenizer": "t"})
    names = [s["file"] for s in meta["shards"]]
    assert names == [f"train-{i:05d}-of-00005.tfrecord" for i in range(5)]
    assert [s["num_records"] for s in meta["shards"]] == [70, 70, 70, 70, 20]
    ids = data["input_ids"]
    assert meta["features"]["input_ids"] == {
        "dtype": "int64",
        "shape": [16],
        "min": int(np.min(ids)),
        "max": int(np.max(ids)),
    }
    assert meta["features"]["label"] == {"dtype": "int64", "shape": [], "min": 0, "max": 1}
    assert meta["source"] == {"tokenizer": "t"}
    assert tf.io.gfile.exists(f"{out}/train.metadata.json")

    batches = records.read_records(out, global_batch=32, shuffle=False)
    assert (batches.global_batch, batches.examples, batches.padding) == (32, 300, None)
    ds = batches.dataset()
    # every record once: 9 full batches, the 10th has 12 records and 20 weight-0 copies
    assert batches.steps_per_epoch == 10 and int(ds.cardinality()) == batches.steps_per_epoch
    seen = []
    for i, (features, labels, weights) in enumerate(ds):
        assert weights.numpy().tolist() == [1.0] * (32 if i < 9 else 12) + [0.0] * (
            20 if i == 9 else 0
        )
        assert features["input_ids"].shape == (32, 16) and features["input_ids"].dtype == tf.int32
        seen.extend(features["idx"].numpy()[weights.numpy() == 1].tolist())
        np.testing.assert_array_equal(labels.numpy(), features["idx"].numpy() % 2)
        row = features["idx"].numpy()[0]
        np.testing.assert_array_equal(features["input_ids"][0], data[int(row)]["input_ids"])
    assert sorted(seen) == list(range(300))

    shuffled = records.read_records(out, global_batch=32, seed=1).dataset()
    order = [int(x) for f, _, w in shuffled for x in f["idx"].numpy()[w.numpy() == 1]]
    assert sorted(order) != order and sorted(order) == list(range(300))


def test_shuffling_mixes_the_whole_buffer_anew_each_epoch_and_repeats_an_epoch(tmp_path):
    records.write_records(_fixed_dataset(n=320), str(tmp_path), progress=False)  # one shard

    def order(epoch, **kw):
        ds = records.read_records(str(tmp_path), global_batch=32, seed=3, **kw).dataset(epoch)
        return [int(x) for f, _, w in ds for x in f["idx"].numpy()[w.numpy() == 1]]

    first = order(0)
    assert sorted(first) == list(range(320))
    assert order(0) == first  # the same epoch, the same order (resumption relies on it)
    assert order(1) != first
    # one file: only the record shuffle can mix it; the first batch draws from all of it
    assert max(first[:32]) - min(first[:32]) > 200
    assert abs(np.corrcoef(first, np.arange(320))[0, 1]) < 0.3  # order and position unrelated
    # a buffer of 1 record is no shuffle at all
    assert order(0, shuffle_buffer=1) == list(range(320))


def test_shards_rotate_at_the_byte_target():
    data = _fixed_dataset(n=500)
    meta = records.write_records(data, "ram://records-test/bytes", shard_bytes=4000)
    assert len(meta["shards"]) > 3
    assert all(s["bytes"] <= 4000 for s in meta["shards"])
    assert sum(s["num_records"] for s in meta["shards"]) == meta["num_records"] == 500


def test_variable_length_records_are_padded_per_batch(fixtures_dir):
    from datasets import load_dataset

    from tpu_helpers.data import text

    tokenizer = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    split = text.tokenize(load_dataset(str(fixtures_dir / "cola"))["validation"], tokenizer, 128)
    out = "ram://records-test/variable"
    meta = records.write_records(
        split, out, split="validation", columns=["input_ids", "label"], shard_records=300
    )
    assert meta["features"]["input_ids"]["shape"] == [None]
    source = records.open_records(out)
    lengths = records.record_lengths(source)
    assert sorted(lengths.tolist()) == sorted(split["length"])

    widths = text.choose_boundaries(lengths, max_shapes=3)
    plan = records.read_records(source, global_batch=16, boundaries=widths, seed=0)
    assert plan.max_width == widths[-1] and plan.examples == len(lengths)
    batches = list(plan.dataset())
    assert len(batches) == plan.steps_per_epoch
    per_width = {w: 0 for w in widths}
    records_read = 0
    for features, _, weights in batches:
        records_read += int(weights.numpy().sum())
        ids, mask = features["input_ids"].numpy(), features["attention_mask"].numpy()
        assert ids.shape[0] == 16 and ids.shape[1] in widths
        assert (
            ids.shape[1] == widths[0]
            or (mask.sum(1) > widths[widths.index(ids.shape[1]) - 1]).any()
        )
        np.testing.assert_array_equal(mask, ids != 0)
        per_width[ids.shape[1]] += 1
    bucket = np.searchsorted(widths, np.minimum(lengths, widths[-1]))
    # every record is read once: a width's last batch is completed with weight-0 copies
    assert per_width == {w: -(-int((bucket == i).sum()) // 16) for i, w in enumerate(widths)}
    assert records_read == len(lengths)


def test_any_iterable_with_gzip_and_string_features(tmp_path):
    rows = ({"text": f"sentence {i}", "label": i % 3, "score": [0.5 * i]} for i in range(50))
    meta = records.write_records(rows, str(tmp_path), compression="GZIP", shard_records=20)
    assert [s["file"] for s in meta["shards"]][0] == "train-00000-of-00003.tfrecord.gz"
    ds = records.read_records(str(tmp_path), global_batch=10, shuffle=False).dataset()
    features, labels, _ = next(iter(ds))
    assert features["text"].numpy()[3] == b"sentence 3"
    assert features["score"].numpy()[4].tolist() == [2.0]
    assert labels.numpy().tolist() == [i % 3 for i in range(10)]


def test_the_tutorial_file_loads_with_a_hand_written_spec(tmp_path):
    path = str(tmp_path / "dataset.tfrecords")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(40):
            writer.write(
                _proto(
                    {"input_ids": np.full(128, i), "labels": np.array([i % 2])}
                ).SerializeToString()
            )
    spec = {
        "input_ids": tf.io.FixedLenFeature((128,), dtype=tf.int64),
        "labels": tf.io.FixedLenFeature((1,), dtype=tf.int64),
    }
    said = []
    batches = records.read_records(
        path, global_batch=8, spec=spec, label_column="labels", shuffle=False, log=said.append
    )
    # no metadata: the records are counted first (steps were None before)
    assert batches.steps_per_epoch == 5 and batches.examples == 40
    assert any("without metadata: counting their records" in s for s in said), said
    ds = batches.dataset()
    features, labels, _ = next(iter(ds))
    assert features["input_ids"].shape == (8, 128) and labels.shape == (8, 1)
    assert sum(1 for _ in ds) == 5

    with pytest.raises(ValueError, match="no metadata file.*spec="):
        records.read_records(path, global_batch=8)
    bad = dict(spec, input_ids=tf.io.FixedLenFeature((64,), dtype=tf.int64))
    with pytest.raises(RecordsError, match="'input_ids'.*128 values.*\\[64\\]"):
        records.read_records(path, global_batch=8, spec=bad, label_column="labels")


def test_bad_paths_and_specs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="No record files match .*nothing-\\*"):
        records.read_records(str(tmp_path / "nothing-*.tfrecord"), global_batch=8, spec={})
    records.write_records(_fixed_dataset(40), str(tmp_path))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        records.write_records(_fixed_dataset(40), str(tmp_path))
    with pytest.raises(RecordsError, match="no label feature 'labels'.*'label'"):
        records.read_records(str(tmp_path), global_batch=8, label_column="labels")
    with pytest.raises(RecordsError, match="differs from the one the records were written"):
        records.read_records(
            str(tmp_path), global_batch=8, spec={"input_ids": {"dtype": "int64", "shape": [32]}}
        )
    with pytest.raises(ValueError, match="global_batch=0"):
        records.read_records(str(tmp_path), global_batch=0)


def _write_shards(tmp_path, n=200):
    meta = records.write_records(_fixed_dataset(n), str(tmp_path), shard_records=50)
    return [str(tmp_path / s["file"]) for s in meta["shards"]]


def test_truncated_shard_is_caught_before_training(tmp_path):
    shards = _write_shards(tmp_path)
    data = open(shards[2], "rb").read()
    open(shards[2], "wb").write(data[: len(data) // 2])
    with pytest.raises(RecordsError, match="train-00002-of-00004.tfrecord has .* truncated"):
        records.read_records(str(tmp_path), global_batch=10)


def test_corrupt_shard_is_named_and_can_be_skipped(tmp_path, capsys):
    shards = _write_shards(tmp_path)
    data = bytearray(open(shards[1], "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size, broken CRC
    open(shards[1], "wb").write(bytes(data))

    problems = records.verify_records(str(tmp_path))
    assert len(problems) == 1 and "train-00001-of-00004.tfrecord" in problems[0]
    assert "corrupted record at" in problems[0]

    batches = records.read_records(str(tmp_path), global_batch=10, on_corrupt="skip", shuffle=False)
    out = capsys.readouterr().out
    assert "skipped 1 corrupt shard(s), 50 records not read" in out
    assert "train-00001-of-00004" in out
    idx = [int(x) for f, _, _ in batches.dataset() for x in f["idx"]]
    assert (
        batches.steps_per_epoch == 15
        and batches.examples == 150
        and sorted(idx) == [i for i in range(200) if not 50 <= i < 100]
    )
    source = records.open_records(str(tmp_path), on_corrupt="skip")
    assert source.skipped_records == 50 and len(source.skipped) == 1
    assert source.num_records == 150


def test_metadata_that_disagrees_with_the_files(tmp_path):
    shards = _write_shards(tmp_path)
    extra = shards[0].replace("00000-of-00004", "00009-of-00004")
    tf.io.gfile.copy(shards[0], extra)
    with pytest.raises(RecordsError, match="does not list"):
        records.read_records(str(tmp_path), global_batch=10)
    tf.io.gfile.remove(extra)
    tf.io.gfile.remove(shards[3])
    with pytest.raises(RecordsError, match="missing from .*train-00003-of-00004"):
        records.read_records(str(tmp_path), global_batch=10)
    _write_shards(tmp_path / "count")
    meta_file = tmp_path / "count" / "train.metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["num_records"] = 250
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(RecordsError, match="says 250 records but its shards add up to 200"):
        records.read_records(str(tmp_path / "count"), global_batch=10)


def test_too_few_shards_for_the_input_pipelines(tmp_path):
    _write_shards(tmp_path)  # 4 shards
    context = tf.distribute.InputContext(num_input_pipelines=8, input_pipeline_id=0)
    local = records.read_records(str(tmp_path), global_batch=10)
    with pytest.raises(RecordsError, match="is a path on this host, and 8 input pipelines"):
        local.build(0, 0, context)  # what a host of a pod slice calls
    shared = records.read_records(str(tmp_path), global_batch=10, shared_filesystem=True)
    with pytest.raises(RecordsError, match="4 shard\\(s\\) cannot feed 8 input pipelines"):
        shared.build(0, 0, context)
    context = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=2)
    plan = records.read_records(
        str(tmp_path), global_batch=10, shuffle=False, shared_filesystem=True
    )
    # pipeline 0 reads shards 0 and 3, pipeline 2 shard 2 only: it runs as many steps as
    # pipeline 0, the last five of them batches of weight-0 rows
    batches = [(f["idx"].numpy(), w.numpy()) for f, _, w in plan.build(0, 0, context)]
    real = [int(i) for idx, w in batches for i in idx[w == 1]]
    assert plan.steps_per_epoch == 20  # one host reads all 200 records
    assert plan.steps_for(3, 1) == len(batches) == 10 and sorted(real) == list(range(100, 150))
    assert [float(w.sum()) for _, w in batches] == [10.0] * 5 + [0.0] * 5


def test_a_failed_write_leaves_nothing(tmp_path):
    def rows():
        for i in range(5000):
            if i == 4500:
                raise RuntimeError("source broke")
            yield {"input_ids": [i, i + 1], "label": 0}

    with pytest.raises(RuntimeError, match="source broke"):
        records.write_records(rows(), str(tmp_path), shard_records=1000, chunk_size=500)
    assert list(tmp_path.iterdir()) == []


def test_memory_stays_flat_as_the_data_grows(tmp_path):
    def rows(n):
        rng = np.random.default_rng(0)
        for i in range(n):
            yield {"input_ids": rng.integers(0, 30000, 128), "label": i % 2}

    def peak(n, folder):
        tracemalloc.start()
        records.write_records(rows(n), str(folder), chunk_size=1000, progress=False)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(2000, tmp_path / "small"), peak(20000, tmp_path / "large")
    assert large < 1.3 * small, (small, large)


def test_records_distributed_under_two_replicas(tmp_path):
    records.write_records(_fixed_dataset(200), str(tmp_path), shard_records=40)
    result = run_python(
        f"""
        import tpu_helpers
        from tpu_helpers.data import records
        strategy = tpu_helpers.connect(simulated_replicas=2)
        batches = records.read_records({str(tmp_path)!r}, global_batch=16, shuffle=False)
        assert batches.per_replica_batch(strategy.num_replicas_in_sync) == 8
        ds, steps = batches.distribute(strategy), batches.steps_on(strategy)
        n, seen = 0, []
        for features, labels, weights in ds:
            parts = strategy.experimental_local_results(features["input_ids"])
            assert [p.shape.as_list() for p in parts] == [[8, 16], [8, 16]], parts
            for idx, w in zip(
                strategy.experimental_local_results(features["idx"]),
                strategy.experimental_local_results(weights),
            ):
                seen += idx.numpy()[w.numpy() == 1].tolist()
            n += 1
        assert sorted(seen) == list(range(200)), seen
        print("steps", steps, n)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # 25 per-replica batches of 8 for 200 records: 13 steps of 2 replicas
    assert "steps 13 13" in result.stdout


def test_attention_mask_comes_from_lengths_not_token_values(tmp_path):
    # id 0 is a real token for some tokenizers (RoBERTa's <s>): the mask must not hide it;
    # records longer than the widest width (6 and 7 tokens here) are cut to it
    rows = [{"input_ids": [0] * (1 + i % 7), "label": i % 2} for i in range(42)]
    records.write_records(rows, str(tmp_path))
    ds = records.read_records(
        str(tmp_path), global_batch=4, boundaries=[2, 5], shuffle=False
    ).dataset()
    for features, _, _ in ds:
        assert features["input_ids"].shape[1] in (2, 5)
        lengths = features["attention_mask"].numpy().sum(axis=1)
        assert set(lengths) <= {1, 2, 3, 4, 5} and lengths.min() >= 1
    real = sum(float(f["attention_mask"].numpy().sum(axis=1) @ w.numpy()) for f, _, w in ds)
    assert real == sum(min(1 + i % 7, 5) for i in range(42))  # weight-0 copies left out


# --- writes that fail, overlap or die leave the old split whole --------------------------
def _read_all(folder, split="train"):
    source = records.open_records(metadata_path(str(folder), split))
    batches = records.read_records(source, global_batch=10, shuffle=False)
    return sum(int(w.numpy().sum()) for _, _, w in batches.dataset())


def test_a_failed_overwrite_keeps_the_old_split(tmp_path):
    records.write_records(_fixed_dataset(40), str(tmp_path))

    def broken():
        yield {"input_ids": [1] * 16, "attention_mask": [1] * 16, "label": 0}
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        records.write_records(broken(), str(tmp_path), overwrite=True, chunk_size=1)
    with pytest.raises(ValueError, match="no examples.*existing records were kept"):
        records.write_records([], str(tmp_path), overwrite=True)
    assert _read_all(tmp_path) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "train-00000-of-00001.tfrecord",
        "train.metadata.json",
    ]


def test_a_split_name_matches_exactly(tmp_path):
    records.write_records(_fixed_dataset(30), str(tmp_path), split="train-aug")
    records.write_records(_fixed_dataset(40), str(tmp_path), split="train")
    records.write_records(_fixed_dataset(20), str(tmp_path), split="train", overwrite=True)
    assert _read_all(tmp_path, "train-aug") == 30 and _read_all(tmp_path, "train") == 20
    assert split_files(str(tmp_path), "train") == [str(tmp_path / "train-00000-of-00001.tfrecord")]


def test_a_second_writer_that_finishes_first_wins_cleanly(tmp_path):
    folder = str(tmp_path)

    def rows():
        for i in range(50):
            if i == 25:  # another writer replaces the split meanwhile
                records.write_records(_fixed_dataset(30), folder, overwrite=True, progress=False)
            yield {"input_ids": [i] * 16, "attention_mask": [1] * 16, "label": 0}

    records.write_records(_fixed_dataset(40), folder)
    with pytest.raises(FileExistsError, match="Another writer changed split 'train'"):
        records.write_records(rows(), folder, overwrite=True, chunk_size=10, progress=False)
    assert _read_all(tmp_path) == 30  # the other writer's records, whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".writing")]


def test_a_killed_writer_leaves_nothing_a_reader_picks_up(tmp_path):
    result = run_python(
        f"""
        import os
        from tpu_helpers.data import records
        def rows():
            for i in range(100):
                if i == 60:
                    os._exit(9)  # killed mid-write: no cleanup runs
                yield {{"input_ids": [i] * 8, "label": 0}}
        records.write_records(rows(), {str(tmp_path)!r}, shard_records=20, chunk_size=10)
        """
    )
    assert result.returncode == 9, result.stderr
    assert tf.io.gfile.glob(str(tmp_path / "*.tfrecord*")) == []
    assert tf.io.gfile.glob(str(tmp_path / "train*")) == []
    # the leftover is in a hidden folder of the dead writer's; a new write is not disturbed
    records.write_records(_fixed_dataset(40), str(tmp_path))
    assert _read_all(tmp_path) == 40


def test_no_variable_length_record_is_left_out(tmp_path):
    # 7 short and 3 long records, batch 4: whole batches alone would read 4 of the 10
    rows = [{"input_ids": [5] * (2 if i < 7 else 9), "label": i % 2} for i in range(10)]
    records.write_records(rows, str(tmp_path))
    plan = records.read_records(str(tmp_path), global_batch=4, boundaries=[4, 16], shuffle=False)
    batches = list(plan.dataset())
    assert len(batches) == plan.steps_per_epoch == 3  # ceil(7 / 4) + ceil(3 / 4)
    assert sum(float(w.numpy().sum()) for _, _, w in batches) == 10
    assert all(f["input_ids"].shape[0] == 4 for f, _, _ in batches)
    # when no width fills a batch, the records still come out
    few = records.read_records(str(tmp_path), global_batch=16, boundaries=[4, 16], shuffle=False)
    assert sum(float(w.numpy().sum()) for _, _, w in few.dataset()) == 10


def test_values_that_would_read_back_wrong_are_refused(tmp_path):
    rows = [{"input_ids": [1, 2], "label": 0}, {"input_ids": [1, 2], "label": None}]
    with pytest.raises(ValueError, match="'label' has a missing value at row 1"):
        records.write_records(rows, str(tmp_path / "none"))
    assert not list((tmp_path / "none").iterdir())
    records.write_records(rows[:1] * 4, str(tmp_path / "none"))

    from datasets import Dataset

    arrow = Dataset.from_dict({"input_ids": [[1, 2]] * 3, "label": [0, None, 1]})
    with pytest.raises(ValueError, match="'label' has a missing value at row 1"):
        records.write_records(arrow, str(tmp_path / "arrow"))

    big = [{"input_ids": [1, 2**40], "label": 0}] * 4
    records.write_records(big, str(tmp_path / "big"))
    with pytest.raises(RecordsError, match="'input_ids' holds 1099511627776, beyond the int32"):
        records.read_records(str(tmp_path / "big"), global_batch=2)

    unlabelled = [{"input_ids": [1, 2], "label": -1}] * 4
    records.write_records(unlabelled, str(tmp_path / "test-split"))
    with pytest.raises(RecordsError, match="'label' holds label -1.*GLUE test splits"):
        records.read_records(str(tmp_path / "test-split"), global_batch=2)
    three = [{"input_ids": [1, 2], "label": i % 3} for i in range(6)]  # into a 2-label model
    records.write_records(three, str(tmp_path / "three"))
    with pytest.raises(RecordsError, match="holds label 2, and the model has 2 labels.*=3"):
        records.read_records(str(tmp_path / "three"), global_batch=2, num_labels=2)
    three_ok = records.read_records(str(tmp_path / "three"), global_batch=2, num_labels=3)
    assert three_ok.steps_per_epoch == 3
    # without num_labels, the metadata's largest label and token id reach the engines'
    # check of the model (inside a compiled step both are silent)
    plain = records.read_records(str(tmp_path / "three"), global_batch=2)
    assert (plain.max_label, plain.max_token_id) == (2, 2)
    with pytest.raises(ValueError, match="hold class label 2, but the model has 2 outputs"):
        plain.check_model(SimpleNamespace(num_labels=2, vocab_size=30))
    with pytest.raises(ValueError, match="hold token id 2, but the.* model embeds 2 tokens"):
        plain.check_model(SimpleNamespace(num_labels=3, vocab_size=2))
    plain.check_model(SimpleNamespace(num_labels=3, vocab_size=3))
    with pytest.raises(ValueError, match="Fix: boundaries=\\[4, 8\\]"):
        records.read_records(str(tmp_path / "none"), global_batch=2, boundaries=[8, 4])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("features"), "the entry 'features' is missing"),
        (lambda m: m.update(num_records="40"), "the entry 'num_records' is a str, not a int"),
        (lambda m: m["shards"][0].pop("file"), "shards\\[0\\] has no str 'file'"),
        (lambda m: m["features"]["label"].pop("dtype"), "features\\['label'\\] needs a 'dtype'"),
    ],
)
def test_a_hand_edited_metadata_file_is_named_with_its_entry(tmp_path, edit, message):
    records.write_records(_fixed_dataset(40), str(tmp_path))
    path = tmp_path / "train.metadata.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(RecordsError, match=f"train.metadata.json: {message}.*Fix:"):
        records.open_records(str(path))
    path.write_text("{not json")
    with pytest.raises(RecordsError, match="is not valid JSON"):
        records.open_records(str(path))


# --- several hosts: the plan every host derives alike ---------------------------------
def _varied_rows(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"input_ids": [i + 1] + [5] * int(k - 1), "label": i % 2}
        for i, k in enumerate(rng.integers(2, 60, n))
    ]


def test_shards_hold_one_length_group_each_and_the_plan_splits_them_evenly(tmp_path):
    meta = records.write_records(_varied_rows(), str(tmp_path), shard_records=25, progress=False)
    groups = [{-(-int(k) // 8) for k in s["lengths"]["input_ids"]} for s in meta["shards"]]
    assert all(len(g) == 1 for g in groups)
    # listed in length order, so a folder listing shows the groups in order
    assert [min(g) for g in groups] == sorted(min(g) for g in groups)
    source = records.open_records(str(tmp_path))
    widths = [16, 32, 64]
    plan = records.plan_reads(source, 8, widths, pipelines=3, local_replicas=2)
    again = records.plan_reads(records.open_records(str(tmp_path)), 8, widths, 3, 2)
    assert plan.files == again.files and (plan.steps == again.steps).all()
    files = [set(p for paths in host for p in paths) for host in plan.files]
    assert set().union(*files) == {s.path for s in source.shards}
    assert sum(len(f) for f in files) == len(source.shards)  # disjoint
    lengths = records.record_lengths(source)
    per_width = np.bincount(np.searchsorted(widths, np.minimum(lengths, 64)), minlength=3)
    assert (plan.counts.sum(axis=0) == per_width).all()
    # each width's shards are spread as evenly as their sizes allow (at most one shard apart)
    assert (plan.counts.max(axis=0) - plan.counts.min(axis=0) <= 25).all()
    # the steps of a width are enough for the host with the most records of it
    assert (plan.steps == np.ceil(np.ceil(plan.counts / 8) / 2).max(axis=0)).all()
    assert 0 <= plan.filler_share < 0.5 and plan.shard_records_hint() >= 1


def test_shards_that_span_widths_are_read_at_their_widest_and_named(tmp_path, capsys):
    records.write_records(_varied_rows(), str(tmp_path), group_lengths=None, progress=False)
    source = records.open_records(str(tmp_path))
    plan = records.plan_reads(source, 8, [16, 32, 64])
    assert plan.mixed == (source.shards[0].path,) and plan.counts.tolist() == [[0, 0, 400]]
    ds = records.read_records(
        source, global_batch=8, boundaries=[16, 32, 64], shuffle=False
    ).dataset()
    assert "hold records of several widths" in capsys.readouterr().out
    assert {int(f["input_ids"].shape[1]) for f, _, _ in ds} == {64}
    assert sum(float(w.numpy().sum()) for _, _, w in ds) == 400


def test_the_input_pipeline_is_tensorflow_ops_only(tmp_path):
    from tpu_helpers.data import text

    records.write_records(_varied_rows(), str(tmp_path), shard_records=25, progress=False)
    rows = _varied_rows()
    split = {
        "input_ids": [r["input_ids"] for r in rows],
        "length": [len(r["input_ids"]) for r in rows],
        "label": [r["label"] for r in rows],
    }
    import tensorflow as tf

    def python_in(graph):  # a host of a pod slice runs the graph it is sent: no Python in it
        return b"PyFunc" in graph or b"GeneratorDataset" in graph

    generator = tf.data.Dataset.from_generator(lambda: iter([1]), tf.int64)
    assert python_in(generator._as_serialized_graph().numpy())
    from_records = records.read_records(
        str(tmp_path), global_batch=8, boundaries=[16, 64], seed=1, shared_filesystem=True
    )
    from_text = text.text_batches(split, global_batch=8, boundaries=[16, 64])
    # (repeat=True is gone: a run builds each epoch, from any step, and each host its own)
    context = tf.distribute.InputContext(2, 1, num_replicas_in_sync=2)
    for ds in (
        from_records.dataset(0),
        from_records.dataset(1, skip_steps=3),
        from_records.build(1, 2, context),
        from_text.dataset(0),
        from_text.dataset(1, skip_steps=3),
        from_text.build(1, 2, context),
    ):
        graph = ds._as_serialized_graph().numpy()
        assert not python_in(graph)
        assert b"TFRecordDataset" in graph or b"TensorSliceDataset" in graph


def test_a_resumed_epoch_continues_with_the_same_batches(tmp_path):
    records.write_records(_varied_rows(), str(tmp_path), shard_records=25, progress=False)

    def firsts(epoch, skip_steps=0):  # a new plan each time: a new (resumed) process
        plan = records.read_records(str(tmp_path), global_batch=8, boundaries=[16, 32, 64], seed=3)
        ds = plan.dataset(epoch, skip_steps=skip_steps)
        return [f["input_ids"].numpy()[:, 0].tolist() for f, _, _ in ds]

    whole, again = firsts(1), firsts(1)
    assert whole == again and firsts(1, skip_steps=5) == whole[5:]
    assert firsts(2) != whole


@pytest.mark.parametrize("epoch", [0, 2])
@pytest.mark.parametrize("boundaries", [None, [16, 32, 64]], ids=["one-width", "three-widths"])
def test_read_records_keep_the_contract(tmp_path, epoch, boundaries):
    """The contract of a Batches: ``dataset(e, skip_steps=k)`` is exactly the tail of
    ``dataset(e)`` from step k (in a new plan too: a resumed process), an epoch has
    ``steps_per_epoch`` batches, their weights sum to the records, and every element is
    ``(features, labels, weights)``."""
    records.write_records(_varied_rows(), str(tmp_path), shard_records=25, progress=False)

    def plan():
        return records.read_records(
            str(tmp_path), global_batch=16, boundaries=boundaries, seed=5, shuffle_buffer=64
        )

    batches = plan()
    whole = numpy_batches(batches.dataset(epoch))
    assert len(whole) == len(list(batches.dataset(epoch))) == batches.steps_per_epoch
    assert sum(float(w.sum()) for _, _, w in whole) == 400 == batches.examples
    for element in batches.dataset(epoch):
        assert isinstance(element, tuple) and len(element) == 3
        features, labels, weights = element
        assert isinstance(features, dict) and "label" not in features
        assert labels.shape == weights.shape == (16,)
    ids = [int(i) for f, _, w in whole for i in f["input_ids"][:, 0][w == 1]]
    assert sorted(ids) == list(range(1, 401))  # every record once with weight 1
    resumed = plan()
    for skip in range(1, batches.steps_per_epoch):
        assert_same_batches(numpy_batches(resumed.dataset(epoch, skip_steps=skip)), whole[skip:])
    with pytest.raises(ValueError, match="skip_steps="):
        batches.dataset(epoch, skip_steps=batches.steps_per_epoch)


def test_records_without_labels_have_zero_labels_in_three_parts(tmp_path):
    records.write_records(_fixed_dataset(n=50), str(tmp_path), progress=False)
    batches = records.read_records(str(tmp_path), global_batch=16, label_column=None, seed=0)
    elements = list(batches.dataset())
    assert len(elements) == batches.steps_per_epoch == 4
    for element in elements:
        assert len(element) == 3  # (features, weights) before
        features, labels, weights = element
        assert "label" in features  # not a label column: a feature like any other
        assert labels.dtype == tf.int32 and labels.shape == (16,) and not labels.numpy().any()
    assert sum(float(w.numpy().sum()) for _, _, w in elements) == 50


def test_each_step_gives_every_local_replica_a_batch_of_one_width(tmp_path):
    records.write_records(_varied_rows(), str(tmp_path), shard_records=25, progress=False)
    context = tf.distribute.InputContext(1, 0, num_replicas_in_sync=2)
    plan = records.read_records(str(tmp_path), global_batch=16, boundaries=[16, 32, 64], seed=2)
    elements = [
        (int(f["input_ids"].shape[1]), f["input_ids"].numpy()[:, 0], w.numpy())
        for f, _, w in plan.build(0, 0, context)
    ]
    assert all(len(w) == 8 for _, _, w in elements)  # per-replica batches of 16 / 2
    assert len(elements) == 2 * plan.steps_per_epoch
    # elements 2k and 2k+1 go to the two replicas of step k: one width per step
    assert all(elements[k][0] == elements[k + 1][0] for k in range(0, len(elements), 2))
    assert len({w for w, _, _ in elements}) == 3
    used = sorted(int(i) - 1 for _, ids, w in elements for i in ids[w == 1])
    assert used == list(range(400))


def test_files_without_metadata_are_read_whole_at_the_widest_width(tmp_path, capsys):
    records.write_records(_varied_rows(), str(tmp_path), shard_records=100, progress=False)
    (tmp_path / "train.metadata.json").unlink()
    spec = {
        "input_ids": {"dtype": "int64", "shape": [None]},
        "label": {"dtype": "int64", "shape": []},
    }
    plan = records.read_records(
        str(tmp_path / "*.tfrecord"), global_batch=8, boundaries=[16, 64], spec=spec, seed=0
    )
    out = capsys.readouterr().out
    assert "8 file(s) without metadata: counting their records" in out
    batches = [(f["input_ids"].shape[1], w.numpy()) for f, _, w in plan.dataset()]
    # counted first: the steps are known (they were None), 400 records in batches of 8
    assert plan.steps_per_epoch == len(batches) == 50 and plan.examples == 400
    assert {width for width, _ in batches} == {64}
    assert sum(float(w.sum()) for _, w in batches) == 400
    assert "padded to the widest" in out


def _claim_one_more_record(folder, shard: int) -> str:
    """Edit the metadata so that ``shard`` is said to hold one record more than it does (a
    shard replaced by a shorter one, or a count edited by hand); returns the shard's file."""
    path = folder / "train.metadata.json"
    meta = json.loads(path.read_text())
    meta["shards"][shard]["num_records"] += 1
    meta["num_records"] += 1
    for counts in (meta["shards"][shard].get("lengths") or {}).values():
        counts[next(iter(counts))] += 1
    path.write_text(json.dumps(meta))
    return meta["shards"][shard]["file"]


@pytest.mark.parametrize("damage", ["corrupt record", "fewer records than counted"])
def test_a_loop_of_ones_own_over_the_batches_meets_the_shard_named_with_the_fix(tmp_path, damage):
    """Not only fit_resumable: any reader of ``batches.dataset()`` (here a plain loop) is
    stopped at the damaged shard by a message naming it, its counts and the fix, where
    TensorFlow would raise a DataLossError naming no file (or the cardinality's count)."""
    import tensorflow as tf

    shards = _write_shards(tmp_path)
    if damage == "corrupt record":
        data = bytearray(open(shards[1], "rb").read())
        data[len(data) // 2] ^= 0xFF  # same size, broken CRC
        open(shards[1], "wb").write(bytes(data))
        name, counts = "train-00001-of-00004.tfrecord", r"\d+ of the 50"
    else:
        name, counts = _claim_one_more_record(tmp_path, 2), "50 of the 51"
    batches = records.read_records(str(tmp_path), global_batch=10, seed=0)
    rows = 0
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        for _, labels, _ in batches.dataset(0):
            rows += len(labels)
    message = str(caught.value)
    assert re.search(f"{name} ends after {counts} records its metadata counts", message), message
    assert "Fix: copy the shard again" in message and "on_corrupt=skip" in message
    assert rows < 200


def test_sound_shards_pass_the_count_check_whole_read_one_at_a_time_or_in_parallel(tmp_path):
    """The per-shard check lets every record of sound shards through once, and no more,
    whether the shards are read one after the other or interleaved."""
    meta = records.write_records(_fixed_dataset(30), str(tmp_path), shard_records=7)
    assert [s["num_records"] for s in meta["shards"]] == [7, 7, 7, 7, 2]
    for parallel in (1, 3):
        batches = records.read_records(
            str(tmp_path), global_batch=4, seed=0, parallel_reads=parallel
        )
        idx = [
            int(x)
            for f, _, w in batches.dataset(0)
            for x, v in zip(f["idx"], w, strict=True)
            if v > 0
        ]
        assert sorted(idx) == list(range(30)), parallel


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_shard_gone_after_opening_fails_naming_it_and_does_not_hang(tmp_path, parallel):
    """A shard deleted after ``read_records`` opened the set: the read stops with an error
    naming it, rather than retrying the open for good (a fresh interpreter with a timeout,
    so a hang fails the test)."""
    shards = _write_shards(tmp_path)
    result = run_python(
        f"""
        import os
        import tensorflow as tf
        from tpu_helpers.data import records
        batches = records.read_records(
            {str(tmp_path)!r}, global_batch=10, seed=0, parallel_reads={parallel}
        )
        os.remove({shards[2]!r})
        try:
            for _ in batches.dataset(0):
                pass
        except tf.errors.InvalidArgumentError as err:
            print("named:", err.message)
        """,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "train-00002-of-00004.tfrecord is gone" in result.stdout, result.stdout
