"""Bad inputs that used to fail late (or take minutes) stop at once, naming the value,
what is wrong with it and the fix."""

import json
import re
import sys

import numpy as np
import pytest

from tpu_helpers.data import records, text
from tpu_helpers.data.records import RecordsError


# --- text.choose_boundaries: max_shapes ----------------------------------------------
def _python_calls(budget: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the Python function calls it made, stopped with a
    RuntimeError past ``budget``: a bound on the work, not on the time."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1
            if calls > budget:
                raise RuntimeError(f"more than {budget:,} Python calls")

    sys.setprofile(count)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, calls


def test_more_shapes_than_candidate_widths_cost_no_more_work():
    # lengths up to 8192: 1,024 candidate widths. The dynamic program over every
    # max_shapes took about 11 minutes (2,000 x 1,024^2 / 2 steps in Python).
    lengths = np.random.default_rng(0).integers(1, 8193, 20_000)
    chosen, _ = _python_calls(20_000, text.choose_boundaries, lengths, max_shapes=2000)
    # enough shapes for every width some length rounds up to: each is a width, the least
    # padding there is (every example padded to its own multiple of 8)
    rounded = -(-lengths // 8) * 8
    assert chosen == sorted(set(rounded.tolist()))
    assert text.padding_report(lengths, chosen).padded_tokens == rounded.sum()

    few = np.random.default_rng(1).integers(1, 200, 300)  # 25 candidate widths
    assert (
        text.choose_boundaries(few, max_shapes=2000)
        == text.choose_boundaries(few, max_shapes=25)
        == sorted(set((-(-few // 8) * 8).tolist()))
    )
    assert text.choose_boundaries(few, max_shapes=np.int64(3)) == text.choose_boundaries(few, 3)


@pytest.mark.parametrize("bad", [True, 2.5, "4", None])
def test_a_max_shapes_that_is_not_a_whole_number_is_refused(bad):
    expected = rf"max_shapes={re.escape(repr(bad))} is a {type(bad).__name__}, not a whole number"
    with pytest.raises(ValueError, match=expected + r".*Fix: an int such as max_shapes=4"):
        text.choose_boundaries([5, 12, 30], max_shapes=bad)


# --- records: a shard count the file cannot hold ----------------------------------------
def _four_shards(folder, compression=None) -> dict:
    """200 records of 16 ids, 50 a shard (uncompressed: 69 bytes a record)."""
    rows = [{"input_ids": [i % 7 + 1] * 16, "label": i % 2} for i in range(200)]
    return records.write_records(
        rows, str(folder), shard_records=50, compression=compression, progress=False
    )


def _edit_metadata(folder, edit) -> None:
    path = folder / "train.metadata.json"
    meta = json.loads(path.read_text())
    edit(meta)
    meta["num_records"] = sum(s["num_records"] for s in meta["shards"])  # totals agree
    path.write_text(json.dumps(meta))


def test_a_shard_count_its_file_cannot_hold_is_refused_when_opened(tmp_path):
    size = _four_shards(tmp_path)["shards"][1]["bytes"]
    _edit_metadata(tmp_path, lambda m: m["shards"][1].update(num_records=5000))
    expected = (
        f"train-00001-of-00004.tfrecord has {size:,} bytes, too few for the 5,000 records"
        f" train.metadata.json says it holds .* at most {size // 16:,} fit"
    )
    with pytest.raises(RecordsError, match=expected + r".*Fix: records.verify_records\("):
        records.open_records(str(tmp_path))
    # the fix it names still reads the shards through and gives the real count
    problems = records.verify_records(str(tmp_path))
    assert len(problems) == 1 and problems[0].endswith("50 records, the metadata says 5000")


def test_a_shard_said_to_hold_no_records_is_refused_when_opened(tmp_path):
    size = _four_shards(tmp_path)["shards"][2]["bytes"]
    _edit_metadata(tmp_path, lambda m: m["shards"][2].update(num_records=0))
    expected = (
        f"train-00002-of-00004.tfrecord has {size:,} bytes, but train.metadata.json says it"
        " holds 0 records.*Fix: records.verify_records"
    )
    with pytest.raises(RecordsError, match=expected):
        records.open_records(str(tmp_path))


def test_a_shard_cut_short_is_refused_when_the_metadata_has_no_sizes(tmp_path):
    _four_shards(tmp_path)
    _edit_metadata(tmp_path, lambda m: [s.pop("bytes") for s in m["shards"]])
    shard = tmp_path / "train-00003-of-00004.tfrecord"
    shard.write_bytes(shard.read_bytes()[:700])  # copied again partially: 50 need 800
    with pytest.raises(RecordsError, match="00003-of-00004.tfrecord has 700 bytes, too few"):
        records.open_records(str(tmp_path))


def test_gzip_shards_are_not_held_to_the_bound_but_a_count_of_zero_is_refused(tmp_path):
    meta = _four_shards(tmp_path, compression="GZIP")
    # compressed, a shard is smaller than 16 bytes a record: no size bound applies to it
    assert all(s["bytes"] < 16 * s["num_records"] for s in meta["shards"])
    assert records.open_records(str(tmp_path)).num_records == 200
    _edit_metadata(tmp_path, lambda m: m["shards"][0].update(num_records=0))
    with pytest.raises(
        RecordsError,
        match="train-00000-of-00004.tfrecord.gz holds records, but train.metadata.json says 0"
        ".*Fix: records.verify_records",
    ):
        records.open_records(str(tmp_path))


def test_a_negative_shard_count_is_named_with_its_entry(tmp_path):
    _four_shards(tmp_path)
    _edit_metadata(tmp_path, lambda m: m["shards"][1].update(num_records=-50))
    with pytest.raises(
        RecordsError,
        match=r"train.metadata.json: shards\[1\] has num_records -50, not a count.*Fix:",
    ):
        records.open_records(str(tmp_path))
