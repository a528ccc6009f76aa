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
