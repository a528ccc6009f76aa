"""Figures the notebooks show: training curves."""

from __future__ import annotations


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
