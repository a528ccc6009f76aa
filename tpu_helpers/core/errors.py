"""Every error ``tpu_helpers`` raises on purpose derives from ``TpuHelpersError``:
``except TpuHelpersError`` catches them all, each class is one condition, and each message
names the value and the fix. The classes also keep the built-in base a caller would
expect (``ValueError`` for bad input, ``RuntimeError`` for what cannot run here).

===========================  ============================================  ============
class                        condition                                     defined in
===========================  ============================================  ============
``InputError``               a value passed in cannot be used as given     here
``InputTypeError``           a value passed in is of the wrong kind        here
``MissingFileError``         a file or folder named is not there           here
``ExistingFileError``        a file would be written over                  here
``NotFoundError``            a name looked up is not there (a metric, a    here
                             check)
``MissingPackageError``      a package the call needs is not installed     here
``TimedOutError``            a call did not finish in its time             here
``CheckpointFormatError``    a checkpoint's files cannot be read as asked  here
``CheckpointMismatchError``  a run's saves belong to another run, model    here
                             or optimizer, or none can be read
``EngineError``              an engine cannot run here as asked            here
                             (backend, devices, family)
``TrainingDivergedError``    the loss is no longer a number: nothing more  here
                             is saved over the run's last good save
``InstallError``             an install plan changed what the runtime      here
                             keeps (JAX, libtpu)
``TPUConnectionError``       no TPU could be resolved                      ``strategy``
``RecordsError``             shards and their metadata disagree            ``records``
``PreflightError``           a preflight check failed                      ``xla``
``ExerciseCheckError``       an exercise's answer lacks its property       ``workshop``
===========================  ============================================  ============
"""

from __future__ import annotations

#: How the records' message for a damaged shard (``records.read``'s per-shard check, raised
#: inside tf.data as an assertion) ends: the engines find the message by it.
SKIP_DAMAGED_SHARD = "leave it out: read_records or open_records with on_corrupt=skip."

__all__ = [
    "SKIP_DAMAGED_SHARD",
    "TpuHelpersError",
    "InputError",
    "InputTypeError",
    "MissingFileError",
    "ExistingFileError",
    "NotFoundError",
    "MissingPackageError",
    "TimedOutError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "EngineError",
    "TrainingDivergedError",
    "InstallError",
]


class TpuHelpersError(Exception):
    """The root of every error ``tpu_helpers`` raises on purpose."""

    #: Raised inside a ``tf.function`` (a check of a traced step), TensorFlow's autograph
    #: lets it through as it is; without this it rewraps any exception class it does not
    #: know into a ``StagingError``, and a caller's ``except ValueError`` misses it.
    ag_pass_through = True


class InputError(TpuHelpersError, ValueError):
    """A value passed in (an argument, a parameter, a row of data) cannot be used as given;
    the message names it and the fix."""


class InputTypeError(TpuHelpersError, TypeError):
    """A value passed in is of a kind the function does not take."""


class MissingFileError(TpuHelpersError, FileNotFoundError):
    """A file or folder the caller named (a checkpoint, a shard, an image) is not there."""


class ExistingFileError(TpuHelpersError, FileExistsError):
    """Writing would replace files that are there; the message says how to allow it."""


class NotFoundError(TpuHelpersError, KeyError):
    """A name looked up is not there: a metric a run did not log, a check not made."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class MissingPackageError(TpuHelpersError, ModuleNotFoundError):
    """A package the call needs is not installed; the message names the install."""


class TimedOutError(TpuHelpersError, TimeoutError):
    """A call did not finish within its time (connecting to a TPU, say)."""


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
