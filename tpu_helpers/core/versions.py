"""The releases the Keras 3 engine is written for, in one place.

The install plans (``runtime``), the doctor, the engine's messages and a warning when
``tpu_helpers.keras3`` is imported (a release not written for) read them here.
A new KerasHub or Keras release is a change here, then a run of ``tests/test_keras3.py``
on both Keras 3 legs (it checks every private name against the installed release).
"""

from __future__ import annotations

__all__ = [
    "KERAS_HUB",
    "KERAS_HUB_PIN",
    "KERAS_MINORS",
    "KERAS_REQUIREMENT",
    "WRITTEN_FOR",
    "installed",
]

#: The KerasHub release the engine loads the hub's checkpoints with (pinned: its
#: converters and private names change between releases).
KERAS_HUB = "0.32.0"
KERAS_HUB_PIN = f"keras-hub=={KERAS_HUB}"
#: The Keras 3 minor releases the engine is written and tested for: those KerasHub
#: ``KERAS_HUB`` takes (it asks for Keras >= 3.15).
KERAS_MINORS = ("3.15",)
KERAS_REQUIREMENT = f"keras>={KERAS_MINORS[0]},<4"
#: distribution -> the minor versions the engine's private names were read in and tested with
WRITTEN_FOR = {"keras": KERAS_MINORS, "keras-hub": (KERAS_HUB.rsplit(".", 1)[0],)}


def installed() -> dict:
    """The installed versions of ``WRITTEN_FOR``'s distributions, and whether each is one
    of the versions written for: ``{name: (version, known)}``."""
    from importlib import metadata

    found = {}
    for name, minors in WRITTEN_FOR.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = (version, ".".join(version.split(".")[:2]) in minors)
    return found
