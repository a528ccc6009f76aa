"""Every error ``tpu_helpers`` raises on purpose derives from ``TpuHelpersError``:
``except TpuHelpersError`` catches them all, each class is one condition, and each message
names the value and the fix. The classes also keep the built-in base a caller would
expect (``ValueError`` for bad input, ``RuntimeError`` for what cannot run here).

===========================  ============================================  ============
class                        condition                                     defined in
===========================  ============================================  ============
``CheckpointFormatError``    a checkpoint's files cannot be read as asked  here
``CheckpointMismatchError``  a run's saves belong to another run, model    here
                             or optimizer, or none can be read
``EngineError``              an engine cannot run here as asked            here
                             (backend, devices, family)
``TrainingDivergedError``    the loss is no longer a number: nothing more  here
                             is saved over the run's last good save
``TPUConnectionError``       no TPU could be resolved                      ``strategy``
``RecordsError``             shards and their metadata disagree            ``records``
``XlaUnavailableError``      compiled steps cannot run in this process     ``xla``
``PreflightError``           a preflight check failed                      ``xla``
``ExerciseCheckError``       an exercise's answer lacks its property       ``workshop``
===========================  ============================================  ============
"""

from __future__ import annotations

__all__ = [
    "TpuHelpersError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "EngineError",
    "TrainingDivergedError",
    "InstallError",
]


class TpuHelpersError(Exception):
    """The root of every error ``tpu_helpers`` raises on purpose."""


class CheckpointFormatError(TpuHelpersError, ValueError):
    """A checkpoint whose weights cannot be read as asked, or do not fit the model."""


class CheckpointMismatchError(TpuHelpersError, RuntimeError):
    """A run's saves cannot be read, or belong to another run, model or optimizer (both
    engines' ``fit_resumable``)."""


class EngineError(TpuHelpersError, RuntimeError):
    """An engine cannot run here as asked (backend, devices, family)."""


class TrainingDivergedError(TpuHelpersError, ArithmeticError):
    """The training loss became NaN or infinite (both engines' ``fit_resumable``): the
    run stops before saving, so its saves keep the last state of finite loss."""


class InstallError(TpuHelpersError, RuntimeError):
    """An install plan changed what it was to leave as the runtime has it."""
