"""The report figure: one run's curves, or several runs on the same axes.

Seven panels, each titled: loss and accuracy against the epoch, accuracy against wall time, the learning rate,
the exchange share and data wait, the gradient noise scale B_noise (McCandlish et al. 2018: the batch size
beyond which larger batches stop paying off, next to the batch the run trains with), and every rank's
samples/s (the straggler view: a rank far below the others held a synchronous job back). Dashed lines are
training rows, solid ones validation rows; with several runs each has its colour, named in one legend below
the panels. Every line carries a ``gid`` of ``"<run>:<series>"`` (run index in the order given, series such as
``val_accuracy``), so the data behind the picture can be checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .run_data import RunData

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Panel titles, in the order of ``figure.axes``.
PANELS = (
    "loss",
    "accuracy",
    "accuracy over time",
    "learning rate",
    "exchange share and data wait",
    "gradient noise scale",
    "samples/s per rank",
)
#: ``(panel, series, table, x column, y column)`` of every curve drawn from the metrics tables.
CURVES = (
    ("loss", "train_loss", "train", "epoch", "loss"),
    ("loss", "val_loss", "val", "epoch", "loss"),
    ("accuracy", "train_accuracy", "train", "epoch", "accuracy"),
    ("accuracy", "val_accuracy", "val", "epoch", "accuracy"),
    ("accuracy over time", "train_accuracy_time", "train", "time", "accuracy"),
    ("accuracy over time", "val_accuracy_time", "val", "time", "accuracy"),
    ("learning rate", "lr", "train", "epoch", "lr"),
    ("exchange share and data wait", "exchange_share", "val", "epoch", "exchange_share"),
    ("exchange share and data wait", "data_wait", "train", "epoch", "data_wait"),
    ("gradient noise scale", "noise_scale", "train", "epoch", "noise_scale"),
)
X_LABELS = {"epoch": "epoch", "time": "seconds of training"}


def report_figure(runs: Sequence[RunData]) -> Figure:
    """The figure of ``runs`` (one: its report; several: compared on the same axes, one colour each)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    figure = Figure(figsize=(19, 8.5), layout="constrained")
    grid = list(figure.subplots(2, 4).flat)
    figure.delaxes(grid.pop())  # seven panels on a 2 x 4 grid
    axes = dict(zip(PANELS, grid, strict=True))
    for title, ax in axes.items():
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for index, run in enumerate(runs):
        colour = f"C{index}"
        for panel, series, table, x, y in CURVES:
            data = getattr(run, table)
            if y not in data or x not in data:
                continue
            style: dict[str, Any] = {"linestyle": "--" if table == "train" else "-", "marker": "."}
            label = series.replace("_time", "").replace("_", " ") if index == 0 else None  # styles, once
            line = axes[panel].plot(data[x], data[y], color=colour, label=label, **style)[0]
            line.set_gid(f"{index}:{series}")
            axes[panel].set_xlabel(X_LABELS[x])
        _global_batch(axes["gradient noise scale"], run, index)
        rates = run.rank_samples_per_second
        if rates:
            line = axes["samples/s per rank"].plot(np.arange(len(rates)), rates, "o", color=colour)[0]
            line.set_gid(f"{index}:rank_samples_per_second")
    ranks = axes["samples/s per rank"]
    ranks.set_xlabel("rank")
    ranks.set_ylim(bottom=0)  # a straggler shows as a point far below the others, not as a zoomed-in wiggle
    ranks.xaxis.get_major_locator().set_params(integer=True)
    axes["learning rate"].set_yscale("log")
    noise = axes["gradient noise scale"]
    noise.set_ylabel("B_noise (samples)")
    values = np.concatenate([np.asarray(line.get_ydata(), float) for line in noise.lines] or [np.zeros(0)])
    values = values[np.isfinite(values)]
    if values.size and (values > 0).all():  # B_noise spans orders of magnitude over a run
        noise.set_yscale("log")
    for ax in axes.values():
        if any(not line.get_label().startswith("_") for line in ax.lines):
            ax.legend(fontsize="small")
    if len(runs) == 1:
        figure.suptitle(runs[0].label)
    else:  # one colour per run, named once for the whole figure
        handles = [Line2D([], [], color=f"C{i}", linewidth=3, label=run.label) for i, run in enumerate(runs)]
        figure.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small")
    return figure


def _global_batch(ax: Any, run: RunData, index: int) -> None:
    """The batch one step trains over every rank (learners × batch size × ranks) as a dotted level on the
    noise-scale panel: well below B_noise a larger batch still pays off, well above it steps are wasted."""
    train = run.train
    if "noise_scale" not in train or not np.isfinite(train["noise_scale"]).any():
        return
    learners = float(train["learners"][-1]) if len(train.get("learners", ())) else 1.0
    batch = learners * run.batch_size * int(run.attrs.get("world_size", 1))
    label = "global batch" if index == 0 else None
    line = ax.axhline(batch, color=f"C{index}", linestyle=":", label=label)
    line.set_gid(f"{index}:global_batch")
