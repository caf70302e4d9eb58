"""Headless figures: matplotlib on its Agg backend, and a figure turned into PNG bytes or an atomically written file.

    from workbench.plots import plt, save_png
    fig, ax = plt.subplots(); ax.plot(xs, ys); save_png(fig, run.eval.path / "figure.png")

Any room that draws imports this one (training's figures, evaluation's, the reward lab's); it knows nothing of
runs or metrics, so it sits on the ground floor beside the run directory's writer.
"""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless everywhere (papermill, CI, a training process)
import matplotlib.pyplot as plt  # noqa: E402

from workbench.rundir import write_atomic  # noqa: E402

__all__ = ["plt", "png_bytes", "save_png"]


def png_bytes(fig, dpi: int = 80) -> bytes:
    """The figure as PNG bytes; the figure is closed (a long-lived process would otherwise keep every one)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()


def save_png(fig, path, dpi: int = 100):
    """Write the figure atomically (a reader never sees half a PNG) and close it."""
    return write_atomic(path, png_bytes(fig, dpi=dpi))
