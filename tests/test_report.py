import re
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from report import build_report  # noqa: E402

from tpu_helpers.teaching.report import METRICS_MIME, publish_metrics  # noqa: E402

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def executed(tmp_path, name, outputs, duration=12.5):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x = 1")
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    nb.cells.append(cell)
    nb.metadata["papermill"] = {"duration": duration, "exception": None}
    path = tmp_path / name
    nbformat.write(nb, str(path))
    return path


def test_report_collects_status_metrics_and_plots(tmp_path):
    ok = executed(
        tmp_path,
        "01_ok.ipynb",
        [
            {
                "output_type": "display_data",
                "metadata": {},
                "data": {METRICS_MIME: {"val_accuracy": 0.91}, "text/plain": "x"},
            },
            {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG}},
        ],
    )
    bad = executed(
        tmp_path,
        "02_bad.ipynb",
        [
            {
                "output_type": "error",
                "ename": "AssertionError",
                "evalue": "loss did not fall",
                "traceback": [],
            }
        ],
    )
    summaries = build_report([ok, bad], tmp_path / "report")
    assert summaries[0]["status"] == "ok" and summaries[0]["metrics"] == {"val_accuracy": 0.91}
    assert summaries[0]["plots"] == [PNG] and summaries[0]["duration_s"] == 12.5
    assert summaries[1]["status"] == "failed"
    assert summaries[1]["error"] == "AssertionError: loss did not fall"
    page = (tmp_path / "report" / "report.html").read_text()
    assert "val_accuracy=0.91" in page and PNG in page and "loss did not fall" in page
    assert (tmp_path / "report" / "report.json").exists()
    # every link of the page leads to a file a browser opens: the notebooks as HTML
    hrefs = re.findall(r"href='([^'#]+)'", page)
    assert sorted(h for h in hrefs if h.endswith(".html")) == ["../01_ok.html", "../02_bad.html"]
    for href in hrefs:
        assert (tmp_path / "report" / href).resolve().exists(), href
    rendered = (tmp_path / "01_ok.html").read_text()
    assert PNG in rendered and "jp-Notebook" in rendered


def test_the_report_names_each_notebook_as_asked(tmp_path):
    """Two tracks' notebooks of one number: the page tells them apart by the names given."""
    (tmp_path / "tf").mkdir()
    main = executed(tmp_path, "01_fit.ipynb", [])
    seeds = executed(tmp_path / "tf", "01_fit.ipynb", [])
    summaries = build_report(
        [main, seeds], tmp_path / "report", render=False, names=["01_fit.ipynb", "tf/01_fit.ipynb"]
    )
    assert [s["name"] for s in summaries] == ["01_fit.ipynb", "tf/01_fit.ipynb"]
    assert "id='tf/01_fit.ipynb'" in (tmp_path / "report" / "report.html").read_text()
    with pytest.raises(ValueError, match="1 names for 2 notebooks"):
        build_report([main, seeds], tmp_path / "report", names=["01_fit.ipynb"])


def test_publish_metrics_prints_outside_ipython(capsys):
    publish_metrics(loss=0.123456, replicas=8)
    assert capsys.readouterr().out == "loss: 0.1235\nreplicas: 8\n"


def test_one_notebook_path_is_refused_with_the_list_that_fixes_it(tmp_path):
    with pytest.raises(
        TypeError,
        match=r"one path; build_report takes a list.*Fix: build_report\(\['run/01.ipynb'\]",
    ):
        build_report("run/01.ipynb", str(tmp_path / "report"))
