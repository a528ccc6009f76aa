import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tpu_helpers  # noqa: F401  (sets TF_USE_LEGACY_KERAS before any test imports TF)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The offline fixtures, built once into build/fixtures (shared with the notebook run),
    with the TF engine's numbers (``engines``) that the Keras 3 engine's tests compare with."""
    from tpu_helpers.teaching.fixtures import build_fixtures

    folder = ROOT / "build" / "fixtures"
    build_fixtures(folder, verbose=False)
    if not (folder / "engines").is_dir():
        pytest.fail(
            f"{folder} has the notebooks' fixtures but not the TF engine's reference numbers"
            " (engines/), which only a stack with transformers' TF classes writes. Fix: STACK=cpu"
            " bash -c 'source tools/env.sh && python -m tpu_helpers fixtures build/fixtures',"
            " then run the tests again (bash tools/test.sh does both)."
        )
    return folder


def run_python(
    code: str, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: device set-up is once per process in TensorFlow."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )


def numpy_batches(dataset) -> list:
    """The elements ``(features, labels, weights)`` of a dataset, as numpy arrays."""
    return [
        ({k: v.numpy() for k, v in f.items()}, labels.numpy(), w.numpy())
        for f, labels, w in dataset
    ]


def assert_same_batches(got: list, want: list) -> None:
    """Two lists of ``numpy_batches`` are equal, batch by batch and feature by feature."""
    import numpy as np

    assert len(got) == len(want)
    for (gf, gl, gw), (wf, wl, ww) in zip(got, want, strict=True):
        assert set(gf) == set(wf)
        for name in wf:
            np.testing.assert_array_equal(gf[name], wf[name])
        np.testing.assert_array_equal(gl, wl)
        np.testing.assert_array_equal(gw, ww)


def pytest_collection_finish(session):
    """Start the install-plan dry runs (a minute or two, much of it on the package index) as
    soon as the tests are chosen, when a test that reads them is, so the tests before them
    run meanwhile."""
    for item in session.items:
        if "resolved" in getattr(item, "fixturenames", ()):
            item.module.start_dry_runs()
            return


@pytest.fixture
def cola_with_row_5(fixtures_dir):
    """``(checkpoint, batches, cases)``: the tiny DistilBERT, ``batches(label=, token=)``
    making CoLA-like text batches with row 5's label or second token id replaced, and the
    two out-of-range cases with the message each engine must give (the same on both)."""
    import json

    from datasets import Value

    from tpu_helpers.data import hub, text

    checkpoint = fixtures_dir / "tiny-distilbert"
    data = text.load_text_dataset(str(fixtures_dir / "cola"))
    tokenizer = hub.load_tokenizer(str(checkpoint))
    tokenized = text.tokenize(data["train"].select(range(64)), tokenizer, 64)
    tokenized = tokenized.cast_column("label", Value("int64"))

    def batches(label=None, token=None):
        def change(row, i):
            if i != 5:
                return {}
            if label is not None:
                return {"label": label}
            return {"input_ids": [row["input_ids"][0], token, *row["input_ids"][2:]]}

        rows = tokenized.map(change, with_indices=True)
        return text.text_batches(rows, global_batch=16, boundaries=[32, 64], seed=0)

    vocabulary = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    cases = [
        ({"label": 2}, r"class label 2, but the model has 2 outputs.*Fix: .*num_labels=3"),
        (
            {"token": vocabulary + 7},
            rf"token id {vocabulary + 7}, but the distilbert model embeds {vocabulary}.*Fix",
        ),
    ]
    return checkpoint, batches, cases


@pytest.fixture
def broken_checkpoints(fixtures_dir, tmp_path):
    """Copies of the tiny DistilBERT as an interrupted download leaves them:
    ``{"truncated": folder, "missing shard": folder}`` (the hub's layouts, one file and
    shards with an index)."""
    import shutil

    from safetensors.numpy import load_file

    from tpu_helpers.data import hub

    source = fixtures_dir / "tiny-distilbert"
    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    sharded = tmp_path / "missing-shard"
    shutil.copytree(source, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    written = hub.write_hub_weights(tensors, str(sharded), max_shard_bytes=40_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists(), written
    shards[1].unlink()
    return {"truncated": truncated, "missing shard": sharded}


@pytest.fixture
def two_checkpoints(fixtures_dir, tmp_path):
    """``(same, other)``: copies of the tiny DistilBERT at other paths, the first equal to
    it, the second with the same shapes and other values (another fine-tuning of it)."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    source = fixtures_dir / "tiny-distilbert"
    same, other = tmp_path / "same-checkpoint", tmp_path / "other-checkpoint"
    shutil.copytree(source, same)
    shutil.copytree(source, other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors = {
        k: (v * np.float32(1.01) if v.dtype == np.float32 else v) for k, v in tensors.items()
    }
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    return same, other


class CompileLog(logging.Handler):
    """JAX's own log of what it compiles (``jax_log_compiles``), while in a ``with``."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.compiled = []

    def emit(self, record):
        found = re.search(r"Finished XLA compilation of (\S+)", record.getMessage())
        if found:
            self.compiled.append(found.group(1))

    def steps(self) -> list:
        """The compiled programs that train or evaluate (not the small eager ops)."""
        return [name for name in self.compiled if re.search(r"train|test|step|_call", name)]

    def __enter__(self):
        import jax

        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc):
        import jax

        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(self)


# CPU time per test (this process's and its reaped children's: a notebook's kernel is
# counted at its last cell), summed per file at the end: what the legs, which share the
# machine's cores, cost each other (--durations gives wall time, which contention inflates).
_cpu_seconds: dict[str, float] = {}


def _cpu_now() -> float:
    import resource

    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_now()
    yield
    _cpu_seconds[item.nodeid] = _cpu_now() - before


def pytest_terminal_summary(terminalreporter):
    if sum(_cpu_seconds.values()) < 60:  # a few quick tests: nothing to choose from
        return
    files: dict[str, float] = {}
    for nodeid, seconds in _cpu_seconds.items():
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0.0) + seconds
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", f"CPU time: {sum(files.values()):.0f} s in all, by file")
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1]):
        write(f"{seconds:8.1f} s  {name}")
    terminalreporter.write_sep("=", "CPU time: the 20 costliest tests")
    for nodeid, seconds in sorted(_cpu_seconds.items(), key=lambda kv: -kv[1])[:20]:
        write(f"{seconds:8.1f} s  {nodeid}")
