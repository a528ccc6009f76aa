"""The workshop's offline runs: each notebook's CPU parameters with the offline fixtures
(``tpu_helpers.teaching.fixtures``) in place of the hub's checkpoints and data sets.

The parameters live in a clone of this repository, ``tests/params/<notebook>.yaml`` (the
seeds' track: ``tests/params/tf/``), with two placeholders: ``${FIXTURES}`` (the folder the
fixtures are built in) and ``${OUTPUTS}`` (where the runs write checkpoints, records and
models). ``tools/run_notebooks.py`` injects them with papermill; ``offline_parameters``
gives the same values to a notebook opened where papermill does not run it, such as a
CPU runtime of Colab or Kaggle (docs/teaching.md, *The room has no TPU*)::

    from tpu_helpers.teaching.offline import offline_parameters
    globals().update(offline_parameters("01", "/content/tpu-workshop"))
"""

from __future__ import annotations

import os
from pathlib import Path

from tpu_helpers.core.errors import InputError, MissingFileError
from tpu_helpers.core.messages import say

__all__ = ["PARAMS", "parameters_file", "fill_in", "offline_parameters"]

#: Where a track's CPU parameters live in the repository.
PARAMS = {"main": Path("tests/params"), "seeds": Path("tests/params/tf")}


def parameters_file(notebook: str, repo: str | os.PathLike = ".", track: str = "main") -> Path:
    """The parameter file of ``notebook``: its number (``"01"``), its stem
    (``"01_text_classification_fit"``) or a variant's (``"01_text_classification_fit.pairs"``)."""
    if track not in PARAMS:
        raise InputError(f"track={track!r} is not a track. Fix: one of {sorted(PARAMS)}.")
    folder = Path(repo) / PARAMS[track]
    if not folder.is_dir():
        raise MissingFileError(
            f"{folder} does not exist: {repo} is not a clone of tpu-transformers-notebooks."
            " Fix: git clone the repository (docs/teaching.md, *The room has no TPU*) and"
            " pass the clone's folder."
        )
    files = sorted(folder.glob("*.yaml"))
    exact = [f for f in files if f.stem == notebook]
    numbered = [f for f in files if f.stem.startswith(f"{notebook}_") and "." not in f.stem]
    found = exact or numbered
    if len(found) != 1:
        names = ", ".join(repr(f.stem) for f in files)
        raise InputError(
            f"notebook={notebook!r} names {len(found)} of the {track} track's parameter files"
            f" in {folder}. Fix: one of {names}, or a number such as '01'."
        )
    return found[0]


def fill_in(text: str, fixtures: str | os.PathLike, outputs: str | os.PathLike) -> dict:
    """A parameter file's ``text`` read as YAML, with the placeholders in its string values
    filled in (after parsing: a folder's name cannot change how the file reads)."""
    import yaml

    def filled(value):
        if not isinstance(value, str):
            return value
        return value.replace("${FIXTURES}", str(fixtures)).replace("${OUTPUTS}", str(outputs))

    return {name: filled(value) for name, value in (yaml.safe_load(text) or {}).items()}


def offline_parameters(
    notebook: str,
    repo: str | os.PathLike = ".",
    *,
    track: str = "main",
    build: str | os.PathLike | None = None,
    verbose: bool = True,
) -> dict:
    """``notebook``'s workshop parameters from the clone ``repo``, with the offline fixtures
    built (once) into ``build/fixtures`` (default ``repo/build``; no TensorFlow needed) and
    the runs' outputs in ``build/outputs``. Prints each value it returns."""
    from tpu_helpers.teaching.fixtures import build_fixtures

    path = parameters_file(notebook, repo, track)
    build = (Path(build) if build is not None else Path(repo) / "build").resolve()
    build_fixtures(build / "fixtures", verbose=verbose, references=False)
    values = fill_in(path.read_text(), build / "fixtures", build / "outputs")
    if verbose:
        say(f"offline parameters of {path.name}:")
        for name, value in values.items():
            say(f"  {name} = {value!r}")
    return values
