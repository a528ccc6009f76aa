"""Execute every notebook on CPU with its offline parameters and write the run report.

    python tools/run_notebooks.py                  # the main job: build/notebooks + report
    python tools/run_notebooks.py --prepare-only   # inject parameters only (for nbval)
    python tools/run_notebooks.py --only 00        # one notebook
    python tools/run_notebooks.py --replicas 8 --set mixed_bfloat16=false
                                    # every run on 8 replicas (same global batch), float32
    python tools/run_notebooks.py --exercises --prepare-only --out workshop
                                    # the exercise edition, with the offline parameters

A notebook runs on one engine (``engine_of``, its metadata ``tpu_helpers.engine``): the main
track (``notebooks/``) on Keras 3 and JAX, the seeds' track (``notebooks/tf/``) on the TF engine
(``tracks.py``). A run takes the notebooks of the engine this environment favours
(``runtime.choose_engine``), or of ``--engine``; the seeds' track is written to ``OUT/tf/``.
``tools/run.sh`` runs the main track in the Keras 3 stack; with ``--seeds`` it runs the
seeds' track first (in the CPU stack), and
``--report-all`` then writes one report of every executed notebook.

Parameters come from ``<params>/<notebook stem>.yaml`` (``tests/params/``, ``tests/params/tf/``
for the seeds' track), and a notebook runs once more for each
``<params>/<notebook stem>.<variant>.yaml`` (written to ``<stem>.<variant>.ipynb``);
``${FIXTURES}`` and ``${OUTPUTS}`` in their values become absolute paths (see
``notebook_parameters``). The fixtures are built first (cached).

The runs go ``--jobs`` at a time (default: one per core, at most 4), each kernel in a worker
process of its own: no run reads another's outputs, and most of a run's time is one core's
work (Python, tracing, XLA compilation): on 2 cores, two at a time took 571 s where one
after the other took 869 s (the main job, on one machine). The console shows a line per
run as it ends (with one job: a progress line per notebook, cells done and elapsed); what
the kernels write to their standard error (TensorFlow's C++ log lines) goes to
``<notebook>.kernel.log`` beside each executed notebook.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracks  # noqa: E402

ROOT = tracks.ROOT
#: Each engine's notebooks.
FOLDERS = {"keras3": tracks.MAIN, "tf": tracks.SEEDS}


def engine_of(notebook: Path) -> str:
    """The engine a notebook runs on: ``"tf"`` unless its metadata names another
    (``{"tpu_helpers": {"engine": "keras3"}}``)."""
    import json

    metadata = json.loads(notebook.read_text())["metadata"]
    return metadata.get("tpu_helpers", {}).get("engine", "tf")


def runs_of(notebook: Path) -> list[tuple[str, Path]]:
    """``(run name, parameter file)`` per run of a notebook: ``<stem>.yaml`` (run name
    ``<stem>``), then each variant ``<stem>.<variant>.yaml`` (run ``<stem>.<variant>``),
    the same notebook with other parameters (notebook 01 on sentence pairs, say)."""
    path = tracks.params_file(notebook)
    if not path.exists():
        raise SystemExit(f"{path} is missing: every notebook needs CPU parameters there.")
    variants = sorted(path.parent.glob(f"{notebook.stem}.*.yaml"))
    return [(p.name.removesuffix(".yaml"), p) for p in [path, *variants]]


def notebook_parameters(path: Path, build: Path, outputs: Path) -> dict:
    """The CPU parameters in ``path`` with placeholders filled in: ``${FIXTURES}`` (the
    fixtures in ``build``), ``${OUTPUTS}`` (what the runs write: checkpoints, records,
    models; one folder per set of runs, so that no run resumes another's checkpoints)."""
    from tpu_helpers.teaching.offline import fill_in

    return fill_in(path.read_text(), build / "fixtures", outputs)


def check_replicas(replicas: int) -> None:
    if replicas < 1:
        raise ValueError(f"--replicas {replicas}: give 1 or more (1 is Colab's one chip).")


def at_replicas(parameters: dict, replicas: int, name: str = "the parameters") -> dict:
    """A run's parameters on ``replicas`` simulated replicas (``simulated_replicas``, and
    ``replicas``, the TPU a notebook plans for), with the same global batches (each
    ``*per_replica_batch`` parameter scaled): the parameter
    file chose the sizes (how many steps an epoch takes), the replica count is the shape.
    A ``model_axis`` (notebook 10's chips per model copy) becomes its largest divisor that
    divides the replicas too."""
    check_replicas(replicas)
    out = dict(parameters)
    batches = [k for k in out if k.endswith("per_replica_batch")]  # image_per_replica_batch
    if "simulated_replicas" in out:
        for key in batches:
            global_batch = out[key] * max(out["simulated_replicas"], 1)
            if global_batch % replicas:
                raise ValueError(
                    f"{name}: a global batch of {global_batch} ({key}) does not split over"
                    f" {replicas} replicas. Fix: a {key} there that {replicas} divides after"
                    " scaling, or another replica count."
                )
            out[key] = global_batch // replicas
    for key in ("simulated_replicas", "replicas"):
        if key in out:
            out[key] = replicas
    if "model_axis" in out:  # the chips one model copy spans: as many as the file's that fit
        out["model_axis"] = math.gcd(int(out["model_axis"]), replicas)
        groups = replicas // out["model_axis"]
        if out.get("rows_per_batch", groups) % groups:
            raise ValueError(
                f"{name}: rows_per_batch {out['rows_per_batch']} does not split over the"
                f" {groups} copies of the model that {replicas} replicas make. Fix: a"
                f" rows_per_batch there that {groups} divides, or another replica count."
            )
    return out


def parameter_overrides(items: list[str]) -> dict:
    """``--set NAME=VALUE`` items as parameters, each value read as YAML (``8``, ``false``),
    a relative path made absolute (``from_here``)."""
    overrides = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not equals or not name.isidentifier():
            raise ValueError(f"--set {item!r}: give NAME=VALUE, e.g. --set simulated_replicas=8.")
        overrides[name] = from_here(yaml.safe_load(value))
    return overrides


def from_here(value):
    """``value`` as an absolute path when it is a relative path from where the command runs:
    it starts with ``./`` or ``../`` (``./runs/a``), or it has a ``/`` and exists here
    (``build/fixtures/tiny-bert``; an ``org/name`` that does not is a hub name). A notebook
    runs in its output folder, and would read a relative path from there."""
    if not isinstance(value, str) or "://" in value or Path(value).is_absolute():
        return value
    if value.startswith(("./", "../")) or ("/" in value and Path(value).exists()):
        return str(Path(value).resolve())
    return value


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
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="a prefix of the runs' names (01, 01_text_classification_fit.pairs)",
    )
    parser.add_argument(
        "--exercises", action="store_true", help="the exercise edition (the track's exercises/)"
    )
    parser.add_argument(
        "--no-variants", action="store_true", help="only <stem>.yaml, not <stem>.<variant>.yaml"
    )
    parser.add_argument(
        "--none-ok",
        action="store_true",
        help="a run of nothing is no error (tools/run.sh --seeds --only 10: no seeds' notebook)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run every notebook on this many simulated replicas, with the global batch its"
        " parameter file gives (the per-replica batch scaled to keep it)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter for every run, over its CPU parameters (a YAML value:"
        " --set simulated_replicas=8 --set mixed_bfloat16=true)",
    )
    parser.add_argument(
        "--engine",
        choices=("tf", "keras3"),
        default=None,
        help="the notebooks of this engine (default: the one this environment favours)",
    )
    parser.add_argument(
        "--report-all",
        action="store_true",
        help="report every executed notebook in the output folder, not only this run's",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(os.cpu_count() or 1, 4),
        help="notebooks executed at a time (default: one per core, at most 4)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more notebooks to execute at a time.")
    try:
        overrides = parameter_overrides(args.set)
        if args.replicas is not None:
            check_replicas(args.replicas)
    except ValueError as error:
        parser.error(str(error))

    def parameters_of(params_file: Path) -> dict:
        parameters = notebook_parameters(params_file, build, out / "outputs")
        if args.replicas is not None:
            parameters = at_replicas(parameters, args.replicas, params_file.name)
        return {**parameters, **overrides}

    from report import build_report

    import tpu_helpers  # noqa: F401  (environment flags)
    from tpu_helpers.runtime import choose_engine, detect_runtime
    from tpu_helpers.teaching.fixtures import build_fixtures

    engine = args.engine or choose_engine(detect_runtime()).engine

    build = Path(args.build).resolve()
    top = Path(args.out).resolve() if args.out else build / "notebooks"
    out = top / "tf" if engine == "tf" else top  # the seeds' track beside the main one
    out.mkdir(parents=True, exist_ok=True)
    build_fixtures(build / "fixtures")

    source = FOLDERS[engine] / "exercises" if args.exercises else FOLDERS[engine]
    notebooks = [nb for nb in sorted(source.glob(tracks.PATTERN)) if engine_of(nb) == engine]
    if not args.prepare_only:  # a fresh run: nothing resumes an earlier run's checkpoints
        for nb in notebooks:  # (what other engines' notebooks wrote stays)
            for old in (out / "outputs").glob(f"{nb.name[:2]}_*"):
                shutil.rmtree(old, ignore_errors=True)
    runs = [(nb, name, params) for nb in notebooks for name, params in runs_of(nb)]
    if not args.prepare_only:  # executed copies of notebooks that no longer exist here
        drop_stale_runs(out, {name for _, name, _ in runs})
    if args.only:  # a prefix of a run's name: "01" is notebook 01 and its variants
        runs = [run for run in runs if any(run[1].startswith(o) for o in args.only)]
    if args.no_variants:  # a variant named in full by --only still runs
        runs = [run for run in runs if run[1] == run[0].stem or run[1] in (args.only or [])]
    if not runs:  # a misnamed --only must not pass as a run of nothing
        message = f"no {engine}-engine notebook matches {args.only or 'the notebooks'}"
        if not args.none_ok:
            raise SystemExit(message)
        print(message)
        return 0
    jobs = 1 if args.prepare_only else max(1, min(args.jobs, len(runs)))
    calls = [
        dict(
            notebook=str(nb),
            target=str(out / f"{name}.ipynb"),
            parameters=parameters_of(params_file),
            prepare_only=args.prepare_only,
            cwd=str(out),
        )
        for nb, name, params_file in runs
    ]
    start = time.time()
    errors = run_all(calls, jobs)
    executed = [Path(call["target"]) for call in calls]
    failed = [path.name for path, error in zip(executed, errors, strict=True) if error]
    if not args.prepare_only:
        print(f"all {len(runs)} runs: {time.time() - start:.0f} s, {jobs} at a time", flush=True)
        reported = tracks.executed(top) if args.report_all else executed
        summaries = build_report(
            reported,
            build / "report",
            title="Notebooks on CPU (offline)",
            names=[path.relative_to(top).as_posix() for path in reported],
        )
        for s in summaries:
            print(
                f"  {s['name']}: {s['status']}, "
                + ", ".join(f"{k}={v}" for k, v in s["metrics"].items())
            )
        print(f"report: {build / 'report' / 'report.html'}")
    return 1 if failed else 0


def drop_stale_runs(out: Path, names: set[str]) -> list[str]:
    """Remove from ``out`` (one engine's folder of executed notebooks) the executed copies,
    HTML pages and kernel logs of runs not in ``names`` (a notebook renamed, moved to the
    other track, or removed), so that the report shows only notebooks that exist."""
    removed = []
    for path in sorted(out.glob(tracks.PATTERN)):
        stem = path.name.removesuffix(".ipynb")
        if stem not in names:
            for stale in (path, out / f"{stem}.html", out / f"{stem}.kernel.log"):
                stale.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def run_all(calls: list[dict], jobs: int) -> list[str | None]:
    """Execute the notebooks of ``calls`` (``execute``'s arguments), ``jobs`` at a time, and
    print a line per run as it ends; per call, in the order of ``calls``, what failed (None
    for a run that went through)."""
    errors: list[str | None] = [None] * len(calls)

    def say(done: int, index: int, seconds: float) -> None:
        status = errors[index] or ("prepared" if calls[index]["prepare_only"] else "ok")
        name = Path(calls[index]["target"]).name
        print(f"[{done}/{len(calls)}] {name}: {status} in {seconds:.1f} s", flush=True)

    if jobs == 1:  # in this process, with a progress line per notebook
        console = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        for index, call in enumerate(calls):
            label = f"[{index + 1}/{len(calls)}] {Path(call['target']).name}"
            bar = None if call["prepare_only"] else (label, console)
            errors[index], seconds = execute(**call, progress=bar)
            say(index + 1, index, seconds)
        return errors
    # "spawn": a worker starts as a fresh interpreter, not a copy of this one (which, in the
    # CPU stack, has imported TensorFlow to build the fixtures, and so holds threads a fork
    # would break)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        pending = {pool.submit(execute, **call): index for index, call in enumerate(calls)}
        for done, future in enumerate(as_completed(pending), 1):
            errors[pending[future]], seconds = future.result()
            say(done, pending[future], seconds)
    return errors


def execute(
    notebook, target, parameters, prepare_only, cwd, progress=None
) -> tuple[str | None, float]:
    """Execute (or with ``prepare_only``, only parametrize) one notebook into ``target``,
    the kernel's standard error into ``<target stem>.kernel.log``. ``progress``: ``(label,
    stream)`` for a progress line, or None. ``(what failed or None, seconds)``."""
    import papermill

    start = time.time()
    target = Path(target)
    bar = progress and {
        "desc": progress[0],
        "file": progress[1],
        "bar_format": "{desc}: {n_fmt}/{total_fmt} cells, {elapsed}",
        "mininterval": 2.0,
        "dynamic_ncols": False,
        "leave": False,
    }
    started = 0
    while True:
        try:
            with stderr_to(target.with_suffix(".kernel.log")):
                papermill.execute_notebook(
                    notebook,
                    str(target),
                    parameters=parameters,
                    prepare_only=prepare_only,
                    kernel_name="python3",
                    cwd=cwd,
                    progress_bar=bar or False,
                    log_output=False,
                )
        except papermill.PapermillExecutionError as err:
            failure = f"FAILED ({err.ename}: {err.evalue}; kernel log: {target.stem}.kernel.log)"
            return failure, time.time() - start
        except RuntimeError as err:
            # The kernel died before it answered: no cell ran (kernels started at the same
            # moment can pick the same port), so it is started again, twice at most.
            started += 1
            if "before replying to kernel_info" not in str(err) or started == 3:
                raise
            continue
        return None, time.time() - start


if __name__ == "__main__":
    sys.exit(main())
