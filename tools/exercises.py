"""Generate the exercise edition of every notebook from the solutions of both tracks.

    python tools/exercises.py           # write notebooks/exercises/, notebooks/tf/exercises/
    python tools/exercises.py --check   # exit 1 if an exercise notebook is out of date

It also writes the list of exercises into docs/teaching.md (between its markers).

The notebooks in ``notebooks/`` and ``notebooks/tf/`` (``tracks.py``) are the complete
solutions; each track's exercise edition is its folder's ``exercises/``. Inside their code cells, an
exercise is a block of lines between two comments (ordinary comments, so papermill,
nbval, nbstripout and Colab leave them alone):

    # BEGIN EXERCISE: Choose the padding widths
    # Task: what to write, on as many comment lines as it takes.
    # Hint: where to look.
    boundaries = text.padding_boundaries(lengths, padding, max_length)
    # END EXERCISE

The next code cell after it must be a "check your answer" cell (first line
``# Check your answer``) that asserts the property the exercise is about; it is the same
in both editions. The exercise edition keeps the Task comments (the Hint goes, folded, into a
markdown cell before the stub, so that it is read only when wanted), replaces the code
by a prompt and a ``raise NotImplementedError`` stub naming what to define, and puts a
markdown cell with the task before the cell. Every other cell is copied unchanged, apart
from the title cell (its badges open the exercise edition) and links that leave the
folder. ``inject`` puts the solutions back into an exercise edition; the tests check that
this gives the solution notebook again.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracks  # noqa: E402

ROOT = tracks.ROOT
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN EXERCISE: (?P<title>.+?)\s*$")
END = re.compile(r"^\s*# END EXERCISE\s*$")
STUB_HEAD = re.compile(r"^(?P<indent>\s*)# EXERCISE (?P<id>\d\d\.\d+) · ")
STUB_RAISE = re.compile(r'^\s*raise NotImplementedError\("Exercise (?P<id>\d\d\.\d+) ')
CHECK = "# Check your answer"
TEACHING = ROOT / "docs" / "teaching.md"
TABLE_START, TABLE_END = "<!-- exercises:start -->", "<!-- exercises:end -->"
PROMPT_TAG = "exercise-prompt"
MIN_EXERCISES, MAX_EXERCISES = 2, 4


class ExerciseFormatError(ValueError):
    """A solution notebook's exercise markers are malformed."""


@dataclass
class Exercise:
    id: str  # "01.2": notebook number, then the exercise's number in it
    title: str
    indent: str
    prompt: list[str]  # the comment lines after BEGIN (Task:, Hint:, ...), as written
    code: list[str]  # the solution lines between the prompt and END
    defines: list[str]  # names the solution assigns at its own level and later cells use

    @property
    def task(self) -> str:
        return _prompt_part(self.prompt, "Task")

    @property
    def hint(self) -> str:
        return _prompt_part(self.prompt, "Hint")

    def task_lines(self) -> list[str]:
        """The prompt's comment lines without the hint (the stub shows the task; the hint
        waits, folded, in the cell before it)."""
        lines, in_hint = [], False
        for line in self.prompt:
            label = re.match(r"\s*#\s*(\w+):", line)
            if label:
                in_hint = label[1] == "Hint"
            if not in_hint:
                lines.append(line)
        return lines

    def solution_lines(self) -> list[str]:
        return [
            f"{self.indent}# BEGIN EXERCISE: {self.title}\n",
            *self.prompt,
            *self.code,
            f"{self.indent}# END EXERCISE\n",
        ]

    def stub_lines(self) -> list[str]:
        names = ", ".join(f"`{n}`" for n in self.defines)
        if names:
            todo = f"Your code here: it must define {names}. Then delete the next line."
            message = f"write the code that defines {names} in place of this line"
        else:
            todo = "Your code here. Then delete the next line."
            message = "write your code in place of this line"
        message = (
            f"Exercise {self.id} ({self.title}) is not done yet: {message}"
            " (the task is in the comments above; a hint is in the cell before, if you"
            " want one)."
        )
        return [
            f"{self.indent}# EXERCISE {self.id} · {self.title}\n",
            *self.task_lines(),
            f"{self.indent}# {todo}\n",
            f"{self.indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})\n",
        ]


def _prompt_part(prompt: list[str], label: str) -> str:
    """The text of ``# Label: ...`` and its continuation lines (``#   ...``)."""
    out, taking = [], False
    for line in prompt:
        text = line.strip().removeprefix("#").strip()
        if text.startswith(f"{label}:"):
            taking = True
            out.append(text[len(label) + 1 :].strip())
        elif taking and line.strip().startswith("#   "):
            out.append(text)
        else:
            taking = False
    return " ".join(out)


def lines_of(cell: dict) -> list[str]:
    source = cell["source"]
    text = "".join(source) if isinstance(source, list) else source
    return text.splitlines(keepends=True)


def as_source(lines: list[str]) -> list[str]:
    """Notebook JSON stores a cell's lines, the last one without its newline."""
    text = "".join(lines).removesuffix("\n")
    return text.splitlines(keepends=True) if text else []


def _defined_names(code: list[str]) -> list[str]:
    tree = ast.parse(textwrap.dedent("".join(code)))
    names: list[str] = []

    def add(target):
        if isinstance(target, ast.Name) and target.id not in names:
            names.append(target.id)
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                add(element)

    def walk(statements):
        for node in statements:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    add(target)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                add(node.target)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                add(ast.Name(node.name))
            elif isinstance(node, ast.With | ast.If | ast.For):
                walk(node.body)

    walk(tree.body)
    return names


def find_exercises(notebook: dict, number: str) -> list[tuple[int, Exercise, int, int]]:
    """``(cell index, exercise, first line, line after END)`` for each marked block, in
    order; malformed markers raise ``ExerciseFormatError`` naming the cell."""
    found = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        lines = lines_of(cell)
        i = 0
        while i < len(lines):
            begin = BEGIN.match(lines[i])
            if not begin:
                if END.match(lines[i]):
                    raise ExerciseFormatError(f"cell {index}: END EXERCISE without BEGIN")
                i += 1
                continue
            start, indent, j = i, begin["indent"], i + 1
            prompt = []
            while j < len(lines) and lines[j].strip().startswith("#") and not END.match(lines[j]):
                prompt.append(lines[j])
                j += 1
            code = []
            while j < len(lines) and not END.match(lines[j]):
                if BEGIN.match(lines[j]):
                    raise ExerciseFormatError(f"cell {index}: BEGIN EXERCISE inside another")
                code.append(lines[j])
                j += 1
            if j == len(lines):
                raise ExerciseFormatError(f"cell {index}: BEGIN EXERCISE without END EXERCISE")
            title = begin["title"]
            exercise_id = f"{number}.{len(found) + 1}"
            if not _prompt_part(prompt, "Task"):
                raise ExerciseFormatError(f"exercise {exercise_id} ({title}): no '# Task:' line")
            if not "".join(code).strip():
                raise ExerciseFormatError(f"exercise {exercise_id} ({title}): no solution code")
            try:
                defines = _defined_names(code)
            except SyntaxError as err:
                raise ExerciseFormatError(
                    f"exercise {exercise_id} ({title}): the solution is not whole statements"
                    f" ({err.msg}, line {err.lineno})"
                ) from err
            later = "".join(lines[j + 1 :]) + "".join(
                "".join(lines_of(c))
                for c in notebook["cells"][index + 1 :]
                if c["cell_type"] == "code"
            )
            # the names the rest of the notebook uses; helpers inside the block are free
            defines = [n for n in defines if re.search(rf"\b{re.escape(n)}\b", later)]
            exercise = Exercise(exercise_id, title, indent, prompt, code, defines)
            found.append((index, exercise, start, j + 1))
            i = j + 1
    return found


def _check_cell_follows(notebook: dict, index: int, exercise: Exercise) -> None:
    for cell in notebook["cells"][index + 1 :]:
        if cell["cell_type"] == "code":
            if lines_of(cell)[:1] and lines_of(cell)[0].startswith(CHECK):
                return
            break
    raise ExerciseFormatError(
        f"exercise {exercise.id} ({exercise.title}): the next code cell must start with"
        f" '{CHECK}' and assert what the exercise is about"
    )


def checked_exercises(notebook: dict, number: str) -> list[tuple[int, Exercise, int, int]]:
    """``find_exercises``, checked: 2 to 4 exercises, each followed by a check cell."""
    found = find_exercises(notebook, number)
    if not MIN_EXERCISES <= len(found) <= MAX_EXERCISES:
        raise ExerciseFormatError(
            f"notebook {number} has {len(found)} exercise(s); mark {MIN_EXERCISES} to"
            f" {MAX_EXERCISES}: the decisions that teach the point"
        )
    for index, exercise, _, _ in found:
        _check_cell_follows(notebook, index, exercise)
    return found


def exercises_of(notebook: dict, number: str) -> list[Exercise]:
    """The notebook's exercises, checked as ``checked_exercises`` does."""
    return [exercise for _, exercise, _, _ in checked_exercises(notebook, number)]


def sentence(text: str) -> str:
    """``text`` with its first letter upper-cased when it starts with a plain word; code
    (``tf.keras...``, ``create_optimizer(...)``, ``np.percentile``) stays as written.

    >>> sentence("look at the quantiles"), sentence("tf.keras.optimizers.Adam(...)")
    ('Look at the quantiles', 'tf.keras.optimizers.Adam(...)')
    """
    if re.match(r"[a-z]+(?![\w.(\[=`])", text):
        return text[:1].upper() + text[1:]
    return text


def _prompt_cell(exercise: Exercise) -> dict:
    text = [
        f"### ✏️ Exercise {exercise.id} · {exercise.title}\n",
        "\n",
        f"{sentence(exercise.task)}\n",
    ]
    if exercise.hint:
        hint = sentence(exercise.hint)
        text += ["\n", f"<details><summary>Hint</summary>\n\n{hint}\n</details>\n"]
    text += [
        "\n",
        "Write your code in the cell below, in place of its `raise` line. The cell after it"
        " checks your answer.",
    ]
    return {"cell_type": "markdown", "metadata": {"tags": [PROMPT_TAG]}, "source": text}


def _title_cell(cell: dict, name: str, count: int) -> dict:
    lines = _relink(lines_of(cell), True)  # before the note, whose link is the solution's
    lines[0] = lines[0].rstrip("\n") + ": exercises\n"
    note = (
        f"**Exercise edition**: {count} exercises, each followed by a cell that checks your"
        f" answer. The complete notebook: [{name}](../{name}).\n"
    )
    badge_at = next((i for i, line in enumerate(lines) if "colab-badge.svg" in line), len(lines))
    lines[badge_at:badge_at] = [note, "\n"]
    text = re.sub(r"(/blob/main/[\w/]*?)(\d\d_[\w.]+\.ipynb)", r"\1exercises/\2", "".join(lines))
    return {**cell, "source": as_source(text.splitlines(keepends=True))}


def _relink(lines: list[str], out_of_folder: bool) -> list[str]:
    """Links that leave the track's folder go one level further up from the exercises; a
    main-track notebook's link to the seeds' track (``tf/NN_x.ipynb``) goes to that track's
    exercise edition, and one to a script beside it (``scripts/``) to the same script."""
    pairs = [
        ("](../", "](../../"),
        ("](tf/", "](../tf/exercises/"),
        ("](scripts/", "](../scripts/"),
    ]
    for old, new in pairs:
        if not out_of_folder:
            old, new = new, old
        lines = [line.replace(old, new) for line in lines]
    return lines


def generate(notebook: dict, name: str) -> dict:
    """The exercise edition of solution notebook ``notebook`` (file name ``name``)."""
    found = checked_exercises(notebook, name[:2])
    by_cell: dict[int, list[tuple[Exercise, int, int]]] = {}
    for index, exercise, start, stop in found:
        by_cell.setdefault(index, []).append((exercise, start, stop))
    cells = []
    for index, cell in enumerate(notebook["cells"]):
        if index == 0:
            cells.append(_title_cell(cell, name, len(found)))
            continue
        if cell["cell_type"] == "markdown":
            cells.append({**cell, "source": as_source(_relink(lines_of(cell), True))})
            continue
        if index not in by_cell:
            cells.append(cell)
            continue
        lines = lines_of(cell)
        for exercise, start, stop in reversed(by_cell[index]):
            lines[start:stop] = exercise.stub_lines()
        cells.extend(_prompt_cell(exercise) for exercise, _, _ in by_cell[index])
        cells.append({**cell, "source": as_source(lines)})
    return {**notebook, "cells": cells}


def inject(exercise_notebook: dict, solution: dict, name: str) -> dict:
    """Put the solutions of ``solution`` back into its exercise edition: the stubs become
    the marked solution blocks again, the prompt cells go, the title and links are the
    solution's. The result is the solution notebook when nothing else differs."""
    solutions = {e.id: e for _, e, _, _ in find_exercises(solution, name[:2])}
    cells = []
    for index, cell in enumerate(exercise_notebook["cells"]):
        if PROMPT_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        if index == 0:
            cells.append(solution["cells"][0])
            continue
        if cell["cell_type"] == "markdown":
            cells.append({**cell, "source": as_source(_relink(lines_of(cell), False))})
            continue
        lines, out, i = lines_of(cell), [], 0
        while i < len(lines):
            head = STUB_HEAD.match(lines[i])
            if not head:
                out.append(lines[i])
                i += 1
                continue
            j = i
            while j < len(lines) and not STUB_RAISE.match(lines[j]):
                j += 1
            if j == len(lines) or head["id"] not in solutions:
                raise ExerciseFormatError(f"cell {index}: stub {head['id']} has no solution")
            out.extend(solutions[head["id"]].solution_lines())
            i = j + 1
        cells.append({**cell, "source": as_source(out)})
    return {**exercise_notebook, "cells": cells}


def dumps(notebook: dict) -> str:
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def solution_paths() -> list[Path]:
    return tracks.solutions()


def editions() -> dict[Path, str]:
    """Each exercise notebook's path and the text it must have."""
    return {
        tracks.exercise_edition(path): dumps(generate(json.loads(path.read_text()), path.name))
        for path in solution_paths()
    }


def exercise_table() -> str:
    """A markdown table of every exercise: its notebook, what to write, what checks it."""
    out = ["| exercise | what you write | checked by |", "|---|---|---|"]
    for path in solution_paths():
        notebook = json.loads(path.read_text())
        for index, exercise, _, _ in find_exercises(notebook, path.name[:2]):
            check = next(
                "".join(lines_of(c))
                for c in notebook["cells"][index + 1 :]
                if c["cell_type"] == "code"
            )
            checks = sorted(set(re.findall(r"(workshop(?:_jax)?\.check_\w+)", check)))
            by = ", ".join(f"`{c}`" for c in checks) or "assertions"
            task = sentence(exercise.task)
            edition = tracks.repo_path(tracks.exercise_edition(path))
            link = f"[{exercise.id} · {exercise.title}](../{edition})"
            out.append(f"| {link} | {task} | {by} |")
    return "\n".join(out)


def teaching_page() -> str:
    head, rest = TEACHING.read_text().split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{exercise_table()}\n{TABLE_END}{tail}"


def main(argv: list[str]) -> int:
    wanted = editions()
    wanted_page = teaching_page()
    page_stale = TEACHING.read_text() != wanted_page
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    folders = [folder / "exercises" for folder in tracks.FOLDERS]
    extra = sorted({p for f in folders for p in f.glob("*.ipynb")} - set(wanted))
    if "--check" in argv:
        for path in stale + extra + ([TEACHING] if page_stale else []):
            print(f"{path.relative_to(ROOT)} is out of date: run python tools/exercises.py")
        return 1 if stale or extra or page_stale else 0
    for folder in folders:
        folder.mkdir(exist_ok=True)
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    for path in extra:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)} (no solution notebook)")
    if page_stale:
        TEACHING.write_text(wanted_page)
        print(f"wrote the list of exercises in {TEACHING.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
