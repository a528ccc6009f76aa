"""Execute every notebook on CPU with its offline parameters and write the run report.

    python tools/run_notebooks.py                  # the main job: build/notebooks + report
    python tools/run_notebooks.py --prepare-only   # inject parameters only (for nbval)
    python tools/run_notebooks.py --only 00        # one notebook
    python tools/run_notebooks.py --exercises --prepare-only --out workshop
                                    # the exercise edition, with the offline parameters

Parameters come from ``tests/params/<notebook stem>.yaml``, and a notebook runs once more for
each ``tests/params/<notebook stem>.<variant>.yaml`` (written to ``<stem>.<variant>.ipynb``);
``${FIXTURES}`` and ``${OUTPUTS}`` in their values become absolute paths (see
``notebook_parameters``). The fixtures are built first (cached).

The console shows one progress line per notebook (which one, cells done, elapsed); what the
kernels write to their standard error (TensorFlow's C++ log lines) goes to
``<notebook>.kernel.log`` beside each executed notebook.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PARAMS = ROOT / "tests" / "params"


def runs_of(notebook: Path) -> list[tuple[str, Path]]:
    """``(run name, parameter file)`` per run of a notebook: ``<stem>.yaml`` (run name
    ``<stem>``), then each variant ``<stem>.<variant>.yaml`` (run ``<stem>.<variant>``),
    the same notebook with other parameters (notebook 01 on sentence pairs, say)."""
    path = PARAMS / f"{notebook.stem}.yaml"
    if not path.exists():
        raise SystemExit(f"{path} is missing: every notebook needs CPU parameters there.")
    variants = sorted(PARAMS.glob(f"{notebook.stem}.*.yaml"))
    return [(p.name.removesuffix(".yaml"), p) for p in [path, *variants]]


def notebook_parameters(path: Path, build: Path, outputs: Path) -> dict:
    """The CPU parameters in ``path`` with placeholders filled in: ``${FIXTURES}`` (the
    fixtures in ``build``), ``${OUTPUTS}`` (what the runs write: checkpoints, records,
    models; one folder per set of runs, so that no run resumes another's checkpoints)."""
    text = path.read_text().replace("${FIXTURES}", str(build / "fixtures"))
    text = text.replace("${OUTPUTS}", str(outputs))
    return yaml.safe_load(text) or {}


@contextlib.contextmanager
def stderr_to(path: Path):
    """Send this process's file descriptor 2, and so that of every process it starts (a
    kernel), to ``path``; restore it afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=str(ROOT / "build"), help="build folder")
    parser.add_argument("--out", default=None, help="executed notebooks (default BUILD/notebooks)")
    parser.add_argument("--prepare-only", action="store_true", help="inject parameters, do not run")
    parser.add_argument("--only", action="append", default=[], help="notebook number prefix")
    parser.add_argument(
        "--exercises", action="store_true", help="the exercise edition (notebooks/exercises)"
    )
    parser.add_argument(
        "--no-variants", action="store_true", help="only <stem>.yaml, not <stem>.<variant>.yaml"
    )
    args = parser.parse_args(argv)

    import papermill

    import tpu_helpers  # noqa: F401  (environment flags)
    from tpu_helpers.fixtures import build_fixtures
    from tpu_helpers.report import build_report

    build = Path(args.build).resolve()
    out = Path(args.out).resolve() if args.out else build / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    build_fixtures(build / "fixtures")

    source = NOTEBOOKS / "exercises" if args.exercises else NOTEBOOKS
    notebooks = sorted(source.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        notebooks = [p for p in notebooks if any(p.name.startswith(o) for o in args.only)]
    if not args.prepare_only:  # a fresh run: nothing resumes an earlier run's checkpoints
        shutil.rmtree(out / "outputs", ignore_errors=True)
    runs = [(nb, name, params) for nb in notebooks for name, params in runs_of(nb)]
    if args.no_variants:
        runs = [run for run in runs if run[1] == run[0].stem]
    executed, failed = [], []
    console = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    for index, (nb, name, params_file) in enumerate(runs, 1):
        target = out / f"{name}.ipynb"
        params = notebook_parameters(params_file, build, out / "outputs")
        start = time.time()
        progress = (
            False
            if args.prepare_only
            else {
                "desc": f"[{index}/{len(runs)}] {target.name}",
                "file": console,
                "bar_format": "{desc}: {n_fmt}/{total_fmt} cells, {elapsed}",
                "mininterval": 2.0,
                "dynamic_ncols": False,
                "leave": False,
            }
        )
        try:
            with stderr_to(out / f"{name}.kernel.log"):
                papermill.execute_notebook(
                    str(nb),
                    str(target),
                    parameters=params,
                    prepare_only=args.prepare_only,
                    kernel_name="python3",
                    cwd=str(out),
                    progress_bar=progress,
                    log_output=False,
                )
            status = "prepared" if args.prepare_only else "ok"
        except papermill.PapermillExecutionError as err:
            status = f"FAILED ({err.ename}: {err.evalue}; kernel log: {name}.kernel.log)"
            failed.append(target.name)
        executed.append(target)
        print(
            f"[{index}/{len(runs)}] {target.name}: {status} in {time.time() - start:.1f} s",
            flush=True,
        )

    if not args.prepare_only:
        summaries = build_report(executed, build / "report", title="Notebooks on CPU (offline)")
        for s in summaries:
            print(
                f"  {s['name']}: {s['status']}, "
                + ", ".join(f"{k}={v}" for k, v in s["metrics"].items())
            )
        print(f"report: {build / 'report' / 'report.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
