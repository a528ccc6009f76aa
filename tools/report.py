"""The main job's report: one HTML page (and a JSON file) from executed notebooks: each
notebook's status, duration, the figures it published (``publish_metrics``) and its
plots, linked to the notebook rendered as HTML beside it (a browser cannot show an
``.ipynb``).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tpu_helpers.teaching.report import METRICS_MIME


def summarize_notebook(path: str | os.PathLike) -> dict:
    """Status, duration, error, metrics and PNG plots of one executed notebook."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    pm = nb.metadata.get("papermill", {})
    summary = {
        "name": Path(path).name,
        "path": str(path),
        "status": "ok",
        "duration_s": pm.get("duration"),
        "error": None,
        "metrics": {},
        "plots": [],
    }
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                summary["status"] = "failed"
                summary["error"] = f"{output.get('ename')}: {output.get('evalue')}"
            data = output.get("data", {})
            if METRICS_MIME in data:
                summary["metrics"].update(data[METRICS_MIME])
            if "image/png" in data:
                summary["plots"].append(data["image/png"])
    if pm.get("exception") and summary["status"] == "ok":
        summary["status"] = "failed"
    return summary


def render_html(path: str | os.PathLike) -> Path:
    """Render an executed notebook to ``<name>.html`` beside it (outputs and plots
    included); return that path."""
    import nbformat
    from nbconvert import HTMLExporter

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    target = path.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return target


def _page(summaries: Sequence[dict], title: str) -> str:
    rows, sections = [], []
    for s in summaries:
        dur = f"{s['duration_s']:.1f} s" if s["duration_s"] is not None else "-"
        metrics = ", ".join(f"{k}={v}" for k, v in s["metrics"].items()) or "-"
        rows.append(
            f"<tr class={s['status']}><td><a href='#{html.escape(s['name'])}'>"
            f"{html.escape(s['name'])}</a></td><td>{s['status']}</td><td>{dur}</td>"
            f"<td>{html.escape(metrics)}</td></tr>"
        )
        plots = "".join(
            f"<img src='data:image/png;base64,{p.strip()}' alt='plot'>" for p in s["plots"]
        )
        err = f"<pre>{html.escape(s['error'])}</pre>" if s["error"] else ""
        links = []
        if s.get("html_href"):
            links.append(f"<a href='{html.escape(s['html_href'])}'>the executed notebook</a>")
        if s.get("ipynb_href"):
            links.append(f"<a href='{html.escape(s['ipynb_href'])}' download>.ipynb</a>")
        sections.append(
            f"<h2 id='{html.escape(s['name'])}'>{html.escape(s['name'])}</h2>"
            f"<p>{' · '.join(links) or html.escape(s['path'])}</p>{err}{plots}"
        )
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}"
        "tr.failed td{background:#fdd}img{max-width:520px;margin:4px}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{style}</style></head><body><h1>{title}</h1><table>"
        "<tr><th>notebook</th><th>status</th><th>duration</th><th>key metrics</th></tr>"
        + "".join(rows)
        + "</table>"
        + "".join(sections)
        + "</body></html>"
    )


def build_report(
    notebooks: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    title: str = "Notebook run",
    render: bool = True,
    names: Sequence[str] | None = None,
) -> list[dict]:
    """Write ``out_dir/report.html`` and ``out_dir/report.json``; return the summaries.

    With ``render``, each notebook is rendered to HTML beside it and the page links that
    (and the ``.ipynb``) by paths relative to ``out_dir``. ``names``: what the page calls
    each notebook (default its file name; ``tf/01_x.ipynb`` tells two tracks' 01 apart).
    """
    if isinstance(notebooks, (str, os.PathLike)):
        raise TypeError(
            f"notebooks={str(notebooks)!r} is one path; build_report takes a list of them."
            f" Fix: build_report([{str(notebooks)!r}], out_dir)."
        )
    if names is not None and len(names) != len(notebooks):
        raise ValueError(f"{len(names)} names for {len(notebooks)} notebooks: give one each.")
    summaries = [summarize_notebook(p) for p in notebooks]
    for summary, name in zip(summaries, names or [], strict=False):
        summary["name"] = name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for summary, path in zip(summaries, notebooks, strict=True):
        summary["ipynb_href"] = Path(
            os.path.relpath(Path(path).resolve(), out.resolve())
        ).as_posix()
        if render:
            page = render_html(path)
            summary["html_href"] = Path(os.path.relpath(page.resolve(), out.resolve())).as_posix()
    (out / "report.html").write_text(_page(summaries, title), encoding="utf-8")
    slim = [
        {k: v for k, v in s.items() if k != "plots"} | {"plots": len(s["plots"])} for s in summaries
    ]
    (out / "report.json").write_text(json.dumps(slim, indent=1), encoding="utf-8")
    return summaries
