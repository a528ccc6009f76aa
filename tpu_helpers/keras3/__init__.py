"""The Keras 3 engine: hub checkpoints fine-tuned with Keras 3 on JAX, through KerasHub.

Colab's and Kaggle's TPU images ship JAX (with the TPU's libtpu) and Keras 3, and no
``tensorflow-tpu``; transformers 5 has no TF classes. This engine trains there without
replacing anything: KerasHub builds the encoder from a checkpoint in the hub's layout
(``config.json`` and PyTorch-named safetensors, one file or shards), the classification
head of the checkpoint's family is rebuilt here (``HEADS``) and read from the same files
when they hold it, ``keras.distribution.DataParallel`` splits each global batch over the
devices JAX finds, and every ``tpu_helpers`` pipeline (a ``pipeline.Batches``) feeds
``fit`` as it feeds the TF engine: the features keep their names, the labels and weights
their places.

Its modules, each a concern (this package names their public parts):

================  ======================================================================
``distribution``  ``devices``, the devices a batch is split over (simulated CPU devices
                  too), ``connect`` (``keras.distribution.DataParallel`` made global),
                  what several JAX processes agree on
``models``        ``classifier`` and ``masked_lm``: encoder + head from a checkpoint, as
                  ``keras.Model``; ``compile_classifier``
``packed``        ``packed_classifier``: a classifier on packed rows
``export``        ``save_hub_layout``: the trained model in the hub's layout
``trainer``       ``RunSaves``, ``JaxTrainer``, ``fit_resumable``
                  (``core.engine.fit_with``, the one loop of both engines),
                  ``predict_classes``, ``evaluate``, ``compilations``,
                  ``input_bound_check``
``steps``         the compiled steps (one program per width), hosts
``converters``    how the engine reads the families KerasHub builds and does not convert
                  from the hub's files (ELECTRA, DeBERTa-v3)
``internals``     the private Keras and KerasHub names the engine needs
================  ======================================================================

Notebook 10's decoder LLMs build on this engine from a folder of their own, ``tpu_helpers.llm``.

>>> from tpu_helpers import keras3  # doctest: +SKIP
>>> distribution = keras3.connect()
>>> model = keras3.classifier("distilbert-base-cased", num_labels=2)
"""

from __future__ import annotations

import warnings

from tpu_helpers.core.errors import EngineError
from tpu_helpers.core.versions import WRITTEN_FOR, installed
from tpu_helpers.keras3.distribution import connect, devices, replicas, simulation_env
from tpu_helpers.keras3.export import save_hub_layout
from tpu_helpers.keras3.models import (
    HEADS,
    checkpoint_folder,
    classifier,
    compile_classifier,
    masked_lm,
)
from tpu_helpers.keras3.packed import packed_attention, packed_classifier, packed_positions
from tpu_helpers.keras3.trainer import (
    ResumePoint,
    RunSaves,
    compilations,
    evaluate,
    fit_resumable,
    input_bound_check,
    predict_classes,
)

__all__ = [
    "EngineError",
    "HEADS",
    "devices",
    "simulation_env",
    "connect",
    "replicas",
    "checkpoint_folder",
    "classifier",
    "compile_classifier",
    "masked_lm",
    "packed_classifier",
    "packed_attention",
    "packed_positions",
    "save_hub_layout",
    "ResumePoint",
    "RunSaves",
    "fit_resumable",
    "evaluate",
    "predict_classes",
    "compilations",
    "input_bound_check",
]


def _warn_of_releases_not_written_for() -> None:
    """A warning per installed Keras or KerasHub release the engine was not written for:
    its private names and converters may have moved (``versions``)."""
    for name, (version, known) in installed().items():
        if not known:
            warnings.warn(
                f"{name} {version}: the Keras 3 engine is written for {name}"
                f" {' and '.join(WRITTEN_FOR[name])}. Fix: tpu_helpers.install(engine='keras3')"
                " installs those; with this release, expect an EngineError naming what moved.",
                stacklevel=3,
            )


_warn_of_releases_not_written_for()
