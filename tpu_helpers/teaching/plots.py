"""Figures the notebooks show: training curves."""

from __future__ import annotations

__all__ = [
    "plot_history",
    "short_name",
]


def plot_history(history: dict, title: str = "training"):
    """Loss and accuracy per epoch, training against validation, side by side.

    ``history`` is ``model.fit(...).history`` or any dict of per-epoch lists with keys
    such as ``loss``/``val_loss`` and ``accuracy``/``val_accuracy``. Returns the figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = [m for m in ("loss", "accuracy") if m in history]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for key, style in ((metric, "o-"), (f"val_{metric}", "s--")):
            if key in history:
                values = history[key]
                ax.plot(range(1, len(values) + 1), values, style, label=key)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(metric)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def short_name(name: str) -> str:
    """A checkpoint or data set as a title shows it: hub ids as they are, paths (local,
    ``gs://``) by their last component, so no title carries a machine's folders.

    >>> short_name("/home/me/build/fixtures/tiny-vit"), short_name("gs://b/data/beans/")
    ('tiny-vit', 'beans')
    >>> short_name("google/vit-base-patch16-224")
    'google/vit-base-patch16-224'
    """
    import os

    text = str(name)
    if "://" in text or os.path.isabs(text) or text.startswith((".", "~")):
        return text.rstrip("/").rsplit("/", 1)[-1] or text
    return text
