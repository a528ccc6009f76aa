"""Environment variables that must be set before TensorFlow or transformers load.

Imported first by ``tpu_helpers/__init__.py``. Kept tiny and free of heavy imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from importlib import metadata


def distribution_version(name: str) -> str | None:
    """Return the installed version of distribution ``name``, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def only_tpu_build() -> bool:
    """True when the one TensorFlow installed is the ``tensorflow-tpu`` distribution.

    transformers and datasets look for TensorFlow under the names ``tensorflow``,
    ``tensorflow-cpu``, ``tensorflow-gpu`` and a few others, never ``tensorflow-tpu``.
    """
    return bool(distribution_version("tensorflow-tpu")) and not (
        distribution_version("tensorflow") or distribution_version("tensorflow-cpu")
    )


def tell_datasets_tensorflow_is_there() -> bool:
    """Make ``datasets`` count the ``tensorflow-tpu`` build as TensorFlow.

    ``datasets.config.TF_AVAILABLE`` is decided once, on import, from distribution names;
    with only ``tensorflow-tpu`` installed it is False and ``to_tf_dataset`` /
    ``model.prepare_tf_dataset`` raise "Tensorflow is not installed". The flag is read at
    call time, so setting it after import is enough: now if ``datasets`` is imported
    already, else the moment it is (importing it takes seconds, which a process that never
    reads a data set, such as a training worker on records, need not spend). Returns True
    when it changed the flag or will.
    """
    if not only_tpu_build() or distribution_version("datasets") is None:
        return False
    if "datasets.config" in sys.modules:
        return _count_tpu_build_as_tensorflow(sys.modules["datasets.config"])
    if not any(isinstance(f, _AfterImport) and f.name == "datasets.config" for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("datasets.config", _count_tpu_build_as_tensorflow))
    return True


def _count_tpu_build_as_tensorflow(config) -> bool:
    if config.TF_AVAILABLE:
        return False
    from packaging import version

    config.TF_AVAILABLE = True
    config.TF_VERSION = version.parse(distribution_version("tensorflow-tpu"))
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after module ``name`` is first executed (once); the
    module itself is found and loaded by the finders after this one, as without it."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            execute = loader.exec_module

            def exec_module(module):
                execute(module)
                self.then(module)

            loader.exec_module = exec_module
        return spec


def prepare_environment(environ: dict | None = None) -> list[str]:
    """Set the variables that keep TensorFlow, tf-keras and transformers working together.

    * ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` resolve to tf-keras (Keras 2), which the
      ``TF*`` classes of transformers need. It only takes effect if set before TensorFlow
      is imported, which is why ``import tpu_helpers`` should come first. Set only where
      tf-keras is installed (the TF engine's stacks): without it the flag serves nothing,
      and TensorFlow would tell a Keras 3 user to ``pip install tf_keras``.
    * With the ``tensorflow-tpu`` distribution as the only TensorFlow, a name transformers
      and datasets do not recognise: ``FORCE_TF_AVAILABLE=1`` for transformers (read when
      transformers is imported), ``TPU_SKIP_MDS_QUERY=1`` off a TPU (otherwise the import
      waits minutes on cloud metadata that only a TPU VM has), and
      ``datasets.config.TF_AVAILABLE`` (see ``tell_datasets_tensorflow_is_there``).

    Safe to call again, as ``install`` does after the install plan changed packages.
    Returns the names of what it set. Values already set by the user are kept.

    >>> env = {"TF_USE_LEGACY_KERAS": "0"}  # a value the user set is kept
    >>> "TF_USE_LEGACY_KERAS" in prepare_environment(env), env["TF_USE_LEGACY_KERAS"]
    (False, '0')
    """
    env = os.environ if environ is None else environ
    changed = []
    if environ is None:
        quiet_known_noise()
    if "TF_USE_LEGACY_KERAS" not in env and distribution_version("tf-keras"):
        env["TF_USE_LEGACY_KERAS"] = "1"
        changed.append("TF_USE_LEGACY_KERAS")
    if only_tpu_build():
        if "FORCE_TF_AVAILABLE" not in env:
            env["FORCE_TF_AVAILABLE"] = "1"
            changed.append("FORCE_TF_AVAILABLE")
        if "TPU_SKIP_MDS_QUERY" not in env and not _on_tpu_host():
            env["TPU_SKIP_MDS_QUERY"] = "1"
            changed.append("TPU_SKIP_MDS_QUERY")
        if environ is None and tell_datasets_tensorflow_is_there():
            changed.append("datasets.config.TF_AVAILABLE")
    return changed


def _on_tpu_host() -> bool:
    """A TPU chip is attached (TPU VM device files), so cloud metadata is there to read."""
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")


class KnownNoise(logging.Filter):
    """Drops TensorFlow log lines that say nothing a learner can act on:

    * "Gradients do not exist for variables [...pooler...]": models such as MPNet and BERT
      build a pooler that sequence classification does not use, so it gets no gradient.
      The warning stays when any other variable is named (that one is a real problem).
    * "Collective all_reduce ..." and "Reduce to ... then broadcast": INFO lines that a
      multi-replica strategy logs per trace.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Gradients do not exist for variables"):
            listed = message.split("[", 1)[-1].split("]", 1)[0]
            names = [n.strip(" '\"") for n in listed.split(",") if n.strip()]
            return not names or not all("pooler" in n for n in names)
        routine = message.startswith(("Collective ", "Reduce to "))
        return not (record.levelno < logging.WARNING and routine)


def quiet_known_noise() -> None:
    """Filter the Python log lines of ``KnownNoise`` from TensorFlow's logger (once).

    TensorFlow's C++ start-up lines (oneDNN, CUDA probing on a CPU) are printed before
    ``TF_CPP_MIN_LOG_LEVEL`` takes effect in TensorFlow 2.21 and cannot be silenced here.
    """
    logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, KnownNoise) for f in logger.filters):
        logger.addFilter(KnownNoise())
