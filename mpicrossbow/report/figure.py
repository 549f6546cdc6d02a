"""The report figure: one run's curves, or several runs on the same axes.

Eight panels, each titled: loss and accuracy against the epoch (the best validation accuracy marked with its
value), accuracy against wall time, the learning rate, rank 0's exchange share and data wait per epoch, the
gradient noise scale B_noise (McCandlish et al. 2018: the batch size beyond which larger batches stop paying
off) beside the global batch the run trains with, every rank's samples/s (the straggler view: a rank far
below the others held a synchronous job back) and every rank's exchange share with their mean — the mean the
summary prints. Bars carry their numbers and every axis leaves room above its highest point, so nothing sits
on an edge. Dashed lines are training rows, solid ones validation rows; with several runs each has its
colour, named in one legend below the panels.

An elastic run's changes of world (a rank lost, a replacement joined) are a vertical line with its label
on every panel with a time axis (epoch or seconds), and the global batch follows the world epoch by epoch.
The per-rank panels name ranks by their start rank, a lost one by a gap saying so.

Every line carries a ``gid`` of ``"<run>:<series>"`` (run index in the order given, series such as
``val_accuracy``), every bar one of ``"<run>:<series>:<start rank>"``, so the data behind the picture can be
checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .run_data import RunData

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Panel titles, in the order of ``figure.axes``.
PANELS = (
    "loss",
    "accuracy",
    "accuracy over time",
    "learning rate",
    "exchange share and data wait (rank 0)",
    "gradient noise scale and global batch",
    "samples/s per rank",
    "exchange share per rank",
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
    ("exchange share and data wait (rank 0)", "exchange_share", "val", "epoch", "exchange_share"),
    ("exchange share and data wait (rank 0)", "data_wait", "train", "epoch", "data_wait"),
    ("gradient noise scale and global batch", "noise_scale", "train", "epoch", "noise_scale"),
)
#: Legend entries where the series name alone would not say what the curve is.
LABELS = {
    "exchange_share": "exchange (of the time so far)",
    "data_wait": "data wait (of the epoch)",
    "noise_scale": "B_noise",
}
X_LABELS = {"epoch": "epoch", "time": "seconds of training"}
#: The x axis of every panel with a time axis (the per-rank panels have none).
TIME_AXES = {panel: X_LABELS[x] for panel, _, _, x, _ in CURVES}
#: Room above the highest point of a panel, as a fraction of it (bar labels and markers' text fit there).
HEADROOM = 0.25


def report_figure(runs: Sequence[RunData]) -> Figure:
    """The figure of ``runs`` (one: its report; several: compared on the same axes, one colour each)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    figure = Figure(figsize=(20, 9.5), layout="constrained")
    axes = dict(zip(PANELS, figure.subplots(2, 4).flat, strict=True))
    for title, ax in axes.items():
        ax.set_title(title)
        ax.set_xlabel(TIME_AXES.get(title, "start rank"))
        ax.grid(alpha=0.3)
    for index, run in enumerate(runs):
        colour = f"C{index}"
        for panel, series, table, x, y in CURVES:
            data = getattr(run, table)
            if y not in data or x not in data or not np.isfinite(data[y]).any():
                continue  # not recorded, or never measured (B_noise off): no empty legend entry
            style: dict[str, Any] = {"linestyle": "--" if table == "train" else "-", "marker": "."}
            label = LABELS.get(series, series.replace("_time", "").replace("_", " ")) if index == 0 else None
            line = axes[panel].plot(data[x], data[y], color=colour, label=label, **style)[0]
            line.set_gid(f"{index}:{series}")
        _best(axes["accuracy"], run, index)
        _global_batch(axes["gradient noise scale and global batch"], run, index, len(runs))
        _rank_bars(axes["samples/s per rank"], run, index, len(runs), "rank_samples_per_second")
        _rank_bars(axes["exchange share per rank"], run, index, len(runs), "rank_exchange_share")
        _world_changes(axes, run, index, len(runs))
    _finish_axes(axes, runs)
    if len(runs) == 1:
        figure.suptitle(runs[0].label)
    else:  # one colour per run, named once for the whole figure
        handles = [Line2D([], [], color=f"C{i}", linewidth=3, label=run.label) for i, run in enumerate(runs)]
        figure.legend(handles=handles, loc="outside lower center", ncols=2, fontsize="small")
    return figure


def _finish_axes(axes: dict[str, Axes], runs: Sequence[RunData]) -> None:
    """Scales, tick formats, limits with headroom and legends, once every run is drawn."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    for ax in axes.values():
        if ax.get_xlabel() in ("epoch", "start rank"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _plain_log(axes["learning rate"])
    noise = axes["gradient noise scale and global batch"]
    noise.set_ylabel("samples")
    values = np.concatenate([np.asarray(line.get_ydata(), float) for line in _data_lines(noise)] or [[]])
    values = values[np.isfinite(values)]
    if values.size and (values > 0).all() and values.max() > 4 * values.min():  # B_noise spans decades
        _plain_log(noise)
        noise.set_ylim(values.min() / 1.3, values.max() * 2.0)
    elif values.size:
        noise.set_ylim(0, values.max() * (1 + HEADROOM))
    if not any(np.isfinite(run.train.get("noise_scale", np.zeros(0))).any() for run in runs):
        noise.text(0.5, 0.5, "B_noise not measured", transform=noise.transAxes, ha="center", color="grey")
    share = axes["exchange share and data wait (rank 0)"]
    _headroom(share)
    share.yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
    axes["exchange share per rank"].yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
    for panel in ("samples/s per rank", "exchange share per rank"):
        ax = axes[panel]
        ax.grid(axis="x", visible=False)
        _headroom(ax)
    axes["samples/s per rank"].set_ylabel("training samples/s")
    for ax in axes.values():
        if any(not artist.get_label().startswith("_") for artist in [*ax.lines, *ax.containers]):
            ax.legend(fontsize="small", loc="best")


def _headroom(ax: Axes) -> None:
    """From 0 to :data:`HEADROOM` above the highest line or bar (a straggler shows as a bar far below the
    others, not as a zoomed-in wiggle; labels above the bars fit)."""
    tops = [np.nanmax(np.asarray(line.get_ydata(), float), initial=0.0) for line in _data_lines(ax)]
    tops += [patch.get_height() for patch in ax.patches if np.isfinite(patch.get_height())]
    top = max([t for t in tops if np.isfinite(t)], default=0.0)
    ax.set_ylim(0, top * (1 + HEADROOM) if top > 0 else 1.0)


def _data_lines(ax: Axes) -> list[Any]:
    """The lines of ``ax`` that hold data (not the world-change markers, whose y runs over the axes)."""
    return [line for line in ax.lines if ":world_change:" not in str(line.get_gid())]


def _plain_log(ax: Axes) -> None:
    """A log scale whose ticks read as plain numbers (1, 2, 5 per decade: ``0.05``, ``200``), not
    ``5×10⁻²``."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _best(ax: Axes, run: RunData, index: int) -> None:
    """The best validation accuracy as a star with its value and epoch — the summary's ``best``."""
    accuracy, epoch, _ = run.best()
    if math.isnan(accuracy):
        return
    line = ax.plot([epoch], [accuracy], "*", color=f"C{index}", markersize=12)[0]
    line.set_gid(f"{index}:best_val_accuracy")
    ax.annotate(
        f"best {accuracy:.4f} (epoch {epoch:g})",
        (epoch, accuracy),
        xytext=(0, -18 - 12 * index),  # several runs' labels one under the other
        textcoords="offset points",
        ha="center",
        fontsize="small",
        color=f"C{index}",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
    )


def _global_batch(ax: Axes, run: RunData, index: int, runs: int) -> None:
    """The batch one step trains over every rank (learners × batch size × ranks) at each epoch, dotted, with
    its value where it starts and wherever it changes (an elastic loss, the auto-tuner): well below B_noise
    a larger batch still pays off, well above it steps are wasted. B_noise's last estimate gets its value
    too (the summary's)."""
    train = run.train
    epochs, batches = run.global_batch_steps()
    if not len(epochs):
        return
    starts = [i for i, batch in enumerate(batches) if i == 0 or batch != batches[i - 1]]
    levels = " \u2192 ".join(f"{batches[i]:,.0f}" for i in starts)
    label = None if index else "global batch" + (f" {levels}" if runs == 1 else "")
    line = ax.plot(epochs, batches, color=f"C{index}", linestyle=":", drawstyle="steps-post", label=label)[0]
    line.set_gid(f"{index}:global_batch")
    for i in starts:
        ax.annotate(
            f"{batches[i]:,.0f}",
            (epochs[i], batches[i]),
            xytext=(6, 4),
            textcoords="offset points",
            fontsize="small",
            color=f"C{index}",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    noise = np.asarray(train.get("noise_scale", ()), float)
    finite = np.flatnonzero(np.isfinite(noise))
    if finite.size:
        last = finite[-1]
        ax.annotate(
            f"{noise[last]:,.0f}",
            (train["epoch"][last], noise[last]),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize="small",
            color=f"C{index}",
        )


def _rank_bars(ax: Axes, run: RunData, index: int, runs: int, series: str) -> None:
    """One bar per rank at its start rank (several runs side by side), its value above it; a serving rank
    (NaN) and a lost one say so instead of a bar. The exchange panel also gets the mean over the training
    ranks as a dashed line — the figure the summary prints."""
    values = run.rank_samples_per_second if series == "rank_samples_per_second" else run.rank_exchange_shares
    if not values:
        return
    width = 0.8 / runs
    offset = (index - (runs - 1) / 2) * width
    ranks = run.start_ranks
    shown = [(r, v) for r, v in zip(ranks, values, strict=True) if not math.isnan(v)]
    colour = f"C{index}"
    if shown:
        bars = ax.bar([r + offset for r, _ in shown], [v for _, v in shown], width * 0.9, color=colour)
        for (rank, _), patch in zip(shown, bars.patches, strict=True):
            patch.set_gid(f"{index}:{series}:{rank}")
        many = len(ranks) * runs > 8
        ax.bar_label(
            bars,
            labels=[_value(series, v) for _, v in shown],
            padding=2,
            fontsize="x-small" if many else "small",
            rotation=90 if many else 0,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},  # over the mean's line
        )
    text: dict[str, Any] = {"rotation": 90, "ha": "center", "va": "bottom", "fontsize": "small"}
    text["transform"] = ax.get_xaxis_transform()  # x: the rank; y: a fraction of the panel's height
    for rank, value in zip(ranks, values, strict=True):
        if math.isnan(value):
            ax.text(rank + offset, 0.04, "serves (no training steps)", **text)
    lost = [c for c in run.world_changes if c.after < c.before]
    when = f", gone from step {lost[0].step}" if len(lost) == 1 else ""
    for rank in run.lost_ranks:
        ax.text(rank + offset, 0.04, f"lost{when}", color="red", **text)
    low, high = ax.get_xlim() if ax.patches or ax.texts else (math.inf, -math.inf)
    last = max([run.start_size - 1, *ranks])
    ax.set_xlim(min(low, -0.6), max(high, last + 0.6))  # every start rank has its place, bar or not
    if series == "rank_exchange_share" and not math.isnan(run.exchange_share):
        label = f"mean over ranks {_value(series, run.exchange_share)}"
        line = ax.axhline(run.exchange_share, color=colour, linestyle="--", linewidth=1, label=label)
        line.set_gid(f"{index}:exchange_share_mean")


def _value(series: str, value: float) -> str:
    """A bar's label: samples/s as a whole number, a share in per cent (as the summary prints them)."""
    return f"{value:.0%}" if series == "rank_exchange_share" else f"{value:,.0f}"


def _world_changes(axes: dict[str, Axes], run: RunData, index: int, runs: int) -> None:
    """Each change of an elastic run's world as a vertical line on every panel with a time axis, labelled
    (``lost 1 rank: 4 → 3``, with the step) at the top of the loss and accuracy-over-time panels. It stands
    where the new world went on: a loss met inside a commit window (``[elastic] commit_every``) drops that
    window's steps, so the line is at the window's end, at most that many steps after the death. Red for a
    loss, green for a replacement; with several runs, the run's colour."""
    for number, change in enumerate(run.world_changes):
        colour = f"C{index}" if runs > 1 else "red" if change.after < change.before else "green"
        for title, ax in axes.items():
            x = {"epoch": change.epoch, "seconds of training": change.seconds}.get(ax.get_xlabel())
            if x is None:
                continue
            line = ax.axvline(x, color=colour, linestyle="-.", linewidth=1.2, alpha=0.8)
            line.set_gid(f"{index}:world_change:{number}")
            if title in ("loss", "accuracy over time"):
                ax.annotate(
                    f"{change.text}\nfrom step {change.step}",
                    (x, 1),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, -4 - 24 * number),  # two lines each: several changes one under the other
                    textcoords="offset points",
                    va="top",
                    fontsize="small",
                    color=colour,
                )
