import subprocess
import sys

from tpu_helpers.runtime.doctor import CHECKS


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tpu_helpers", *args], capture_output=True, text=True, timeout=300
    )


def test_doctor_passes_on_the_pinned_stack():
    result = cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS  tf-keras" in result.stdout and "FAIL" not in result.stdout
    assert result.stdout.rstrip().endswith(f"doctor: {len(CHECKS) + 1} checks, 0 failing")


def test_doctor_exits_non_zero_when_a_check_fails():
    # Keras 3 as tf.keras: the flag is off before TensorFlow loads.
    code = (
        "import os, sys; os.environ['TF_USE_LEGACY_KERAS'] = '0'; import tpu_helpers.__main__ as m; "
        "sys.exit(m.main(['doctor']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert "FAIL  legacy keras: TF_USE_LEGACY_KERAS='0'" in result.stdout
    assert "fix: import tpu_helpers" in result.stdout


def test_plan_is_empty_on_a_plain_machine():
    result = cli("plan")
    assert result.returncode == 0 and result.stdout == ""


def test_install_on_a_plain_machine_changes_nothing():
    result = cli("install")
    assert result.returncode == 0, result.stderr
    assert "nothing to install" in result.stdout


def test_help_does_not_import_tensorflow():
    code = "import sys, tpu_helpers.__main__ as m\ntry:\n    m.main(['--help'])\nexcept SystemExit:\n    pass\nprint('TF' if 'tensorflow' in sys.modules else 'NO TF')"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip().endswith("NO TF")
