"""Committed notebooks: stripped, parameterised, runnable on Colab/Kaggle, listed in the README."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import readme  # noqa: E402
import run_notebooks  # noqa: E402
import tracks  # noqa: E402

NOTEBOOKS = tracks.solutions()
EXERCISE_EDITIONS = [tracks.exercise_edition(p) for p in NOTEBOOKS]


def load(path):
    return json.loads(path.read_text())


def source(cell):
    return "".join(cell["source"])


def test_each_track_numbers_its_lessons_once_and_runs_on_its_engine():
    """The main track (notebooks/) on Keras 3 and JAX, the seeds' track (notebooks/tf/) on
    the TF engine; a lesson's number is the same on both (01 is text classification)."""
    for folder, engine in ((tracks.MAIN, "keras3"), (tracks.SEEDS, "tf")):
        paths = tracks.solutions(folder)
        numbers = [p.name[:2] for p in paths]
        assert len(paths) >= 1 and len(set(numbers)) == len(numbers), numbers
        assert {run_notebooks.engine_of(p) for p in paths} == {engine}, folder
    seeds = {p.name[:2]: p.name for p in tracks.solutions(tracks.SEEDS)}
    for path in tracks.solutions(tracks.MAIN):
        if path.name[:2] in seeds:
            lesson = seeds[path.name[:2]].removesuffix(".ipynb").split("_", 1)[1]
            assert lesson.split("_")[0] in path.name, (path.name, seeds[path.name[:2]])


@pytest.mark.parametrize("path", tracks.solutions(tracks.SEEDS), ids=tracks.repo_path)
def test_each_seeds_notebook_says_where_it_runs_and_links_the_main_tracks_lesson(path):
    """A learner who opens a seeds' notebook on Colab's or Kaggle's TPU (where TensorFlow
    finds no chip) is sent, from its first cell, to the main track's notebook of the same
    lesson; its exercise edition links that notebook too, from one folder further down."""
    main = next(tracks.MAIN.glob(f"{path.name[:2]}_*.ipynb"))
    for notebook, prefix in ((path, "../"), (tracks.exercise_edition(path), "../../")):
        first = source(load(notebook)["cells"][0])
        assert "**Where it runs**" in first and "Cloud TPU VM" in first, notebook
        assert f"]({prefix}{main.name})" in first, (notebook, main.name)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_committed_without_outputs(path):
    for cell in load(path)["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, source(cell)[:80]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_one_parameters_cell_and_language_metadata(path):
    nb = load(path)
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    assert nb["metadata"]["kernelspec"]["language"] == "python"
    assert nb["metadata"]["language_info"]["name"] == "python"
    # Plain assignments only, so papermill and Colab forms can override them.
    for line in source(tagged[0]).splitlines():
        assert not line.strip() or line.startswith("#") or " = " in line, line


CHECKS_LINE = "# Checks: what must hold here"
FIGURES = ", and the figures for the run report"  # added when the checks publish metrics


def is_check(node) -> bool:
    """An assert, a ``publish_metrics(...)`` call, or an ``if``/``for`` of them."""
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return getattr(node.value.func, "id", None) == "publish_metrics"
    if isinstance(node, (ast.If, ast.For)):
        inner = node.body + node.orelse
        return any(map(is_check, inner)) and all(
            is_check(n) or isinstance(n, ast.Assign) for n in inner
        )
    return False


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_each_cells_checks_come_last_under_one_comment(path):
    """What a notebook asserts, and the figures it publishes for the run report, end their
    cell under one ``# Checks`` line, so the lesson reads without them; an exercise's own
    ``# Check your answer`` cell is all checks and keeps its form. A table shown as the
    cell's result (a bare name) may follow them."""
    for cell in load(path)["cells"]:
        text = source(cell)
        if cell["cell_type"] != "code" or text.startswith(("# Check your answer", "# BEGIN")):
            continue
        body = ast.parse(text).body
        if body and isinstance(body[-1], ast.Expr) and isinstance(body[-1].value, ast.Name):
            body = body[:-1]
        lines = text.splitlines()
        first = next((i for i, node in enumerate(body) if is_check(node)), None)
        if first is None:
            assert CHECKS_LINE not in text, text[:300]
            continue
        assert all(map(is_check, body[first:])), f"code after the checks:\n{text[:600]}"
        publishes = "publish_metrics(" in "\n".join(lines[body[first].lineno - 1 :])
        mark = CHECKS_LINE + (FIGURES if publishes else "")
        assert lines[body[first].lineno - 2] == mark, f"no {mark!r} line:\n{text[:600]}"
        assert text.count(CHECKS_LINE) == 1, text[:600]


LESSON_LINES = 25


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_lesson_cells_are_short_enough_to_read_at_once(path):
    """A code cell's lesson, the lines above its ``# Checks`` line, is at most 25 lines: a
    longer one is two steps, each with its own sentence. The parameters cell is a form."""
    for index, cell in enumerate(load(path)["cells"]):
        tags = cell["metadata"].get("tags", [])
        if cell["cell_type"] != "code" or "parameters" in tags:
            continue
        lesson = source(cell).split(CHECKS_LINE)[0].rstrip("\n").splitlines()
        assert len(lesson) <= LESSON_LINES, f"cell {index}: {len(lesson)} lines\n{lesson[0]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_badges_point_at_this_notebook(path):
    first = source(load(path)["cells"][0])
    colab, kaggle = readme.badges(tracks.repo_path(path))
    assert f"({colab})" in first and f"({kaggle})" in first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_install_cell_is_the_shared_one(path):
    code = [c for c in load(path)["cells"] if c["cell_type"] == "code"]
    install = source(code[0])
    assert f'REPO = "{readme.repo_url()}"' in install
    engine = run_notebooks.engine_of(path)
    assert ("tpu_helpers.install()" if engine == "tf" else f'install(engine="{engine}")') in install
    assert '"google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ' in install


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_the_install_cell_runs_before_anything_it_may_change_is_imported(path):
    """A package the install cell replaces after it was imported needs a runtime restart:
    the cell comes first and imports nothing but ``tpu_helpers`` and the standard library
    (which loads none of what the plans change: the next test)."""
    install = source([c for c in load(path)["cells"] if c["cell_type"] == "code"][0])
    imported = set(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", install, re.M))
    assert imported <= {"os", "subprocess", "sys", "tpu_helpers"}, imported


def test_importing_tpu_helpers_loads_nothing_an_install_plan_changes():
    code = (
        "import sys, tpu_helpers, tpu_helpers.runtime; print(sorted(m for m in ('keras', 'jax',"
        " 'tensorflow', 'tf_keras', 'transformers', 'keras_hub', 'datasets') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_has_cpu_parameters(path):
    assert tracks.params_file(path).exists()


def test_readme_table_is_generated_from_the_notebooks():
    current = (ROOT / "README.md").read_text()
    assert current == readme.render(current), "run: python tools/readme.py"
    for path in NOTEBOOKS:
        assert f"({tracks.repo_path(path)})" in current


def test_every_page_names_the_runtimes_tpus_as_runtime_py_does():
    """Kaggle's TPU is a v5e-8 (it was a v3-8): the notebooks, the README and the pages of
    docs/ say so, from one source, tpu_helpers.runtime.TPU_OFFERS."""
    import re

    from tpu_helpers.runtime import TPU_OFFERS

    kaggle = re.search(r"v\d+[a-z]*-\d+", TPU_OFFERS["Kaggle"]).group(0)
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    pages += [*NOTEBOOKS, *EXERCISE_EDITIONS]
    for page in pages:
        text = page.read_text()
        for mention in re.findall(r"Kaggle[^.|\n]{0,60}?\bv\d+[a-z]*-\d+", text):
            assert mention.endswith(kaggle), (page.name, mention)
        assert "TPU VM v3-8" not in text, page.name
    setups = [p for p in NOTEBOOKS if p.name.startswith("00_")]
    for page in (*setups, ROOT / "docs" / "teaching.md"):
        text = page.read_text()
        assert all(offer in text for offer in TPU_OFFERS.values()), page.name


PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=tracks.repo_path)
def test_relative_links_of_the_pages_resolve(page):
    """Every link to a file of the repository (and to a heading of a page) leads there."""
    import re

    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), (page.name, target)
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"(?m)^#+ (.+)$", linked.read_text())
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, (page.name, target)


def test_the_readme_is_a_first_page():
    """What this is, the notebooks, the two commands, where to read more: the rest is in
    docs/ and CONTRIBUTING.md."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 8 * 1024, len(text.encode())
    for heading in ("## Notebooks", "## The two commands", "## Read more"):
        assert heading in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_checkpoints_load_through_hub_and_bfloat16_applies_where_asked(path):
    """``TFAuto*.from_pretrained`` stops on the PyTorch-named safetensors of nearly every hub
    checkpoint, and transformers 4's ``AutoTokenizer`` on the tokenizer files transformers
    5 writes: the notebooks load through ``tpu_helpers.data.hub``. The bf16 policy is applied
    whenever its parameter asks for it, on a CPU too."""
    import re

    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    assert not re.search(r"TFAuto\w*\.from_pretrained\(|AutoTokenizer\.from_pretrained\(", code)
    for line in code.splitlines():
        if "mixed_bfloat16" in line and line.lstrip().startswith("if "):
            assert line.split("#")[0].strip() == "if mixed_bfloat16:", line


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_parameter_files_name_the_per_replica_batch_they_scale(path):
    """``run_notebooks --replicas N`` keeps a run's global batch, per_replica_batch x
    simulated_replicas as its parameter file gives them: both must be written there."""
    import re

    import yaml

    cell = next(c for c in load(path)["cells"] if "parameters" in c["metadata"].get("tags", []))
    batches = set(re.findall(r"^(\w*per_replica_batch) =", source(cell), re.M))
    if not batches:
        return
    for params in sorted(tracks.params_folder(path).glob(f"{path.stem}*.yaml")):
        written = yaml.safe_load(params.read_text())
        assert {*batches, "simulated_replicas"} <= written.keys(), params.name


def _is_helper_module(dotted: str) -> bool:
    """Whether ``tpu_helpers.<dotted>`` is a module or folder of the package (not a name)."""
    path = ROOT / "tpu_helpers" / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _helper_names_used(code: str) -> set[tuple[str, str]]:
    """``(module, name)`` for every ``tpu_helpers`` module name a notebook uses:
    ``from tpu_helpers.m import n`` and ``m.n`` after ``from tpu_helpers.folder import m``
    (or ``from tpu_helpers import m``); ``module`` is dotted below ``tpu_helpers``."""
    import re

    used = set()
    modules = {}  # the name in the notebook: the module
    for line in code.splitlines():
        found = re.match(r"\s*from tpu_helpers(?:\.([\w.]+))? import (.+)", line)
        if not found:
            continue
        prefix = f"{found[1]}." if found[1] else ""
        for item in found[2].split("#")[0].strip().strip("()").split(","):
            name, _, alias = (part.strip() for part in item.partition(" as "))
            if not name:
                continue
            if _is_helper_module(f"{prefix}{name}"):
                modules[alias or name] = f"{prefix}{name}"
            else:
                used.add((found[1] or "", name))
    for local, module in modules.items():
        used |= {(module, n) for n in re.findall(rf"(?<![\w.]){local}\.(\w+)", code)}
    return used


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_notebooks_use_only_declared_helper_names(path):
    """What a notebook takes from tpu_helpers is each module's public interface (``__all__``),
    so that a reader finds it declared where it lives."""
    import importlib

    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    undeclared = []
    for module, name in sorted(_helper_names_used(code)):
        where = f"tpu_helpers.{module}" if module else "tpu_helpers"
        declared = getattr(importlib.import_module(where), "__all__", ())
        if name not in declared:
            undeclared.append(f"{module}.{name}")
    assert not undeclared, f"not in their module's __all__: {undeclared}"


def test_notebook_01_trains_with_model_fit_in_its_own_code():
    """The lesson in the title is on the page: ``model.fit`` on an epoch's batches, with
    the resume pieces (a restore call, a callback) a learner can carry to their own job."""
    path = tracks.SEEDS / "01_text_classification_fit.ipynb"
    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    assert "model.fit(" in code and "fit_resumable(" not in code
    assert ".distribute(strategy, epoch, skip_steps=skip)" in code
    assert ".resume_point(" in code and ".callback(" in code


def test_notebook_02_writes_its_training_step_with_strategy_run():
    """The custom-loop lesson's step is on the page: the tape, the loss scaled to the
    global batch, strategy.run in a compiled multi-step function."""
    path = tracks.SEEDS / "02_custom_training_loop.ipynb"
    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    for piece in ("tf.GradientTape()", "strategy.run(", "replica_loss(per_example, global_batch)"):
        assert piece in code, piece
    assert "train_steps=" in code and "@tf.function" in code


@pytest.mark.parametrize("path", EXERCISE_EDITIONS, ids=tracks.repo_path)
def test_no_stub_holds_its_hint_or_imports_a_helper_function(path):
    """The learner makes the decision: a stub cell shows the task, not the hint (that is
    folded in the cell before), and imports no function of tpu_helpers (one could compute
    the answer: 00.1's replica_sum did); modules such as workshop are fine."""
    import re

    for cell in load(path)["cells"]:
        text = source(cell)
        if cell["cell_type"] != "code" or "raise NotImplementedError" not in text:
            continue
        assert "Hint:" not in text, text[:300]
        imported = [
            name.strip()
            for folder, names in re.findall(r"from tpu_helpers\.([\w.]+) import (.+)", text)
            for name in names.split(",")
            if not _is_helper_module(f"{folder}.{name.strip()}")
        ]
        assert not imported, f"a stub cell imports {imported} from tpu_helpers"


CHECKS_HEAD = "# The checks: what the run must reach"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=tracks.repo_path)
def test_the_checks_thresholds_are_a_parameter_group_of_their_own(path):
    """A threshold a check asserts (``min_*_gain``, ``max_*_ratio``) is not a setting of the
    run: it sits after the run's parameters, under its own heading."""
    import re

    cell = next(c for c in load(path)["cells"] if "parameters" in c["metadata"].get("tags", []))
    lines = source(cell).splitlines()
    thresholds = [
        i for i, line in enumerate(lines) if re.match(r"(min|max)_\w*(gain|ratio) =", line)
    ]
    if not thresholds:
        return
    head = next(i for i, line in enumerate(lines) if line.startswith(CHECKS_HEAD))
    assert thresholds == list(range(head + 1, len(lines))), lines[head:]


def test_the_errors_that_send_a_learner_to_the_main_track_name_notebooks_that_exist():
    from tpu_helpers.runtime import MAIN_TRACK

    named = re.findall(r"notebooks/[\w./]+\.ipynb", MAIN_TRACK)
    assert named and all((ROOT / path).exists() for path in named), named


def test_the_main_tracks_custom_loop_writes_its_step_in_jax():
    """Main-track 02's step is on the page: the model as a pure function, its gradient,
    the optimizer's stateless update, several steps in one scan, a mesh, resumable saves."""
    path = tracks.MAIN / "02_custom_training_loop.ipynb"
    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    for piece in (
        "model.stateless_call(",
        "jax.value_and_grad(",
        "optimizer.stateless_apply(",
        "jax.lax.scan(",
        "@jax.jit",
        "Mesh(",
        "RunSaves(",
        "saves.restore(model)",
    ):
        assert piece in code, piece
    assert "fit_resumable(" not in code and "model.fit(" not in code


#: The lessons of the main track.
MAIN_LESSONS = tracks.solutions(tracks.MAIN)


@pytest.mark.parametrize("path", MAIN_LESSONS, ids=tracks.repo_path)
def test_main_track_notebooks_show_the_libraries_they_teach(path):
    """A learner on the main track reads Keras, and JAX or KerasHub, in the notebook."""
    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    assert re.search(r"^import keras\b", code, re.M) and "keras." in code, path.name
    shown = [m for m in ("jax", "keras_hub") if re.search(rf"^import {m}\b", code, re.M)]
    assert any(f"{m}." in code for m in shown), path.name


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize(
    "path", MAIN_LESSONS + [tracks.exercise_edition(p) for p in MAIN_LESSONS], ids=tracks.repo_path
)
def test_main_track_pages_link_only_main_track_notebooks(path):
    """A learner who opened a main-track notebook from its Colab link stays on the main
    track: every link to a notebook is to one of the main track's (the seeds' track is named
    once, in the title cell, without a link)."""
    main = {p.name for p in MAIN_LESSONS}
    for index, cell in enumerate(load(path)["cells"]):
        for target in MARKDOWN_LINK.findall(source(cell)):
            if target.startswith("http") or not target.split("#")[0].endswith(".ipynb"):
                continue
            name = target.split("#")[0].removeprefix("../")
            assert "/" not in name and name in main, (path.name, index, target)
    title = source(load(path)["cells"][0])
    assert "`notebooks/tf/`" in title, "the title cell says what the other track is"


@pytest.mark.parametrize("path", MAIN_LESSONS[:-1], ids=tracks.repo_path)
def test_each_main_track_lesson_leads_to_the_next_one(path):
    """The "Next" cell of a main-track lesson links the lesson numbered after it (the
    numbers have a gap where a lesson left the track), so a reader can follow the track
    from 00 to its end."""
    following = MAIN_LESSONS[MAIN_LESSONS.index(path) + 1]
    last = source(load(path)["cells"][-1])
    assert last.startswith("## Next"), (path.name, last[:80])
    assert f"]({following.name})" in last, (path.name, following.name, last)


FOLDER_PARAMETER = re.compile(r"^(\w*(?:_dir|_path|_folder))\s*=\s*\"", re.M)


@pytest.mark.parametrize("path", MAIN_LESSONS, ids=tracks.repo_path)
def test_a_main_track_page_with_folders_logs_in_to_a_bucket_as_notebook_01_does(path):
    """Every folder parameter may be a gs:// path: the page logs the runtime in to Google
    Cloud (Colab's auth, Kaggle's secrets) for each one that is, in one login cell whose
    body is the same on every page, before the folders are used."""
    cells = load(path)["cells"]
    parameters = next(c for c in cells if "parameters" in c["metadata"].get("tags", []))
    folders = FOLDER_PARAMETER.findall(source(parameters))
    logins = [
        c for c in cells if c["cell_type"] == "code" and "auth.authenticate_user()" in source(c)
    ]
    if not folders:
        assert not logins, path.name
        return
    assert len(logins) == 1, path.name
    reference = next(
        source(c)
        for c in load(MAIN_LESSONS[1])["cells"]
        if c["cell_type"] == "code" and "auth.authenticate_user()" in source(c)
    )
    listed = f"({folders[0]},)" if len(folders) == 1 else f"({', '.join(folders)})"
    line = f'bucket_paths = [p for p in {listed} if p.startswith("gs://")]'
    assert source(logins[0]) == re.sub(r"^bucket_paths = .*$", line, reference, flags=re.M)


@pytest.mark.parametrize("path", MAIN_LESSONS, ids=tracks.repo_path)
def test_main_track_sets_the_backend_on_the_page_before_keras_starts(path):
    """`KERAS_BACKEND = "jax"` in the notebook's own code, before the first import of Keras
    or JAX: a learner who retypes the setup gets Keras on JAX, not the TensorFlow backend
    that tensorflow-cpu (installed for tf.data) would make the default."""
    code = "\n".join(source(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    backend = code.find('os.environ["KERAS_BACKEND"] = "jax"')
    first_import = re.search(r"^(import|from) (keras|jax)\b", code, re.M)
    assert backend >= 0, path.name
    assert first_import is None or backend < first_import.start(), path.name
