"""Environment variables that must be set before TensorFlow or transformers load.

Imported first by ``tpu_helpers/__init__.py``. Kept tiny and free of heavy imports.
"""

from __future__ import annotations

import os
from importlib import metadata


def distribution_version(name: str) -> str | None:
    """Return the installed version of distribution ``name``, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def prepare_environment(environ: dict | None = None) -> list[str]:
    """Set the variables that keep TensorFlow, tf-keras and transformers working together.

    * ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` resolve to tf-keras (Keras 2), which the
      ``TF*`` classes of transformers need. It only takes effect if set before TensorFlow
      is imported, which is why ``import tpu_helpers`` should come first.
    * ``FORCE_TF_AVAILABLE=1`` when the only TensorFlow is the ``tensorflow-tpu``
      distribution, a name transformers does not recognise.

    Returns the names of the variables it set. Values already set by the user are kept.

    >>> env = {}
    >>> "TF_USE_LEGACY_KERAS" in prepare_environment(env)
    True
    >>> env["TF_USE_LEGACY_KERAS"]
    '1'
    """
    env = os.environ if environ is None else environ
    changed = []
    if "TF_USE_LEGACY_KERAS" not in env:
        env["TF_USE_LEGACY_KERAS"] = "1"
        changed.append("TF_USE_LEGACY_KERAS")
    only_tpu_build = distribution_version("tensorflow-tpu") and not (
        distribution_version("tensorflow") or distribution_version("tensorflow-cpu")
    )
    if only_tpu_build and "FORCE_TF_AVAILABLE" not in env:
        env["FORCE_TF_AVAILABLE"] = "1"
        changed.append("FORCE_TF_AVAILABLE")
    return changed
