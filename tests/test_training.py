"""CustomLoop: checkpoints on a bucket-like path, restores refused or fallen back from,
batches of the wrong size, corrupt records. Killed and resumed runs are in
``test_checkpoints`` (the custom-loop kill chain: bit-for-bit weights and learning rates)."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_script  # noqa: E402


def train(capsys, checkpoint_dir, epochs=3, renamed=False):
    """``train_script.main`` in this process (no kill here, so no process of its own);
    returns what it printed."""
    capsys.readouterr()
    train_script.main(str(checkpoint_dir), renamed=renamed, epochs=epochs)
    return capsys.readouterr().out


def final(stdout):
    m = re.search(r"FINAL step=(\d+) steps_per_epoch=(\d+) weights=([\d.]+)", stdout)
    assert m, stdout[-2000:]
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


def test_checkpoints_on_a_bucket_like_filesystem(capsys):
    # ram:// behaves like gs:// for tf.io.gfile: the loop must not touch os paths.
    import tensorflow as tf

    out = train(capsys, "ram://bucket/custom-loop-run", epochs=1)
    step, steps_per_epoch, _ = final(out)
    assert step == steps_per_epoch > 0
    files = sorted(tf.io.gfile.listdir("ram://bucket/custom-loop-run"))
    assert files[0] == "checkpoint" and any(f.endswith(".index") for f in files), files


def test_a_checkpoint_that_does_not_match_the_model_is_refused(tmp_path, capsys):
    from tpu_helpers.checkpoints import CheckpointMismatchError

    train(capsys, tmp_path / "ckpt", epochs=1)
    with pytest.raises(CheckpointMismatchError, match="does not hold every variable.*Fix:"):
        train(capsys, tmp_path / "ckpt", renamed=True)
    assert "FINAL" not in capsys.readouterr().out


def test_a_corrupt_checkpoint_is_named_and_the_one_before_restored(tmp_path, capsys):
    from tpu_helpers.checkpoints import CheckpointMismatchError

    train(capsys, tmp_path / "ckpt", epochs=1)
    indexes = sorted((tmp_path / "ckpt").glob("*.index"), key=lambda p: int(p.stem.split("-")[1]))
    assert len(indexes) >= 2
    indexes[-1].write_bytes(b"not a checkpoint index")
    resumed = train(capsys, tmp_path / "ckpt")
    latest, before = (str(p)[: -len(".index")] for p in indexes[-1:-3:-1])
    assert f"checkpoint {latest} cannot be read; trying the one before it" in resumed
    assert f"restored {before} at step" in resumed
    assert final(resumed)[0] == 3 * final(resumed)[1]  # and the run went on to its end
    for index in (tmp_path / "ckpt").glob("*.index"):  # the resumed run's too
        index.write_bytes(b"not a checkpoint index")
    with pytest.raises(CheckpointMismatchError, match=f"No checkpoint in {tmp_path / 'ckpt'} can"):
        train(capsys, tmp_path / "ckpt")


def test_a_batch_of_the_wrong_size_is_refused():
    import numpy as np
    import tensorflow as tf

    from tpu_helpers.training import CustomLoop

    strategy = tf.distribute.get_strategy()
    model = tf.keras.Sequential([tf.keras.layers.Dense(2)])
    loop = CustomLoop(strategy, model, tf.keras.optimizers.Adam(), global_batch=16)
    per_replica = tf.data.Dataset.from_tensor_slices(
        (np.ones((64, 3), np.float32), np.zeros(64, np.int32), np.ones(64, np.float32))
    ).batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match="batch of 8 rows .*global_batch=16"):
        loop.fit(lambda epoch, skip: per_replica, steps_per_epoch=2, epochs=1, log=lambda m: None)


def test_a_corrupt_record_file_met_in_training_says_how_to_find_it(tmp_path):
    import numpy as np
    import tensorflow as tf

    from tpu_helpers import records
    from tpu_helpers.training import CustomLoop

    rows = [{"x": [float(i)] * 4, "label": i % 2} for i in range(200)]
    meta = records.write_records(rows, str(tmp_path), shard_records=50, progress=False)
    shard = tmp_path / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, broken CRC
    shard.write_bytes(bytes(data))

    inputs = tf.keras.Input((4,), name="x")
    model = tf.keras.Model({"x": inputs}, tf.keras.layers.Dense(2)(inputs))
    loop = CustomLoop(tf.distribute.get_strategy(), model, tf.keras.optimizers.Adam(), 10)
    with pytest.raises(tf.errors.DataLossError, match="verify_records.*on_corrupt='skip'"):
        loop.fit(
            lambda epoch, skip: records.read_records(str(tmp_path), 10, shuffle=False),
            steps_per_epoch=20,
            epochs=1,
            log=lambda m: None,
        )
    assert np.isfinite(model.get_weights()[0]).all()
