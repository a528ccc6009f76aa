"""Where are we running, and what must be installed there?

Everything here is cheap: it reads environment variables, device files and installed
package metadata, and never imports TensorFlow. ``detect_runtime`` gathers the facts;
``install_commands`` turns facts into a plan (a pure function, unit-tested per runtime);
``install`` runs that plan, but only on Colab or Kaggle.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tpu_helpers.core.errors import InputError, InstallError
from tpu_helpers.core.families import KERAS3, KERAS3_OTHER_FAMILY_FIX
from tpu_helpers.core.messages import say
from tpu_helpers.core.versions import KERAS_HUB, KERAS_HUB_PIN, KERAS_MINORS, KERAS_REQUIREMENT
from tpu_helpers.runtime.env import distribution_version

__all__ = [
    "STACK",
    "TRANSFORMERS_PIN",
    "DATASETS_SPEC",
    "HUB_SPEC",
    "TENSORFLOW_PIN",
    "TENSORFLOW_TPU_PIN",
    "LIBTPU_PIN",
    "PROFILE_PLUGIN_PIN",
    "LIBTPU_KNOWN_GOOD",
    "TPU_OFFERS",
    "MAIN_TRACK",
    "RuntimeFacts",
    "minor",
    "release",
    "libtpu_loads",
    "detect_runtime",
    "install_commands",
    "pip_argv",
    "requirement_names",
    "install",
    "KERAS3_NEEDS",
    "ENGINES",
    "EngineChoice",
    "choose_engine",
    "keras3_install_commands",
    "KERAS3_KEEPS",
    "KERAS3_WHY",
    "installed",
    "install_changes",
    "unplanned_changes",
]

#: Distributions whose versions decide whether the stack works together.
STACK = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-tpu",
    "tf-keras",
    "keras",
    "transformers",
    "datasets",
    "huggingface-hub",
    "libtpu",
    "tensorboard",
    "tensorboard-plugin-profile",
    "jax",
    "jaxlib",
    "keras-hub",
)

TRANSFORMERS_PIN = "transformers==4.57.6"
DATASETS_SPEC = "datasets>=4,<5.1"
HUB_SPEC = "huggingface-hub<1.0"
TENSORFLOW_PIN = "tensorflow==2.21.0"
#: The TensorFlow build for TPUs. 2.20.0 is the newest ``tensorflow-tpu`` on the package
#: index (there is none for 2.21), with wheels for Python 3.9-3.13. Every TPU runtime gets
#: this one release, whatever TensorFlow it had: older ones ask for a ``libtpu`` that is
#: not on the package index (``tensorflow-tpu`` 2.18 wants ``libtpu==2.18.0``).
TENSORFLOW_TPU_PIN = "tensorflow-tpu==2.20.0"
#: ``tensorflow-tpu`` 2.20.0 asks only for ``libtpu~=0.0.14``, so pip takes the newest
#: libtpu, and from 0.0.32 on libtpu no longer carries the TensorFlow entry points: the
#: process aborts on ``import tensorflow`` ("ConfigureDistributedTpuOp_DoWork not
#: available in this library"). 0.0.20 is the libtpu that was current when the 2.20.0
#: wheels were built (wheel files dated 2025-08-07; libtpu 0.0.20 was published on
#: 2025-08-01, 0.0.21 on 2025-08-15). Checked on CPU, without TPU hardware: 0.0.14 to
#: 0.0.31 load, 0.0.32 to 0.0.52 abort.
LIBTPU_PIN = "libtpu==0.0.20"
#: TensorBoard's profile tab (``observe.capture_profile`` writes what it reads).
PROFILE_PLUGIN_PIN = "tensorboard-plugin-profile==2.24.2"
#: libtpu releases that load with ``tensorflow-tpu`` 2.20 (first and last, inclusive).
LIBTPU_KNOWN_GOOD = ((0, 0, 14), (0, 0, 31))

#: KerasHub (``versions.KERAS_HUB_PIN``) is installed ``--no-deps``: it asks for
#: ``tensorflow-text``, which asks for the ``tensorflow`` distribution and so would replace
#: a runtime's ``tensorflow-cpu``; the engine never uses tensorflow-text (the checkpoint's
#: own tokenizer tokenizes).
#: What the Keras 3 engine imports besides the runtime's JAX: Keras 3 of KerasHub's
#: version, KerasHub's own requirements but tensorflow-text, ``tokenizers`` and
#: transformers 5 for the checkpoint's tokenizer, and TensorFlow (any build, CPU is
#: enough) for ``tf.data`` and TensorBoard's summaries.
KERAS3_NEEDS = {
    "keras": KERAS_REQUIREMENT,
    "absl-py": "absl-py",
    "regex": "regex",
    "rich": "rich",
    "kagglehub": "kagglehub",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "sentencepiece": "sentencepiece",
    "transformers": "transformers>=5,<6",
    "tensorflow": "tensorflow-cpu==2.20.0",
}
#: Why the Keras 3 engine's plan installs each thing, as the install cell says before it
#: runs anything.
KERAS3_WHY = {
    "keras": f"KerasHub {KERAS_HUB.rsplit('.', 1)[0]} asks Keras >= {KERAS_MINORS[0]}",
    "keras-hub": "loads the hub's checkpoints into Keras 3 (--no-deps: its tensorflow-text"
    " would bring the full TensorFlow)",
    "tensorflow-cpu": "tf.data and TensorBoard summaries; the CPU build leaves the TPU to JAX",
    "transformers": "the checkpoint's tokenizer (transformers 5)",
    "jax": "the runtime has no JAX",
}
#: What the Keras 3 engine's plan leaves as the runtime has it: JAX and libtpu were built
#: for each other and for the runtime's TPU, numpy, protobuf and h5py with them.
KERAS3_KEEPS = ("jax", "jaxlib", "libtpu", "numpy", "protobuf", "h5py")
#: The two engines: TensorFlow with tf-keras and transformers 4's TF classes (the seeds'
#: track, notebooks/tf/), and Keras 3 on JAX with KerasHub (the main track, notebooks/).
ENGINES = ("tf", "keras3")

#: The TPUs each hosted runtime offers, as its menu names them (checked 2025-09). Notebook
#: 00 and docs/teaching.md quote these words, and every page that names Kaggle's chip must
#: name this one (tests/test_notebooks_static.py). Colab's free tier is one v5e chip.
#: Where errors send a learner whose TPU TensorFlow cannot drive: the main track: the same lessons on Keras 3 and the JAX a TPU runtime ships.
MAIN_TRACK = (
    "the main track, notebooks/NN_*.ipynb of the same lesson number (setup:"
    " notebooks/00_setup_and_connect.ipynb) at https://github.com/tpu-transformers/"
    "tpu-transformers-notebooks, on Keras 3 and the runtime's own JAX"
)

TPU_OFFERS = {
    "Colab": "v5e-1 (free tier, 1 replica), v6e-1, v2-8 where still offered",
    "Kaggle": "TPU v5e-8 (8 replicas)",
}

_ENV_KEYS = (
    "COLAB_RELEASE_TAG",
    "COLAB_GPU",
    "COLAB_TPU_ADDR",
    "KAGGLE_KERNEL_RUN_TYPE",
    "KAGGLE_URL_BASE",
    "TPU_NAME",
    "TPU_ACCELERATOR_TYPE",
    "TF_USE_LEGACY_KERAS",
    "FORCE_TF_AVAILABLE",
)


@dataclass(frozen=True)
class RuntimeFacts:
    """What ``detect_runtime`` found.

    Attributes:
        platform: ``"colab"``, ``"kaggle"``, ``"tpu-vm"`` (a TPU VM you manage) or ``"local"``.
        accelerator: ``"tpu"``, ``"gpu"`` or ``"cpu"``.
        tpu_type: the accelerator type when the runtime says it (``"v2-8"``), else ``None``.
        distributions: installed version of each name in ``STACK`` (``None`` if absent).
        env: the environment variables that mattered.
    """

    platform: str = "local"
    accelerator: str = "cpu"
    tpu_type: str | None = None
    distributions: Mapping[str, str | None] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def hosted(self) -> bool:
        """True on Colab and Kaggle, the runtimes where notebooks may install packages."""
        return self.platform in ("colab", "kaggle")

    @property
    def tensorflow_build(self) -> str | None:
        """The TensorFlow distribution installed (``tensorflow-tpu`` wins over the others)."""
        for name in ("tensorflow-tpu", "tensorflow", "tensorflow-cpu"):
            if self.distributions.get(name):
                return name
        return None

    @property
    def tensorflow_version(self) -> str | None:
        build = self.tensorflow_build
        return self.distributions.get(build) if build else None


def minor(version: str | None) -> tuple[int, int] | None:
    """``"2.20.1" -> (2, 20)``; ``None`` stays ``None``.

    >>> minor("2.21.0rc1")
    (2, 21)
    """
    if not version:
        return None
    numbers = re.findall(r"\d+", version)
    if len(numbers) < 2:
        return None
    return int(numbers[0]), int(numbers[1])


def release(version: str | None) -> tuple[int, ...] | None:
    """All the numbers of a release: ``"0.0.21.1" -> (0, 0, 21, 1)``.

    >>> release("0.0.32") > (0, 0, 31)
    True
    """
    if not version:
        return None
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in found.group(0).split(".")) if found else None


def libtpu_loads(version: str | None) -> bool:
    """True when ``version`` of libtpu is in the range known to load with tensorflow-tpu 2.20."""
    have = release(version)
    first, last = LIBTPU_KNOWN_GOOD
    return have is not None and first <= have[:3] <= last


def detect_runtime(
    environ: Mapping[str, str] | None = None,
    path_exists: Callable[[str], bool] = os.path.exists,
    modules: Mapping[str, object] | None = None,
    versions: Mapping[str, str | None] | None = None,
) -> RuntimeFacts:
    """Detect the platform and accelerator without importing TensorFlow.

    All inputs default to the real process; tests pass their own.

    >>> facts = detect_runtime(environ={"KAGGLE_KERNEL_RUN_TYPE": "Interactive",
    ...     "TPU_ACCELERATOR_TYPE": "v3-8"}, path_exists=lambda p: False, modules={},
    ...     versions={})
    >>> facts.platform, facts.accelerator, facts.tpu_type
    ('kaggle', 'tpu', 'v3-8')
    """
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    names = dict.fromkeys([*STACK, *KERAS3_NEEDS])
    if versions is None:
        versions = {name: distribution_version(name) for name in names}
    dists = {name: versions.get(name) for name in names}

    on_colab = "google.colab" in mods or "COLAB_RELEASE_TAG" in env
    on_kaggle = "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env
    tpu_signal = (
        any(env.get(k) for k in ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR"))
        or path_exists("/dev/accel0")
        or (bool(dists.get("libtpu")) and path_exists("/dev/vfio/0"))
    )
    gpu_signal = path_exists("/dev/nvidia0") or env.get("COLAB_GPU") == "1"

    accelerator = "tpu" if tpu_signal else "gpu" if gpu_signal else "cpu"
    if on_colab:
        platform = "colab"
    elif on_kaggle:
        platform = "kaggle"
    elif accelerator == "tpu":
        platform = "tpu-vm"
    else:
        platform = "local"
    return RuntimeFacts(
        platform=platform,
        accelerator=accelerator,
        tpu_type=env.get("TPU_ACCELERATOR_TYPE") or None,
        distributions=dists,
        env={k: env[k] for k in _ENV_KEYS if k in env},
    )


@dataclass(frozen=True)
class EngineChoice:
    """The engine that trains here (one of ``ENGINES``) and why, in one line."""

    engine: str
    reason: str

    def __str__(self) -> str:
        return f"{self.engine} engine: {self.reason}"


def choose_engine(facts: RuntimeFacts, model_type: str | None = None) -> EngineChoice:
    """Which engine this runtime (and, given its ``model_type``, this checkpoint) trains on.

    A TPU runtime that ships JAX and no ``tensorflow-tpu`` (Colab's and Kaggle's TPU images
    since 2025) runs the Keras 3 engine on that JAX and its libtpu, which nothing replaces;
    so does a machine with Keras 3, JAX and transformers 5 (which has no TF classes, so the
    TF engine cannot run there, tf-keras or not). Everything else runs the TF engine. A
    family the Keras 3 engine does not train (``families.KERAS3``) goes to the TF engine
    where the runtime runs it; elsewhere the choice stays, its reason the fix that works on
    this runtime.

    >>> facts = RuntimeFacts("kaggle", "tpu", distributions={"jax": "0.7.2",
    ...     "libtpu": "0.0.21", "keras": "3.11.3", "tensorflow-cpu": "2.20.0"})
    >>> choose_engine(facts).engine, choose_engine(facts, "mpnet").engine
    ('keras3', 'keras3')
    >>> choose_engine(RuntimeFacts("local", "cpu"), "mpnet").engine
    'tf'
    """
    choice = _engine_of_runtime(facts)
    if model_type is None or model_type in KERAS3:
        return choice
    if choice.engine == "tf":
        return EngineChoice(
            "tf",
            f"{choice.reason}; the Keras 3 engine trains {', '.join(KERAS3)}, not"
            f" {model_type!r}, which the TF engine trains (the notebooks of notebooks/tf/)",
        )
    return EngineChoice(  # the TF engine cannot run here: the fix must work on this runtime
        "keras3",
        f"{choice.reason}; it trains {', '.join(KERAS3)}, not {model_type!r}."
        f" Fix: {KERAS3_OTHER_FAMILY_FIX}",
    )


def _engine_of_runtime(facts: RuntimeFacts) -> EngineChoice:
    """The engine this runtime's packages favour, whatever the checkpoint."""
    d = facts.distributions
    keras = minor(d.get("keras"))
    jax, tf_tpu = d.get("jax"), d.get("tensorflow-tpu")
    if facts.accelerator == "tpu" and jax and not tf_tpu:
        return EngineChoice(
            "keras3",
            f"this TPU runtime ships JAX {jax} (libtpu {d.get('libtpu') or 'from JAX'}) and no"
            " tensorflow-tpu; the Keras 3 engine keeps both",
        )
    transformers = minor(d.get("transformers"))
    if jax and keras and keras >= (3, 0) and transformers and transformers >= (5, 0):
        return EngineChoice(
            "keras3",
            f"Keras {d['keras']}, JAX {jax} and transformers {d['transformers']} are"
            " installed, and transformers 5 has no TF classes",
        )
    if facts.accelerator == "tpu" and tf_tpu:
        return EngineChoice("tf", f"{TENSORFLOW_TPU_PIN.split('==')[0]} {tf_tpu} is installed")
    return EngineChoice(
        "tf", "TensorFlow with tf-keras and transformers 4 (no JAX with Keras 3 and transformers 5)"
    )


def keras3_install_commands(facts: RuntimeFacts) -> list[str]:
    """What the Keras 3 engine lacks on ``facts``' runtime: KerasHub (without its
    tensorflow-text requirement) and whatever of ``KERAS3_NEEDS`` is missing or too old.
    The runtime's JAX and libtpu are never touched; with no JAX at all, the CPU one.

    >>> have = {n: "9" for n in KERAS3_NEEDS} | {"jax": "0.7.2", "keras": "3.15.1",
    ...     "transformers": "5.2.0", "tensorflow-cpu": "2.20.0"}
    >>> keras3_install_commands(RuntimeFacts("kaggle", "tpu", distributions=have))
    ['pip install -q --no-deps keras-hub==0.32.0']
    >>> keras3_install_commands(RuntimeFacts("kaggle", "tpu", distributions=have | {
    ...     "keras-hub": "0.32.0"}))
    []
    """
    if facts.platform == "local" and facts.accelerator != "tpu":
        return []
    d = facts.distributions
    wanted = []
    for name, spec in KERAS3_NEEDS.items():
        have = d.get(name)
        if name == "tensorflow":
            have = facts.tensorflow_version
        elif name == "keras" and have and minor(have) < minor(KERAS_MINORS[0]):
            have = None
        elif name == "transformers" and have and minor(have) < (5, 0):
            have = None
        if not have:
            wanted.append(shlex.quote(spec))
    commands = []
    if not d.get("jax"):
        commands.append(
            "pip install -q 'jax[tpu]'" if facts.accelerator == "tpu" else "pip install -q jax"
        )
    if wanted:
        commands.append("pip install -q " + " ".join(wanted))
    if d.get("keras-hub") != KERAS_HUB_PIN.split("==")[1]:
        commands.append(f"pip install -q --no-deps {KERAS_HUB_PIN}")
    return commands


def install_commands(facts: RuntimeFacts) -> list[str]:
    """The shell commands that make ``facts``' runtime able to run these notebooks.

    A plain machine gets nothing: it installs ``requirements.txt`` itself. Colab, Kaggle
    and TPU VMs get what they lack: a TensorFlow build for the accelerator, a tf-keras of
    TensorFlow's minor version (installed ``--no-deps`` so it never replaces a special TF
    build), transformers < 5 and a datasets / huggingface-hub pair that agree, and
    TensorBoard with its profile plugin.

    >>> install_commands(RuntimeFacts(platform="local"))
    []
    """
    if facts.platform == "local":
        return []
    commands, tf_version = _tensorflow_commands(facts)
    tf_minor = minor(tf_version)
    dists = facts.distributions
    if tf_minor and minor(dists.get("tf-keras")) != tf_minor:
        spec = f"tf-keras~={tf_minor[0]}.{tf_minor[1]}.0"
        commands.append(f"{_PIP} --no-deps {shlex.quote(spec)}")
    # transformers 4 and the datasets / huggingface-hub pair in one command: installed one
    # after the other, each step would leave the other's requirement broken for a moment.
    hugging_face = []
    transformers = minor(dists.get("transformers"))
    if transformers is None or transformers[0] >= 5:
        hugging_face.append(TRANSFORMERS_PIN)
    datasets, hub = minor(dists.get("datasets")), minor(dists.get("huggingface-hub"))
    if datasets is None or datasets >= (5, 1) or datasets < (4, 0) or (hub and hub[0] >= 1):
        hugging_face += [shlex.quote(DATASETS_SPEC), shlex.quote(HUB_SPEC)]
    if hugging_face:
        commands.append(f"{_PIP} {' '.join(hugging_face)}")
    # TensorBoard (tf.summary needs it to write logs) of TensorFlow's minor version, and
    # its profile plugin, where the runtime lacks them
    board = []
    if tf_minor and not dists.get("tensorboard"):
        board.append(shlex.quote(f"tensorboard~={tf_minor[0]}.{tf_minor[1]}.0"))
    if not dists.get("tensorboard-plugin-profile"):
        board.append(PROFILE_PLUGIN_PIN)
    if board:
        commands.append(f"{_PIP} {' '.join(board)}")
    return commands


_PIP = "pip install -q"


def _tensorflow_commands(facts: RuntimeFacts) -> tuple[list[str], str | None]:
    """The commands that give ``facts``' runtime the TensorFlow build for its accelerator,
    and the TensorFlow version it then has (``None``: none is planned or there)."""
    dists, commands = facts.distributions, []
    tf_version = facts.tensorflow_version
    if facts.accelerator == "tpu" and facts.tensorflow_build != "tensorflow-tpu":
        others = [n for n in ("tensorflow", "tensorflow-cpu") if dists.get(n)]
        if others:
            commands.append("pip uninstall -y " + " ".join(others))
        commands.append(f"{_PIP} {TENSORFLOW_TPU_PIN} {LIBTPU_PIN}")
        tf_version = TENSORFLOW_TPU_PIN.split("==")[1]
    elif facts.tensorflow_build == "tensorflow-tpu" and not libtpu_loads(dists.get("libtpu")):
        # a libtpu that aborts the import (one installed for JAX, say): pip keeps it unless
        # asked for this exact release
        commands.append(f"{_PIP} {LIBTPU_PIN}")
    elif tf_version is None:
        pin = TENSORFLOW_PIN
        if facts.accelerator == "gpu":
            pin = pin.replace("tensorflow", "tensorflow[and-cuda]", 1)
        commands.append(f"{_PIP} {shlex.quote(pin)}")
        tf_version = pin.split("==")[1]
    return commands, tf_version


#: The module each distribution of the stack is imported as.
_MODULES = {
    "tensorflow": "tensorflow",
    "tensorflow-cpu": "tensorflow",
    "tensorflow-tpu": "tensorflow",
    "tf-keras": "tf_keras",
    "keras": "keras",
    "transformers": "transformers",
    "datasets": "datasets",
    "huggingface-hub": "huggingface_hub",
    "libtpu": "tensorflow",  # loaded by TensorFlow's TPU build, never imported by name
    "tensorboard": "tensorboard",
    "tensorboard-plugin-profile": "tensorboard_plugin_profile",
    "keras-hub": "keras_hub",
    "jax": "jax",
}


def pip_argv(command: str, python: str | None = None) -> list[str]:
    """The argument list that runs a plan's ``pip ...`` command with ``python``'s own pip.

    A bare ``pip`` on a notebook's PATH may belong to another Python than the kernel's;
    ``python -m pip`` cannot.

    >>> pip_argv("pip install -q 'tf-keras~=2.20.0'", python="/usr/bin/python3")
    ['/usr/bin/python3', '-m', 'pip', 'install', '-q', 'tf-keras~=2.20.0']
    """
    argv = shlex.split(command)
    if not argv or argv[0] != "pip":
        raise InputError(f"not a pip command: {command!r}")
    return [python or sys.executable, "-m", "pip", *argv[1:]]


def requirement_names(command: str) -> list[str]:
    """Distribution names a ``pip install`` / ``pip uninstall`` command names.

    >>> requirement_names("pip install -q --no-deps 'tf-keras~=2.20.0' libtpu==0.0.20")
    ['tf-keras', 'libtpu']
    """
    names = []
    for word in shlex.split(command)[2:]:
        if word.startswith("-"):
            continue
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", word)
        if name:
            names.append(_normalized(name.group(0)))
    return names


def installed() -> dict[str, str]:
    """Every installed distribution's version, by normalized name."""
    from importlib import metadata

    names = ((d.metadata["Name"], d.version) for d in metadata.distributions())
    return {_normalized(name): version for name, version in names if name}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_changes(before: dict, after: dict) -> dict[str, tuple[str | None, str | None]]:
    """``{name: (version before, version after)}`` for each distribution added, removed or
    changed between two ``installed()`` readings.

    >>> install_changes({"keras": "3.13.2", "jax": "0.7.2"}, {"keras": "3.15.1",
    ...     "jax": "0.7.2", "keras-hub": "0.32.0"})
    {'keras': ('3.13.2', '3.15.1'), 'keras-hub': (None, '0.32.0')}
    """
    names = sorted(set(before) | set(after))
    return {n: (before.get(n), after.get(n)) for n in names if before.get(n) != after.get(n)}


_KEPT = "(the runtime keeps its own)"


def unplanned_changes(changes: dict, plan: list[str]) -> list[str]:
    """What a Keras 3 plan should not have done: change or remove one of ``KERAS3_KEEPS``,
    or change or remove a distribution the plan does not name (additions are the named
    packages' requirements). ``install`` refuses the first kind and says the second (pip
    may move a requirement of a package the plan names); the Colab test leg refuses both.

    >>> unplanned_changes({"keras": ("3.13.2", "3.15.1"), "numpy": ("2.1.3", "2.4.6"),
    ...     "rich": (None, "14.0")}, ["pip install -q 'keras>=3.15,<4'"])
    ['numpy 2.1.3 -> 2.4.6 (the runtime keeps its own)']
    """
    named = {n for command in plan for n in requirement_names(command)}
    problems = []
    for name, (old, new) in changes.items():
        if old is None:
            continue
        if name in KERAS3_KEEPS:
            problems.append(f"{name} {old} -> {new} {_KEPT}")
        elif name not in named:
            problems.append(f"{name} {old} -> {new} (not in the plan)")
    return problems


def _say_plan(plan: list[str], facts: RuntimeFacts, engine: str) -> None:
    """The plan, before any of it runs: each command, and for the Keras 3 engine what each
    package replaces and why."""
    say(f"[install] {facts.platform}/{facts.accelerator}, {engine} engine: will run")
    for command in plan:
        say(f"    {command}")
        if engine != "keras3":
            continue
        for name in requirement_names(command):
            have = facts.distributions.get(name) or "none"
            why = KERAS3_WHY.get(name, "KerasHub or the engine imports it")
            say(f"      {name} (installed: {have}): {why}")


def install(
    facts: RuntimeFacts | None = None,
    run: Callable[..., object] = subprocess.run,
    engine: str = "tf",
) -> list[str]:
    """Print the install plan of ``engine`` (one of ``ENGINES``) for this runtime and carry
    it out on Colab or Kaggle only. The seeds' track (notebooks/tf/) runs the TF engine; the
    main track (notebooks/) the Keras 3 one. Either way it first says which engine this runtime favours and why
    (``choose_engine``), so a TF notebook on a JAX TPU runtime says what it will replace.

    Elsewhere it only prints, so running a notebook locally never touches your packages.
    After installing it sets the environment flags again (``prepare_environment``), so
    that transformers and datasets see a ``tensorflow-tpu`` installed by the plan, and it
    asks for a restart only when a package it changed had already been imported.
    Returns the plan.
    """
    if engine not in ENGINES:
        raise InputError(
            f"engine={engine!r} is not one of {ENGINES}. Fix: engine='tf' or 'keras3'."
        )
    facts = facts or detect_runtime()
    say(f"[install] this runtime favours the {choose_engine(facts)}")
    plan = install_commands(facts) if engine == "tf" else keras3_install_commands(facts)
    if not plan:
        say(f"[install] {facts.platform}/{facts.accelerator}: nothing to install.")
        return plan
    _say_plan(plan, facts, engine)
    if not facts.hosted:
        say(f"[install] {facts.platform}: not Colab or Kaggle, so nothing is run.")
        return plan
    loaded = {name: module for name, module in _MODULES.items() if module in sys.modules}
    changed = _run_plan(plan, run, engine)
    stale = sorted({loaded[name] for name in changed if name in loaded})
    if stale:
        say(
            f"[install] {', '.join(stale)} changed after it was imported in this session:"
            " Runtime -> Restart session, then run the notebook again from the top."
        )
    return plan


def _run_plan(plan: list[str], run: Callable[..., object], engine: str) -> list[str]:
    """Run ``plan``'s commands, say what each changed, refuse a change to a package the
    runtime keeps (JAX, libtpu: the Keras 3 engine's plans must leave them), and return the
    distributions the commands name."""
    import importlib

    from tpu_helpers.runtime.env import prepare_environment

    changed: list[str] = []
    before = installed()
    for command in plan:
        say(f"[install] $ {command}")
        run(pip_argv(command), check=True)
        changed += requirement_names(command)
    importlib.invalidate_caches()
    prepare_environment()
    changes = install_changes(before, installed())
    for name, (old, new) in changes.items():
        say(f"[install] {name}: {old or 'none'} -> {new or 'removed'}")
    problems = unplanned_changes(changes, plan) if engine == "keras3" else []
    for problem in problems:  # a requirement of what the plan names, moved by pip
        say(f"[install] also changed: {problem}")
    kept = [problem for problem in problems if problem.endswith(_KEPT)]
    if kept:
        raise InstallError(
            f"the install changed {'; '.join(kept)}. Fix: Runtime -> Disconnect and delete"
            " runtime, then run the notebook from the top (JAX and libtpu must stay the"
            " runtime's own)."
        )
    return changed
