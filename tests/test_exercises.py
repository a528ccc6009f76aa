"""The workshop edition: generated from the solutions, current, and solvable.

The solution notebooks themselves run under nbval (tools/test.sh); here the exercise
edition is checked against them: the generator is idempotent and its output committed, the
solutions injected back give the solution notebooks exactly (so everything before an
exercise's stub is the solution's code, which nbval runs), and every stub fails loudly with
its exercise's id: run unmodified, an exercise notebook stops at its first exercise.
"""

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import exercises  # noqa: E402
import readme  # noqa: E402
import tracks  # noqa: E402

SOLUTIONS = exercises.solution_paths()


def load(path):
    return json.loads(path.read_text())


def text(cell):
    return "".join(cell["source"])


def solution_cells_without_prompts(edition):
    return [
        c for c in edition["cells"] if exercises.PROMPT_TAG not in c["metadata"].get("tags", [])
    ]


def test_every_notebook_has_an_exercise_edition_and_it_is_current():
    editions = [p for f in tracks.FOLDERS for p in (f / "exercises").glob("*.ipynb")]
    assert SOLUTIONS and len(SOLUTIONS) == len(editions)
    assert exercises.main(["--check"]) == 0, "run: python tools/exercises.py"


def test_the_generator_is_idempotent():
    first = exercises.editions()
    assert exercises.editions() == first  # nothing depends on time or order
    for path, edition in first.items():
        # generating again from the edition with its solutions put back changes nothing
        solution = load(tracks.track_of(path) / path.name)
        back = exercises.inject(json.loads(edition), solution, path.name)
        assert exercises.dumps(exercises.generate(back, path.name)) == edition


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_injecting_the_solutions_gives_the_solution_notebook(path):
    solution = load(path)
    edition = load(tracks.exercise_edition(path))
    assert exercises.dumps(exercises.inject(edition, solution, path.name)) == path.read_text()


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_everything_but_the_exercises_is_identical(path):
    solution, edition = load(path), load(tracks.exercise_edition(path))
    kept = solution_cells_without_prompts(edition)
    assert len(kept) == len(solution["cells"])
    marked = 0
    for ours, theirs in zip(kept[1:], solution["cells"][1:], strict=True):
        assert ours["cell_type"] == theirs["cell_type"]
        assert ours["metadata"] == theirs["metadata"]  # the parameters tag included
        if "# BEGIN EXERCISE:" in text(theirs):
            marked += 1
            assert "raise NotImplementedError(" in text(ours)
            continue
        if theirs["cell_type"] == "markdown":  # links out of the folder, and to the seeds'
            relinked = text(theirs).replace("](../", "](../../")
            relinked = relinked.replace("](tf/", "](../tf/exercises/")
            assert text(ours) == relinked.replace("](scripts/", "](../scripts/")
        else:
            assert text(ours) == text(theirs)  # install, parameters and check cells too
    prompts = len(edition["cells"]) - len(kept)
    assert prompts == len(exercises.exercises_of(solution, path.name[:2])) >= marked >= 1


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_two_to_four_exercises_each_with_a_check_that_asserts(path):
    solution = load(path)
    found = exercises.exercises_of(solution, path.name[:2])
    assert 2 <= len(found) <= 4
    cells = solution["cells"]
    for exercise in found:
        assert exercise.task and exercise.hint, exercise.id
        index = next(
            i for i, c in enumerate(cells) if f"BEGIN EXERCISE: {exercise.title}" in text(c)
        )
        check = next(c for c in cells[index + 1 :] if c["cell_type"] == "code")
        body = text(check)
        assert body.startswith(exercises.CHECK)
        assert re.search(r"workshop(_jax)?\.check_", body) or "assert " in body, body


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_tasks_and_hints_render_as_written(path):
    """A sentence starts with a capital; code at the start stays code ("Tf.keras" and
    "Create_optimizer" are names that do not exist)."""
    for exercise in exercises.exercises_of(load(path), path.name[:2]):
        for said in (exercise.task, exercise.hint):
            shown = exercises.sentence(said)
            assert shown[1:] == said[1:] and shown[0].lower() == said[0].lower()
            first = re.match(r"[\w.]+", said).group(0)
            if re.search(r"[._]", first) or said[len(first) : len(first) + 1] in ("(", "["):
                assert shown == said, (exercise.id, shown)
            else:
                assert shown[0].isupper() or not shown[0].isalpha(), (exercise.id, shown)


def stubs_run_when_their_cell_runs(cell_text):
    """Whether every stub of a cell is a statement the cell runs as it runs (at its top level
    or in a ``with`` block), not one a ``def``, a branch or a ``try`` could skip or defer."""
    code = "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in cell_text.splitlines()
    )
    tree, parents = ast.parse(code), {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    raises = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node)
    ]
    for node in raises:
        while node in parents:
            node = parents[node]
            if not isinstance(node, (ast.Module, ast.With)):
                return False
    return bool(raises)


def test_a_stub_a_cell_could_skip_is_seen():
    assert stubs_run_when_their_cell_runs(
        "x = 1\nwith scope():\n    raise NotImplementedError('E')"
    )
    for hidden in (
        "def f():\n    raise NotImplementedError('E')",
        "if x:\n    raise NotImplementedError",
    ):
        assert not stubs_run_when_their_cell_runs(hidden)
    assert not stubs_run_when_their_cell_runs("x = 1")


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_every_stub_fails_loudly_with_its_id(path):
    """A stub raises its exercise's id, and raises it whenever its cell runs: so, run
    unmodified, the edition stops in its first exercise's cell."""
    edition = load(tracks.exercise_edition(path))
    cells = [text(c) for c in edition["cells"] if "raise NotImplementedError(" in text(c)]
    for cell in cells:
        assert stubs_run_when_their_cell_runs(cell), cell
    stubs = [
        line
        for cell in cells
        for line in cell.splitlines()
        if line.strip().startswith("raise NotImplementedError(")
    ]
    found = exercises.exercises_of(load(path), path.name[:2])
    assert len(stubs) == len(found)
    for line, exercise in zip(stubs, found, strict=True):
        with pytest.raises(NotImplementedError, match=re.escape(f"Exercise {exercise.id} (")):
            exec(textwrap.dedent(line), {})  # noqa: S102  (the generated stub line itself)
        for name in exercise.defines:
            assert f"`{name}`" in line


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_exercise_edition_title_badges_and_links(path):
    edition = load(tracks.exercise_edition(path))
    title = text(edition["cells"][0])
    colab, kaggle = readme.badges(tracks.repo_path(tracks.exercise_edition(path)))
    assert f"({colab})" in title and f"({kaggle})" in title
    assert f"](../{path.name})" in title
    for cell in edition["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for target in re.findall(r"\]\(([^)#]+)\)", text(cell)):
            if "://" not in target:
                linked = tracks.exercise_edition(path).parent / target
                assert linked.resolve().exists(), (path.name, target)


def test_readme_links_both_editions():
    current = (ROOT / "README.md").read_text()
    for path in SOLUTIONS:
        assert f"({tracks.repo_path(path)})" in current
        assert f"({tracks.repo_path(tracks.exercise_edition(path))})" in current


@pytest.mark.parametrize("path", SOLUTIONS, ids=tracks.repo_path)
def test_lesson_header_and_key_points(path):
    cells = load(path)["cells"]
    header = text(cells[1])
    for part in ("**Objectives**", "**Prerequisites**", "**Time**"):
        assert part in header, (path.name, part)
    assert re.search(r"\d+ min teaching, \d+ min exercises", header)
    assert tracks.repo_path(tracks.params_file(path)) in header
    # one running time, measured, said once: not in the title cell, no estimate beside it
    running = re.findall(r"Running it: (\d+) s on a 2-core CPU", header)
    assert len(running) == 1 and "estimate" not in header, (path.name, header)
    assert not re.search(r"\d+ (s|min|minutes)\b", text(cells[0])), path.name
    titles = [text(c).splitlines()[0] for c in cells if c["cell_type"] == "markdown"]
    assert titles[-2:] == ["## Key points", "## Next"], titles[-2:]


BROKEN = {
    "no END": "# BEGIN EXERCISE: A\n# Task: t\nx = 1\n",
    "no Task": "# BEGIN EXERCISE: A\n# Hint: h\nx = 1\n# END EXERCISE\n",
    "no code": "# BEGIN EXERCISE: A\n# Task: t\n# END EXERCISE\n",
    "not whole statements": "# BEGIN EXERCISE: A\n# Task: t\nx = (1,\n# END EXERCISE\n",
    "END alone": "x = 1\n# END EXERCISE\n",
}


def notebook_of(*sources):
    return {
        "cells": [
            {
                "cell_type": "code",
                "metadata": {},
                "source": s,
                "outputs": [],
                "execution_count": None,
            }
            for s in sources
        ]
    }


@pytest.mark.parametrize("source", BROKEN.values(), ids=BROKEN.keys())
def test_malformed_markers_are_refused(source):
    with pytest.raises(exercises.ExerciseFormatError):
        exercises.find_exercises(notebook_of(source), "09")


def test_an_exercise_without_its_check_cell_or_out_of_range_count_is_refused():
    block = "# BEGIN EXERCISE: A\n# Task: set x\nx = 1\n# END EXERCISE\n"
    check = "# Check your answer\nassert x == 1\n"
    good = notebook_of(block, check, block.replace(": A", ": B"), check, "print(x)")
    assert [e.defines for e in exercises.exercises_of(good, "09")] == [["x"], ["x"]]
    with pytest.raises(exercises.ExerciseFormatError, match="Check your answer"):
        exercises.exercises_of(notebook_of(block, "print(x)", block, check), "09")
    with pytest.raises(exercises.ExerciseFormatError, match="1 exercise"):
        exercises.exercises_of(notebook_of(block, check), "09")
