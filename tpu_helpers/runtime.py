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

from tpu_helpers._env import distribution_version

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
)

TRANSFORMERS_PIN = "transformers==4.57.6"
DATASETS_SPEC = "datasets>=4,<5.1"
HUB_SPEC = "huggingface-hub<1.0"
TENSORFLOW_PIN = "tensorflow==2.21.0"
#: Where Google publishes the ``tensorflow-tpu`` wheels and the matching ``libtpu``.
LIBTPU_INDEX = "https://storage.googleapis.com/libtpu-tf-releases/index.html"
#: ``tensorflow-tpu`` releases on the package index (there is none for 2.21).
TENSORFLOW_TPU_MINORS = ((2, 16), (2, 17), (2, 18), (2, 19), (2, 20))

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
    if versions is None:
        versions = {name: distribution_version(name) for name in STACK}
    dists = {name: versions.get(name) for name in STACK}

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


def _tensorflow_tpu_pin(current: str | None) -> str:
    """The ``tensorflow-tpu`` release closest to the TensorFlow already there."""
    have = minor(current)
    if have in TENSORFLOW_TPU_MINORS:
        return f"tensorflow-tpu=={have[0]}.{have[1]}.*"
    last = TENSORFLOW_TPU_MINORS[-1]
    return f"tensorflow-tpu=={last[0]}.{last[1]}.0"


def install_commands(facts: RuntimeFacts) -> list[str]:
    """The shell commands that make ``facts``' runtime able to run these notebooks.

    A plain machine gets nothing: it installs ``requirements.txt`` itself. Colab, Kaggle
    and TPU VMs get what they lack: a TensorFlow build for the accelerator, a tf-keras of
    TensorFlow's minor version (installed ``--no-deps`` so it never replaces a special TF
    build), transformers < 5 and a datasets / huggingface-hub pair that agree.

    >>> install_commands(RuntimeFacts(platform="local"))
    []
    """
    if facts.platform == "local":
        return []
    dists = facts.distributions
    pip = "pip install -q"
    commands: list[str] = []

    tf_version = facts.tensorflow_version
    if facts.accelerator == "tpu" and facts.tensorflow_build != "tensorflow-tpu":
        pin = _tensorflow_tpu_pin(tf_version)
        others = [n for n in ("tensorflow", "tensorflow-cpu") if dists.get(n)]
        if others:
            commands.append("pip uninstall -y " + " ".join(others))
        commands.append(f"{pip} {shlex.quote(pin)} -f {LIBTPU_INDEX}")
        tf_version = pin.split("==")[1].replace("*", "0")
    elif tf_version is None:
        pin = TENSORFLOW_PIN
        if facts.accelerator == "gpu":
            pin = pin.replace("tensorflow", "tensorflow[and-cuda]", 1)
        commands.append(f"{pip} {shlex.quote(pin)}")
        tf_version = pin.split("==")[1]

    tf_minor = minor(tf_version)
    if tf_minor and minor(dists.get("tf-keras")) != tf_minor:
        spec = f"tf-keras~={tf_minor[0]}.{tf_minor[1]}.0"
        commands.append(f"{pip} --no-deps {shlex.quote(spec)}")

    transformers = minor(dists.get("transformers"))
    if transformers is None or transformers[0] >= 5:
        commands.append(f"{pip} {TRANSFORMERS_PIN}")

    datasets, hub = minor(dists.get("datasets")), minor(dists.get("huggingface-hub"))
    if datasets is None or datasets >= (5, 1) or datasets < (4, 0) or (hub and hub[0] >= 1):
        commands.append(f"{pip} {shlex.quote(DATASETS_SPEC)} {shlex.quote(HUB_SPEC)}")
    return commands


def install(
    facts: RuntimeFacts | None = None,
    run: Callable[..., object] = subprocess.run,
) -> list[str]:
    """Print the install plan for this runtime and carry it out on Colab or Kaggle only.

    Elsewhere it only prints, so running a notebook locally never touches your packages.
    Returns the plan.
    """
    facts = facts or detect_runtime()
    plan = install_commands(facts)
    if not plan:
        print(f"[install] {facts.platform}/{facts.accelerator}: nothing to install.")
        return plan
    if not facts.hosted:
        print(f"[install] {facts.platform}: not Colab or Kaggle, so nothing is run. Plan:")
        for command in plan:
            print("   ", command)
        return plan
    tf_loaded = "tensorflow" in sys.modules
    for command in plan:
        print("[install] $", command)
        run(command, shell=True, check=True)
    if tf_loaded and any("tensorflow" in c for c in plan):
        print("[install] TensorFlow changed after it was imported: Runtime -> Restart session.")
    return plan
