import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "train_script.py"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def run(ckpt, *extra):
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(ckpt), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )


def final(stdout):
    m = re.search(r"FINAL step=(\d+) steps_per_epoch=(\d+) weights=([\d.]+)", stdout)
    assert m, stdout[-2000:]
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


def checkpoints(stdout):
    return [int(s) for s in re.findall(r"checkpoint step (\d+):", stdout)]


def test_killed_run_resumes_without_losing_or_repeating_steps(tmp_path):
    reference = run(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    ref_step, steps_per_epoch, ref_weights = final(reference.stdout)
    assert ref_step == 3 * steps_per_epoch

    # Start a slow run, kill it hard after its second checkpoint.
    ckpt = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), "--slow"],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    seen = []
    for line in proc.stdout:
        if line.startswith("checkpoint step"):
            seen.append(line)
            if len(seen) == 2:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = checkpoints("".join(seen))[-1]
    assert 0 < killed_at < ref_step

    resumed = run(ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {killed_at}" in resumed.stdout  # the optimizer step continues
    after = checkpoints(resumed.stdout)
    assert after[0] > killed_at  # nothing is saved twice, so no step ran twice
    step, _, weights = final(resumed.stdout)
    assert step == ref_step  # no step lost
    assert weights == pytest.approx(ref_weights, rel=1e-5)


def test_checkpoints_on_a_bucket_like_filesystem():
    # ram:// behaves like gs:// for tf.io.gfile: the loop must not touch os paths.
    code = f"""
import runpy, sys
sys.argv = ["x", "ram://bucket/run1"]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
import tensorflow as tf
print("FILES", sorted(tf.io.gfile.listdir("ram://bucket/run1"))[:3])
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FILES ['checkpoint'," in result.stdout
    assert final(result.stdout)[0] > 0


def test_a_checkpoint_that_does_not_match_the_model_is_refused(tmp_path):
    first = run(tmp_path / "ckpt", "--epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    renamed = run(tmp_path / "ckpt", "--renamed")
    assert renamed.returncode != 0
    assert "CheckpointMismatchError" in renamed.stderr
    assert "does not hold every variable" in renamed.stderr and "Fix:" in renamed.stderr
    assert "FINAL" not in renamed.stdout


def test_a_corrupt_checkpoint_is_named_and_the_one_before_restored(tmp_path):
    first = run(tmp_path / "ckpt", "--epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    indexes = sorted((tmp_path / "ckpt").glob("*.index"), key=lambda p: int(p.stem.split("-")[1]))
    assert len(indexes) >= 2
    indexes[-1].write_bytes(b"not a checkpoint index")
    resumed = run(tmp_path / "ckpt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    latest, before = (str(p)[: -len(".index")] for p in indexes[-1:-3:-1])
    assert f"checkpoint {latest} cannot be read; trying the one before it" in resumed.stdout
    assert f"restored {before} at step" in resumed.stdout
    for index in (tmp_path / "ckpt").glob("*.index"):  # the resumed run's too
        index.write_bytes(b"not a checkpoint index")
    broken = run(tmp_path / "ckpt")
    assert broken.returncode != 0
    assert f"No checkpoint in {tmp_path / 'ckpt'} can be read: " in broken.stderr


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
