"""Helpers for training Hugging Face transformers with TensorFlow/Keras on TPUs.

Import this package before TensorFlow: it sets ``TF_USE_LEGACY_KERAS=1`` so that
``tf.keras`` is tf-keras, which the ``TF*`` model classes of transformers require.

>>> import tpu_helpers
>>> strategy = tpu_helpers.connect()            # doctest: +SKIP
"""

from tpu_helpers.runtime.env import prepare_environment as _prepare_environment

_prepare_environment()

from tpu_helpers.runtime import detect_runtime, install  # noqa: E402
from tpu_helpers.runtime.doctor import doctor  # noqa: E402
from tpu_helpers.tf_engine.strategy import connect  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "connect",
    "detect_runtime",
    "doctor",
    "install",
]
