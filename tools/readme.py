"""Generate the README's notebook table from the notebooks and the repository URL.

    python tools/readme.py          # rewrite the table in README.md
    python tools/readme.py --check  # exit 1 if README.md is out of date

The URL is configured once, in pyproject.toml ([project.urls] Repository); badges in the
notebooks and the install cells must use the same one (tests/test_notebooks_static.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracks  # noqa: E402

ROOT = tracks.ROOT
START, END = "<!-- notebooks:start -->", "<!-- notebooks:end -->"


def repo_url() -> str:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["urls"]["Repository"].rstrip("/")


def badges(notebook_path: str, url: str | None = None) -> tuple[str, str]:
    """Open-in-Colab and Open-in-Kaggle links for a notebook (its path in the repository)."""
    url = url or repo_url()
    github = url.removeprefix("https://github.com/")
    colab = f"https://colab.research.google.com/github/{github}/blob/main/{notebook_path}"
    kaggle = f"https://kaggle.com/kernels/welcome?src={url}/blob/main/{notebook_path}"
    return colab, kaggle


def notebook_rows(folder: Path) -> list[tuple[str, str, str]]:
    """(path, title, one-line summary) per notebook of a track, from its first markdown cell."""
    rows = []
    for path in tracks.solutions(folder):
        first = json.loads(path.read_text())["cells"][0]
        lines = [line.strip() for line in "".join(first["source"]).splitlines() if line.strip()]
        title = re.sub(r"^#\s*", "", lines[0])
        rows.append((tracks.repo_path(path), title, lines[1]))
    return rows


def table() -> str:
    """The main track's notebooks, then the seeds' track's, one row each: the solution and
    its exercise edition (written by tools/exercises.py). The main track's lessons carry their
    Colab links (every first cell, the exercise editions' too, carries the Colab and Kaggle
    buttons: the README stays a short first page); the seeds' track does not run on Colab's
    or Kaggle's TPUs."""
    out = [
        "**Main track**: Keras 3, KerasHub and JAX, as Colab's and Kaggle's TPU runtimes ship them.",
        "",
        "| notebook | exercise edition |",
        "|---|---|",
    ]
    out += _rows(tracks.MAIN, colab=True)
    out += [
        "",
        "**The seeds' track** (`notebooks/tf/`): the same lessons on the TF engine.",
        "",
        "| notebook | exercise edition |",
        "|---|---|",
    ]
    out += _rows(tracks.SEEDS, colab=False)
    return "\n".join(out)


def _rows(folder: Path, colab: bool) -> list[str]:
    """A track's table rows: each notebook (with its Colab link) and its exercise edition."""
    rows = []
    for path, title, _ in notebook_rows(folder):
        exercises = tracks.repo_path(tracks.exercise_edition(tracks.ROOT / path))
        link = f" ([Colab]({badges(path)[0]}))" if colab else ""
        rows.append(f"| [{title}]({path}){link} | [exercises]({exercises}) |")
    return rows


def render(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    path = ROOT / "README.md"
    current = path.read_text()
    wanted = render(current)
    if "--check" in argv:
        if current != wanted:
            print("README.md's notebook table is out of date: run python tools/readme.py")
            return 1
        return 0
    path.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
