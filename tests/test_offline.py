"""The workshop's offline parameters (tpu_helpers.teaching.offline), and the teaching page's recipe
for a room without TPUs, run as the page writes it."""

import re
import sys
import textwrap
from pathlib import Path

import pytest

from tpu_helpers.teaching.offline import PARAMS, fill_in, parameters_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import readme  # noqa: E402
import tracks  # noqa: E402

REPO_URL = readme.repo_url()


def test_the_runner_and_a_notebook_read_the_same_parameter_folders():
    assert tracks.PARAMS == {
        tracks.MAIN: ROOT / PARAMS["main"],
        tracks.SEEDS: ROOT / PARAMS["seeds"],
    }


def test_a_notebook_is_named_by_its_number_its_stem_or_a_variant():
    assert parameters_file("01", ROOT).name == "01_text_classification_fit.yaml"
    stem = "01_text_classification_fit.pairs"
    assert parameters_file(stem, ROOT).name == f"{stem}.yaml"
    assert parameters_file("07", ROOT, "seeds").parent == ROOT / "tests" / "params" / "tf"


@pytest.mark.parametrize("notebook", ["1", "01_x", "11", "0"])
def test_a_name_that_is_not_one_notebook_is_refused_with_the_names(notebook):
    with pytest.raises(ValueError, match=r"Fix: one of .*'01_text_classification_fit'"):
        parameters_file(notebook, ROOT)


def test_a_folder_that_is_not_a_clone_is_named_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*Fix: git clone the repository"):
        parameters_file("01", tmp_path)
    with pytest.raises(ValueError, match="Fix: one of"):
        parameters_file("01", ROOT, track="tf")


def test_placeholders_become_the_folders_given(tmp_path):
    text = "model: ${FIXTURES}/tiny-bert\nout: ${OUTPUTS}/01\nepochs: 2\n"
    assert fill_in(text, tmp_path / "f", "/o") == {
        "model": f"{tmp_path}/f/tiny-bert",
        "out": "/o/01",
        "epochs": 2,
    }
    odd = "/my drive/a: b #1"  # YAML's separators in a folder's name change nothing
    assert fill_in(text, odd, odd)["model"] == f"{odd}/tiny-bert"


def test_offline_parameters_are_the_papermill_runs_with_the_fixtures_built(fixtures_dir, capsys):
    from tpu_helpers.teaching.offline import offline_parameters

    build = fixtures_dir.parent
    values = offline_parameters("01", ROOT, build=build)
    assert values["model_checkpoint"] == str(fixtures_dir / "tiny-distilbert")
    assert values["dataset_name"] == str(fixtures_dir / "cola")
    assert values["output_dir"] == str(build.resolve() / "outputs" / "01_cola")
    assert values["simulated_replicas"] == 2 and values["epochs"] == 2
    printed = capsys.readouterr().out
    assert "fixtures: up to date" in printed and "  epochs = 2" in printed
    pairs = offline_parameters("01_text_classification_fit.pairs", ROOT, build=build, verbose=False)
    assert pairs["text_pair_column"] == "sentence2" and capsys.readouterr().out == ""


def _recipe_cell() -> str:
    page = (ROOT / "docs" / "teaching.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    (cell,) = [textwrap.dedent(b) for b in blocks if "offline_parameters" in b]
    return cell


def test_the_no_tpu_recipe_runs_notebook_01_as_the_teaching_page_writes_it(tmp_path, monkeypatch):
    """The cell docs/teaching.md gives a CPU runtime of Colab or Kaggle, put under notebook
    01's parameters cell and run with the rest of the notebook; the one change: a local
    clone for the GitHub address, and a temporary folder for Colab's /content. The kernel
    starts without this leg's simulated devices, as a runtime's does: the notebook makes
    its own (``simulated_replicas`` of the parameters)."""
    pytest.importorskip("keras_hub")
    import nbformat
    import papermill

    cell = _recipe_cell()
    assert f"!git clone -q --depth 1 {REPO_URL} /content/tpu-workshop" in cell
    workshop = tmp_path / "tpu-workshop"
    cell = cell.replace(REPO_URL, str(ROOT)).replace("/content/tpu-workshop", str(workshop))
    notebook = nbformat.read(ROOT / "notebooks" / "01_text_classification_fit.ipynb", 4)
    tagged = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(cell))
    source, executed = tmp_path / "01.ipynb", tmp_path / "01.executed.ipynb"
    nbformat.write(notebook, source)
    for name in ("XLA_FLAGS", "PJRT_NPROC"):
        monkeypatch.delenv(name, raising=False)
    papermill.execute_notebook(
        str(source),
        str(executed),
        kernel_name="python3",
        cwd=str(tmp_path),
        progress_bar=False,
        execution_timeout=300,
    )

    ran = nbformat.read(executed, 4).cells[tagged[0] + 1]
    printed = "".join(o.get("text", "") for o in ran.outputs)
    assert "offline parameters of 01_text_classification_fit.yaml" in printed, printed
    assert f"model_checkpoint = '{workshop}/build/fixtures/tiny-distilbert'" in printed
    assert (workshop / "build" / "outputs" / "01_cola").is_dir()  # where the run wrote
    assert not (workshop / "build" / "fixtures" / "engines").exists()  # no TF engine needed
