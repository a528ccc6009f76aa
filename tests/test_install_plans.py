"""Every install plan must be installable: pip resolves each one against the package index
for the runtime's own Python version and platform (a dry run; nothing is installed).

Needs the package index; skipped with a message when it cannot be reached.
"""

import re
import shlex
import subprocess
import sys

import pytest

from tpu_helpers.runtime import RuntimeFacts, install_commands

#: manylinux tags of an x86-64 Colab / Kaggle machine (Ubuntu 22.04, glibc 2.35). pip matches
#: --platform tags exactly, so the older ones a wheel may carry are listed too.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]

COLAB_IMAGE = {"transformers": "5.2.0", "datasets": "5.2.0", "huggingface-hub": "1.31.0"}

# (runtime, its Python, its facts): the runtimes the notebooks name, as they ship today.
RUNTIMES = [
    ("colab-tpu", "3.13", RuntimeFacts("colab", "tpu", "v5litepod-1", COLAB_IMAGE)),
    (
        "kaggle-tpu",
        "3.11",
        RuntimeFacts(
            "kaggle",
            "tpu",
            "v5litepod-8",
            {"tensorflow-cpu": "2.18.0", "tf-keras": "2.18.0", **COLAB_IMAGE},
        ),
    ),
    (
        "tpu-build-with-jax-libtpu",
        "3.12",
        RuntimeFacts(
            "colab",
            "tpu",
            None,
            {"tensorflow-tpu": "2.20.0", "libtpu": "0.0.52", "tf-keras": "2.20.1"},
        ),
    ),
    ("colab-gpu", "3.12", RuntimeFacts("colab", "gpu", None, COLAB_IMAGE)),
    (
        "kaggle-gpu",
        "3.11",
        RuntimeFacts("kaggle", "gpu", None, {"tensorflow": "2.18.0", **COLAB_IMAGE}),
    ),
]

pytestmark = pytest.mark.package_index

UNREACHABLE = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution"
    r"|Could not fetch URL|Network is unreachable|ConnectTimeout"
)


def resolutions(plan: list[str]) -> list[tuple[list[str], bool]]:
    """Requirements to resolve together: every install that takes dependencies in one set
    (so commands that disagree with each other fail), each ``--no-deps`` one on its own."""
    together, alone = [], []
    for command in plan:
        words = shlex.split(command)
        if words[:2] != ["pip", "install"]:
            continue  # pip uninstall
        reqs = [w for w in words[2:] if not w.startswith("-")]
        if "--no-deps" in words:
            alone.append((reqs, True))
        else:
            together += reqs
    return ([(together, False)] if together else []) + alone


def dry_run(requirements: list[str], python: str, no_deps: bool) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
    argv += ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in PLATFORMS:
        argv += ["--platform", tag]
    argv += ["--no-deps"] if no_deps else []
    # Resolve against the index alone: a local cap (a constraints file in the pip config)
    # would test this machine, not the runtime.
    env_argv = ["env", "PIP_CONSTRAINT=", "PIP_FIND_LINKS="]
    return subprocess.run(
        env_argv + argv + requirements, capture_output=True, text=True, timeout=600
    )


#: (requirements, Python, no deps) of the plan the old Kaggle notebooks installed, which
#: cannot be: tensorflow-tpu 2.18 needs a libtpu==2.18.0 that the package index lacks.
UNINSTALLABLE = (["tensorflow-tpu==2.18.0"], "3.11", False)

_started: dict = {}


def start_dry_runs() -> dict:
    """Every dry run of every plan (and of ``UNINSTALLABLE``), started in the background
    side by side, once: ``{key: (requirements, future)}``. Together they take a minute or
    two, much of it on the index, so ``conftest`` starts them when the tests are collected
    and the tests before these run meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    if not _started:
        jobs = {
            (name, i): (reqs, python, no_deps)
            for name, python, facts in RUNTIMES
            for i, (reqs, no_deps) in enumerate(resolutions(install_commands(facts)))
        }
        jobs[("uninstallable", 0)] = UNINSTALLABLE
        pool = ThreadPoolExecutor(max_workers=4)
        _started.update({key: (job[0], pool.submit(dry_run, *job)) for key, job in jobs.items()})
        pool.shutdown(wait=False)
    return _started


@pytest.fixture(scope="module")
def resolved():
    """``{key: (requirements, finished dry run)}`` of ``start_dry_runs``."""
    return {key: (reqs, future.result()) for key, (reqs, future) in start_dry_runs().items()}


@pytest.mark.parametrize("name, python, facts", RUNTIMES, ids=[r[0] for r in RUNTIMES])
def test_plan_resolves_on_the_package_index(name, python, facts, resolved):
    plan = install_commands(facts)
    assert plan, f"{name}: expected something to install"
    runs = [value for (runtime, _), value in sorted(resolved.items()) if runtime == name]
    assert len(runs) == len(resolutions(plan))
    for requirements, result in runs:
        output = result.stdout + result.stderr
        if result.returncode != 0 and UNREACHABLE.search(output):
            pytest.skip(f"the package index cannot be reached from here: {output[-300:]}")
        assert result.returncode == 0, (
            f"{name} (Python {python}): pip cannot install {requirements}:\n{output[-3000:]}"
        )


def test_resolutions_keep_no_deps_installs_apart():
    plan = [
        "pip uninstall -y tensorflow-cpu",
        "pip install -q tensorflow-tpu==2.20.0 libtpu==0.0.20",
        "pip install -q --no-deps 'tf-keras~=2.20.0'",
        "pip install -q transformers==4.57.6",
    ]
    assert resolutions(plan) == [
        (["tensorflow-tpu==2.20.0", "libtpu==0.0.20", "transformers==4.57.6"], False),
        (["tf-keras~=2.20.0"], True),
    ]


def test_a_plan_that_cannot_be_installed_fails_the_dry_run(resolved):
    # This is the failure the tests above guard against.
    _, result = resolved[("uninstallable", 0)]
    output = result.stdout + result.stderr
    if result.returncode != 0 and UNREACHABLE.search(output):
        pytest.skip("the package index cannot be reached from here")
    assert result.returncode != 0 and "libtpu" in output, output[-2000:]
