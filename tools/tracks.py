"""Where each notebook, its exercise edition and its CPU parameters live.

Two tracks of the same lessons:

- the main track, ``notebooks/NN_*.ipynb``: Keras 3 and KerasHub on the JAX a TPU runtime
  ships (Colab's, Kaggle's), metadata ``{"tpu_helpers": {"engine": "keras3"}}``;
- the seeds' track, ``notebooks/tf/NN_*.ipynb``: the TF engine (TensorFlow, tf-keras,
  ``TPUStrategy``) of the tutorials the project started from, for a TPU VM with a TensorFlow
  image, a CPU or a GPU.

Each folder has its exercise edition in ``exercises/`` beside it, and its notebooks' CPU
parameters in ``tests/params/`` (main) or ``tests/params/tf/`` (seeds):
``<stem>.yaml`` and one ``<stem>.<variant>.yaml`` per further run.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MAIN = ROOT / "notebooks"
SEEDS = MAIN / "tf"
FOLDERS = (MAIN, SEEDS)
# (tpu_helpers.teaching.offline.PARAMS names the same folders for a notebook opened on a runtime)
PARAMS = {MAIN: ROOT / "tests" / "params", SEEDS: ROOT / "tests" / "params" / "tf"}
PATTERN = "[0-9][0-9]_*.ipynb"


def solutions(folder: Path | None = None) -> list[Path]:
    """The solution notebooks of one track's folder, or of both (the main track first)."""
    folders = FOLDERS if folder is None else (folder,)
    return [path for f in folders for path in sorted(f.glob(PATTERN))]


def track_of(path: Path) -> Path:
    """The track folder of a solution notebook or of its exercise edition."""
    folder = path.resolve().parent
    return folder.parent if folder.name == "exercises" else folder


def exercise_edition(path: Path) -> Path:
    return track_of(path) / "exercises" / path.name


def params_folder(path: Path) -> Path:
    return PARAMS[track_of(path)]


def params_file(path: Path) -> Path:
    """The CPU parameters of a notebook's first run."""
    return params_folder(path) / f"{path.stem}.yaml"


def repo_path(path: Path) -> str:
    """The path from the repository's root, as links and badges name it."""
    return path.resolve().relative_to(ROOT).as_posix()


def executed(out: Path) -> list[Path]:
    """The executed notebooks in a run's output folder: the main track's in ``out``, the
    seeds' in ``out/tf`` (where ``tools/run_notebooks.py`` writes them)."""
    return sorted(out.glob(PATTERN)) + sorted((out / "tf").glob(PATTERN))
