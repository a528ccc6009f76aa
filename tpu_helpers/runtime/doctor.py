"""``python -m tpu_helpers doctor``: is this environment able to run the notebooks?

Each check is a pure function of ``DoctorFacts`` that returns a ``Check`` (named
``<what>_check``; the ``check_*`` functions of ``validate`` and ``workshop`` raise instead),
so tests can feed it the facts of a good and a broken environment. ``gather_facts`` collects the real ones (it imports TensorFlow).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from tpu_helpers.core.checks import FAIL, PASS, Check, first_line
from tpu_helpers.core.messages import say
from tpu_helpers.core.versions import KERAS_HUB, KERAS_MINORS
from tpu_helpers.runtime import (
    DATASETS_SPEC,
    HUB_SPEC,
    LIBTPU_KNOWN_GOOD,
    LIBTPU_PIN,
    MAIN_TRACK,
    TENSORFLOW_TPU_PIN,
    TRANSFORMERS_PIN,
    RuntimeFacts,
    choose_engine,
    detect_runtime,
    libtpu_loads,
    minor,
)

__all__ = [
    "DoctorFacts",
    "tensorflow_check",
    "tf_keras_check",
    "transformers_check",
    "datasets_check",
    "legacy_keras_check",
    "tpu_visible_check",
    "tensorflow_tpu_recognised_check",
    "libtpu_check",
    "datasets_sees_tf_check",
    "engine_check",
    "keras3_check",
    "jax_devices_check",
    "CHECKS",
    "KERAS3_CHECKS",
    "gather_facts",
    "doctor",
]


@dataclass(frozen=True)
class DoctorFacts:
    """Facts the checks read.

    Attributes:
        runtime: platform, accelerator and installed versions.
        keras_module: the module ``tf.keras.Model`` comes from (``"tf_keras..."`` is right).
        legacy_flag: the value of ``TF_USE_LEGACY_KERAS`` when TensorFlow was imported.
        transformers_tf_error: why ``TFAutoModel`` could not be imported, ``None`` if it could.
        transformers_sees_tf: ``transformers.utils.is_tf_available()``.
        device_types: device types TensorFlow lists (``"CPU"``, ``"GPU"``, ``"TPU"``).
        datasets_sees_tf: ``datasets.config.TF_AVAILABLE`` (``None`` without datasets).
        jax_platforms: the platforms of the devices JAX finds (the Keras 3 engine's).
    """

    runtime: RuntimeFacts
    keras_module: str | None = None
    legacy_flag: str | None = None
    transformers_tf_error: str | None = None
    transformers_sees_tf: bool | None = None
    device_types: tuple[str, ...] = field(default_factory=tuple)
    datasets_sees_tf: bool | None = None
    jax_platforms: tuple[str, ...] = field(default_factory=tuple)


def tensorflow_check(f: DoctorFacts) -> Check:
    build, version = f.runtime.tensorflow_build, f.runtime.tensorflow_version
    if not build:
        fix = (
            f"pip install {TENSORFLOW_TPU_PIN} {LIBTPU_PIN}"
            if f.runtime.accelerator == "tpu"
            else "pip install -r requirements.txt"
        )
        return Check("tensorflow", FAIL, "no TensorFlow distribution is installed", fix)
    return Check("tensorflow", PASS, f"{build} {version}")


def _unreadable(check: str, package: str, version: str, fix: str) -> Check:
    """A version string with no major.minor in it (a local build, a broken install)."""
    return Check(check, FAIL, f"{package} version {version!r} cannot be read as major.minor", fix)


def tf_keras_check(f: DoctorFacts) -> Check:
    tf_minor = minor(f.runtime.tensorflow_version)
    have = f.runtime.distributions.get("tf-keras")
    if tf_minor is None:
        return Check("tf-keras", FAIL, "cannot check without TensorFlow", "install TensorFlow")
    want = f"tf-keras~={tf_minor[0]}.{tf_minor[1]}.0"
    if not have:
        return Check("tf-keras", FAIL, "not installed", f"pip install --no-deps '{want}'")
    if minor(have) != tf_minor:
        return Check(
            "tf-keras",
            FAIL,
            f"tf-keras {have} does not match TensorFlow {f.runtime.tensorflow_version}",
            f"pip install --no-deps '{want}'  (--no-deps keeps your TensorFlow build)",
        )
    return Check("tf-keras", PASS, f"{have} matches TensorFlow {tf_minor[0]}.{tf_minor[1]}")


def transformers_check(f: DoctorFacts) -> Check:
    have = f.runtime.distributions.get("transformers")
    if not have:
        return Check("transformers", FAIL, "not installed", f"pip install {TRANSFORMERS_PIN}")
    if minor(have) is None:
        return _unreadable("transformers", "transformers", have, f"pip install {TRANSFORMERS_PIN}")
    if minor(have)[0] >= 5:
        return Check(
            "transformers",
            FAIL,
            f"{have} has no TensorFlow classes (removed in v5)",
            f"pip install {TRANSFORMERS_PIN}",
        )
    if f.transformers_tf_error:
        return Check(
            "transformers",
            FAIL,
            f"{have}, but TFAutoModel does not import: {f.transformers_tf_error}",
            "fix the TensorFlow / tf-keras checks above, then restart the runtime",
        )
    return Check("transformers", PASS, f"{have}, TF classes import")


def datasets_check(f: DoctorFacts) -> Check:
    ds, hub = (
        f.runtime.distributions.get("datasets"),
        f.runtime.distributions.get("huggingface-hub"),
    )
    fix = f"pip install '{DATASETS_SPEC}' '{HUB_SPEC}'"
    if not ds or not hub:
        return Check("datasets", FAIL, f"datasets {ds}, huggingface-hub {hub}", fix)
    for name, version in (("datasets", ds), ("huggingface-hub", hub)):
        if minor(version) is None:
            return _unreadable("datasets", name, version, fix)
    if not ((4, 0) <= minor(ds) < (5, 1)) or minor(hub)[0] >= 1:
        return Check(
            "datasets",
            FAIL,
            f"datasets {ds} with huggingface-hub {hub}: transformers 4.x needs hub < 1.0,"
            " and datasets >= 5.1 needs hub >= 1.31",
            fix,
        )
    return Check("datasets", PASS, f"datasets {ds}, huggingface-hub {hub}")


def legacy_keras_check(f: DoctorFacts) -> Check:
    fix = (
        "import tpu_helpers (or set os.environ['TF_USE_LEGACY_KERAS'] = '1') before"
        " TensorFlow, then restart the runtime"
    )
    if f.legacy_flag != "1":
        return Check("legacy keras", FAIL, f"TF_USE_LEGACY_KERAS={f.legacy_flag!r}", fix)
    if f.keras_module and not f.keras_module.startswith("tf_keras"):
        return Check(
            "legacy keras",
            FAIL,
            f"tf.keras is {f.keras_module} (Keras 3): TensorFlow was imported before the flag",
            fix,
        )
    return Check("legacy keras", PASS, f"tf.keras is {f.keras_module or 'tf_keras'}")


def tpu_visible_check(f: DoctorFacts) -> Check:
    if f.runtime.accelerator != "tpu":
        return Check("tpu devices", PASS, f"not a TPU runtime ({f.runtime.accelerator})")
    if "TPU" in f.device_types:
        return Check("tpu devices", PASS, "TPU devices visible")
    listed = sorted(set(f.device_types)) or "no"
    if f.runtime.tensorflow_build == "tensorflow-tpu":  # Colab's and Kaggle's v5e and v6e
        return Check(
            "tpu devices",
            FAIL,
            f"a TPU runtime, and tensorflow-tpu {f.runtime.tensorflow_version} lists only"
            f" {listed} devices: no public tensorflow-tpu build finds a v5e or v6e chip",
            f"open {MAIN_TRACK} (this TPU's runtime drives it with JAX)",
        )
    return Check(
        "tpu devices",
        FAIL,
        f"a TPU runtime, but TensorFlow ({f.runtime.tensorflow_build}) lists only"
        f" {listed} devices: a CPU-only build",
        f"pip uninstall -y tensorflow tensorflow-cpu && pip install {TENSORFLOW_TPU_PIN}"
        f" {LIBTPU_PIN}; then restart the runtime; on Colab's and Kaggle's TPUs, open"
        f" {MAIN_TRACK} instead",
    )


def tensorflow_tpu_recognised_check(f: DoctorFacts) -> Check:
    if not f.runtime.distributions.get("tensorflow-tpu"):
        return Check("transformers sees TF", PASS, "tensorflow-tpu not installed")
    if f.transformers_sees_tf:
        return Check("transformers sees TF", PASS, "tensorflow-tpu recognised")
    return Check(
        "transformers sees TF",
        FAIL,
        "tensorflow-tpu is installed but transformers says TensorFlow is missing",
        "set os.environ['FORCE_TF_AVAILABLE'] = '1' (import tpu_helpers does) before"
        " importing transformers, then restart the runtime",
    )


def libtpu_check(f: DoctorFacts) -> Check:
    if f.runtime.tensorflow_build != "tensorflow-tpu":
        return Check("libtpu", PASS, "no tensorflow-tpu, so libtpu is not used")
    have = f.runtime.distributions.get("libtpu")
    first, last = (".".join(map(str, v)) for v in LIBTPU_KNOWN_GOOD)
    if libtpu_loads(have):
        return Check("libtpu", PASS, f"{have} (known to load: {first} to {last})")
    found = f"libtpu {have}" if have else "no libtpu"
    return Check(
        "libtpu",
        FAIL,
        f"{found} next to tensorflow-tpu {f.runtime.tensorflow_version}: only {first} to"
        f" {last} load with it (0.0.32 and later abort the process on import tensorflow)",
        f"pip install {LIBTPU_PIN}; then restart the runtime",
    )


def datasets_sees_tf_check(f: DoctorFacts) -> Check:
    if f.datasets_sees_tf is None or not f.runtime.tensorflow_build:
        return Check("datasets sees TF", PASS, "nothing to check (no datasets or no TensorFlow)")
    if f.datasets_sees_tf:
        return Check("datasets sees TF", PASS, f"{f.runtime.tensorflow_build} recognised")
    return Check(
        "datasets sees TF",
        FAIL,
        f"{f.runtime.tensorflow_build} is installed but datasets says TensorFlow is missing:"
        " prepare_tf_dataset / to_tf_dataset raise 'Tensorflow is not installed'",
        "import tpu_helpers (it sets datasets.config.TF_AVAILABLE for tensorflow-tpu), or set"
        " datasets.config.TF_AVAILABLE = True after importing datasets",
    )


def engine_check(f: DoctorFacts) -> Check:
    """Which runtime this is, which engine it favours, and why (``runtime.choose_engine``)."""
    r = f.runtime
    where = f"{r.platform} {r.accelerator}" + (f" {r.tpu_type}" if r.tpu_type else "")
    python = ".".join(map(str, sys.version_info[:3]))
    return Check("engine", PASS, f"{where}, Python {python}: {choose_engine(r)}")


def keras3_check(f: DoctorFacts) -> Check:
    """Keras 3 (of KerasHub's version), KerasHub, JAX, transformers 5 and a TensorFlow for
    ``tf.data``: what ``tpu_helpers.keras3`` imports."""
    d = f.runtime.distributions
    hub = KERAS_HUB
    problems = [
        f"keras {d.get('keras')}"
        if (minor(d.get("keras")) or (0, 0)) < minor(KERAS_MINORS[0])
        else "",
        f"keras-hub {d.get('keras-hub')} (not {hub})" if d.get("keras-hub") != hub else "",
        "no jax" if not d.get("jax") else "",
        f"transformers {d.get('transformers')}"
        if (minor(d.get("transformers")) or (0, 0)) < (5, 0)
        else "",
        "no TensorFlow (tf.data)" if not f.runtime.tensorflow_build else "",
    ]
    problems = [p for p in problems if p]
    if problems:
        fix = "python -m tpu_helpers install --engine keras3 (what the main track's install cell runs)"
        return Check("keras 3 engine", FAIL, "; ".join(problems), fix)
    return Check(
        "keras 3 engine",
        PASS,
        f"keras {d['keras']}, keras-hub {hub}, jax {d['jax']} with libtpu"
        f" {d.get('libtpu') or 'none (a CPU JAX)'}, transformers {d['transformers']}",
    )


def jax_devices_check(f: DoctorFacts) -> Check:
    """On a TPU runtime, JAX finds the TPU (its libtpu loads)."""
    if f.runtime.accelerator != "tpu":
        return Check(
            "jax devices", PASS, f"not a TPU runtime: {', '.join(f.jax_platforms) or 'none'}"
        )
    if "tpu" in f.jax_platforms:
        return Check("jax devices", PASS, "TPU devices visible to JAX")
    return Check(
        "jax devices",
        FAIL,
        f"a TPU runtime, and JAX finds {', '.join(f.jax_platforms) or 'no device'}",
        "Runtime -> Restart session (a libtpu another package installed may hold the TPU),"
        " and check that nothing replaced the runtime's own jax and libtpu",
    )


#: The checks of the Keras 3 engine's stack (``doctor`` runs them where it is favoured).
KERAS3_CHECKS: tuple[Callable[[DoctorFacts], Check], ...] = (keras3_check, jax_devices_check)

CHECKS: tuple[Callable[[DoctorFacts], Check], ...] = (
    tensorflow_check,
    tf_keras_check,
    transformers_check,
    datasets_check,
    legacy_keras_check,
    libtpu_check,
    tpu_visible_check,
    tensorflow_tpu_recognised_check,
    datasets_sees_tf_check,
)


def gather_facts() -> DoctorFacts:
    """Collect the real facts. Imports TensorFlow and transformers if they are installed."""
    runtime = detect_runtime()
    keras_module = tf_error = None
    sees_tf = None
    device_types: set[str] = set()
    flag = os.environ.get("TF_USE_LEGACY_KERAS")
    try:
        import tensorflow as tf

        keras_module = tf.keras.Model.__module__
        for device in tf.config.list_physical_devices() + tf.config.list_logical_devices():
            device_types.add(device.device_type)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        tf_error = f"TensorFlow does not import: {err}"
    try:
        from transformers.utils import is_tf_available

        sees_tf = bool(is_tf_available())
        if tf_error is None:
            from transformers import TFAutoModel  # noqa: F401
    except Exception as err:  # noqa: BLE001 - reported, not raised
        tf_error = tf_error or f"{type(err).__name__}: {first_line(err)}"
    jax_platforms: tuple[str, ...] = ()
    if choose_engine(runtime).engine == "keras3":
        try:
            import jax

            jax_platforms = tuple(sorted({device.platform for device in jax.devices()}))
        except Exception:  # noqa: BLE001 - no JAX device is what the check reports
            jax_platforms = ()
    datasets_sees_tf = None
    if runtime.distributions.get("datasets"):
        try:
            import datasets.config

            datasets_sees_tf = bool(datasets.config.TF_AVAILABLE)
        except Exception:  # noqa: BLE001 - a datasets that does not import is its own check
            datasets_sees_tf = None
    return DoctorFacts(
        runtime,
        keras_module,
        flag,
        tf_error,
        sees_tf,
        tuple(sorted(device_types)),
        datasets_sees_tf,
        jax_platforms,
    )


def doctor(facts: DoctorFacts | None = None, verbose: bool = True) -> list[Check]:
    """Run the checks of the engine this runtime favours (``CHECKS`` for the TF engine,
    ``KERAS3_CHECKS`` for Keras 3 on JAX) after the one saying which and why, print one
    line each (with the fix on FAIL) and return them.

    >>> checks = doctor(verbose=False)                 # doctest: +SKIP
    >>> all(c.ok for c in checks)                      # doctest: +SKIP
    True
    """
    facts = facts or gather_facts()
    chosen = KERAS3_CHECKS if choose_engine(facts.runtime).engine == "keras3" else CHECKS
    checks = [check(facts) for check in (engine_check, *chosen)]
    if verbose:
        for c in checks:
            say(c.line())
        bad = sum(not c.ok for c in checks)
        say(f"doctor: {len(checks)} checks, {bad} failing")
    return checks
