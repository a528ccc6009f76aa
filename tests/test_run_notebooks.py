"""The main job's runner (tools/run_notebooks.py): runs side by side keep their order,
their failures and their kernel logs."""

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import run_notebooks  # noqa: E402


def _notebook(path: Path, source: str) -> str:
    cell = nbformat.v4.new_code_cell(source)
    kernel = {"name": "python3", "language": "python", "display_name": "Python 3"}
    notebook = nbformat.v4.new_notebook(
        cells=[cell], metadata={"kernelspec": kernel, "language_info": {"name": "python"}}
    )
    nbformat.write(notebook, path)
    return str(path)


@pytest.mark.parametrize("jobs", [1, 2])
def test_runs_report_their_own_failure_in_the_order_given(tmp_path, jobs):
    sources = {
        "ok": "print(answer * 2)",
        "broken": "raise ValueError(f'bad answer {answer}')",
        "also_ok": "import sys; print('to stderr', file=sys.stderr)",
    }
    calls = [
        dict(
            notebook=_notebook(tmp_path / f"{name}.in.ipynb", source),
            target=str(tmp_path / f"{name}.ipynb"),
            parameters={"answer": 21},
            prepare_only=False,
            cwd=str(tmp_path),
        )
        for name, source in sources.items()
    ]
    errors = run_notebooks.run_all(calls, jobs)
    assert errors[0] is None and errors[2] is None, errors
    assert errors[1].startswith("FAILED (ValueError: bad answer 21"), errors[1]
    assert "broken.kernel.log" in errors[1]
    executed = nbformat.read(tmp_path / "ok.ipynb", as_version=4)
    assert executed.cells[-1].outputs[0]["text"] == "42\n"  # the parameter was injected
    assert (tmp_path / "also_ok.kernel.log").exists()


def test_no_jobs_is_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        run_notebooks.main(["--jobs", "0"])
    assert "--jobs 0: give 1 or more" in capsys.readouterr().err


def test_set_overrides_every_runs_parameters_and_refuses_a_bad_item(capsys, tmp_path, monkeypatch):
    items = ["simulated_replicas=8", "mixed_bfloat16=false", "output_dir=gs://b/run"]
    assert run_notebooks.parameter_overrides(items) == {
        "simulated_replicas": 8,
        "mixed_bfloat16": False,
        "output_dir": "gs://b/run",
    }
    # a relative path that exists from here is read from here, not from the notebook's folder
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    paths = ["model_checkpoint=./ckpt", "data=ckpt/../ckpt", "hub=google/bert-tiny", "x=ckpt"]
    paths.append("output_dir=./runs/new")  # not there yet, but a path: ./
    assert run_notebooks.parameter_overrides(paths) == {
        "model_checkpoint": str(tmp_path / "ckpt"),
        "data": str(tmp_path / "ckpt"),
        "output_dir": str(tmp_path / "runs" / "new"),
        "hub": "google/bert-tiny",  # no such folder: a hub name
        "x": "ckpt",  # no "/" nor "./": a name (a data set's, a config's) stays as given
    }
    with pytest.raises(SystemExit):
        run_notebooks.main(["--set", "simulated_replicas"])
    assert "--set 'simulated_replicas': give NAME=VALUE" in capsys.readouterr().err


def test_a_run_on_other_replicas_keeps_its_global_batch():
    two = {"per_replica_batch": 16, "simulated_replicas": 2, "epochs": 2}
    assert run_notebooks.at_replicas(two, 8) == {
        "per_replica_batch": 4,
        "simulated_replicas": 8,
        "epochs": 2,
    }
    assert run_notebooks.at_replicas(two, 1)["per_replica_batch"] == 32
    planned = {"replicas": 8, "batch_size": 32}  # notebook 05: the TPU it plans for
    assert run_notebooks.at_replicas(planned, 1) == {"replicas": 1, "batch_size": 32}
    with pytest.raises(
        ValueError, match="global batch of 32 .per_replica_batch. does not split over 3 replicas"
    ):
        run_notebooks.at_replicas(two, 3)
    with pytest.raises(ValueError, match="--replicas 0: give 1 or more"):
        run_notebooks.at_replicas(two, 0)
    # notebook 10: the chips one model copy spans, as many of the file's as the count allows
    split = {"simulated_replicas": 2, "model_axis": 2, "rows_per_batch": 4}
    assert run_notebooks.at_replicas(split, 1)["model_axis"] == 1
    assert run_notebooks.at_replicas(split, 8)["model_axis"] == 2
    assert run_notebooks.at_replicas({**split, "model_axis": 4}, 8)["model_axis"] == 4
    with pytest.raises(ValueError, match="rows_per_batch 4 does not split over the 8 copies"):
        run_notebooks.at_replicas(split, 16)


def test_only_picks_runs_by_the_prefix_of_their_names(tmp_path, fixtures_dir):
    def prepared(*only):
        out = tmp_path / "-".join(only)
        args = ["--prepare-only", "--out", str(out), "--replicas", "1"]
        run_notebooks.main(args + [a for o in only for a in ("--only", o)])
        return sorted(p.name for p in (out / "tf").glob("*.ipynb"))  # the seeds' track

    pairs = "01_text_classification_fit.pairs"
    assert prepared(pairs) == [f"{pairs}.ipynb"]
    assert prepared("01") == ["01_text_classification_fit.ipynb", f"{pairs}.ipynb"]


def test_executed_copies_of_notebooks_that_no_longer_exist_are_dropped(tmp_path):
    """A notebook moved to the other track leaves no executed copy for the report."""
    for name in (
        "01_fit.ipynb",
        "01_fit.html",
        "03_gone.ipynb",
        "03_gone.html",
        "03_gone.kernel.log",
    ):
        (tmp_path / name).write_text("{}")
    assert run_notebooks.drop_stale_runs(tmp_path, {"01_fit"}) == ["03_gone.ipynb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_fit.html", "01_fit.ipynb"]
