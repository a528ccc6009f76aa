import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean_on_python_and_notebooks(args):
    result = subprocess.run([RUFF, *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
