"""What the package tells the person running it, through one logger: ``tpu_helpers``.

Every message goes through ``say`` (level INFO) to the logger ``tpu_helpers``, whose one
handler writes it to standard output, so that a notebook shows it under the cell that
caused it and a script prints it. To quiet the package:
``logging.getLogger("tpu_helpers").setLevel(logging.WARNING)``; to send its messages
elsewhere, replace that handler. A function that takes ``log=`` says its progress with
``say`` unless given another callable (a list's ``append``, to keep the lines).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOGGER", "say"]

LOGGER = logging.getLogger("tpu_helpers")


class _Stdout(logging.Handler):
    """Each message on the ``sys.stdout`` of the moment (a notebook cell's, a test's)."""

    tpu_helpers_handler = True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - a message must never stop a run
            self.handleError(record)


if not any(getattr(h, "tpu_helpers_handler", False) for h in LOGGER.handlers):
    LOGGER.addHandler(_Stdout())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False  # printed once, not again by a root handler


def say(message: str) -> None:
    """Tell the person running the package ``message`` (the logger ``tpu_helpers``)."""
    LOGGER.info(message)
