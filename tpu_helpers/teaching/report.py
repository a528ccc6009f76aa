"""Key figures out of a notebook for the run report.

A notebook calls ``publish_metrics(accuracy=0.91, ...)``: the figures appear in the
notebook as a small table and are stored in the cell output under ``METRICS_MIME``, where
the main job's report (``tools/report.py``) reads them.
"""

from __future__ import annotations

from tpu_helpers.core.errors import InputTypeError

__all__ = ["METRICS_MIME", "publish_metrics"]

METRICS_MIME = "application/vnd.tpu-helpers.metrics+json"


def publish_metrics(**metrics: float | int | str) -> None:
    """Show ``metrics`` in the notebook and tag them for the run report.

    >>> publish_metrics(val_accuracy=0.9)   # outside IPython it only prints
    val_accuracy: 0.9
    """
    clean = {name: _figure(name, value) for name, value in metrics.items()}
    text = "\n".join(f"{k}: {v}" for k, v in clean.items())
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            display({METRICS_MIME: clean, "text/plain": text}, raw=True)
            return
    except ImportError:
        pass
    print(text)


def _figure(name: str, value) -> float | int | str | bool:
    """One metric as a JSON scalar: NumPy scalars and 0-d tensors become Python numbers
    (floats rounded to 4 places); anything else is refused, naming it."""
    if hasattr(value, "numpy"):  # a tf.Tensor or tf.Variable
        value = value.numpy()
    if hasattr(value, "ndim") and value.ndim == 0:
        value = value.item()
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, (int, str, bool)):
        return value
    raise InputTypeError(
        f"Metric {name}={value!r} is a {type(value).__name__}; a metric is one number or"
        f" string. Fix: publish one figure, e.g. {name}=float(values[-1]) for the last epoch."
    )
