"""The parts of seeing a run that need no MPI job: the missing-package messages, the trace recorder's
window and limit, the timeline picture, what the reporter records of an elastic run's world, and the report's
panels and summary drawn from such a run (the elastic job itself: tests/test_see_a_run.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from mpicrossbow import trace
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.launch.world import World
from mpicrossbow.report.cli import main as report_main
from mpicrossbow.report.run_data import RunData, load_run
from mpicrossbow.report.summary import summary
from mpicrossbow.training.reporting.metrics import read_metrics
from mpicrossbow.training.reporting.reporting import Reporter
from mpicrossbow.training.reporting.tensorboard_log import check_available


def test_tensorboard_without_its_package_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'mpicrossbow\[tensorboard\]'"):
        check_available()


def test_report_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "crossbow-report: error: needs matplotlib (a dependency of mpicrossbow, missing here): "
        "pip install matplotlib\n"
    )


def test_the_recorder_keeps_nothing_when_off_and_stops_at_its_limit() -> None:
    recorder = trace.RECORDER
    assert not recorder.on
    with trace.span("off", "compute"):
        pass
    trace.instant("off", "gossip")
    assert recorder.take() == []
    recorder.start(limit=3)
    try:
        with trace.span("forward+backward", "compute", step=4):
            pass
        trace.complete("exchange", "exchange", 1.0, 1.5)
        trace.instant("gossip send", "gossip", to_rank=1)
        trace.instant("over the limit", "gossip")
    finally:
        recorder.stop()
    events = recorder.take()
    assert [(e[0], e[1], e[2], e[3]) for e in events] == [
        ("X", "forward+backward", "compute", "step"),
        ("X", "exchange", "exchange", "step"),
        ("i", "gossip send", "gossip", "messages"),
    ]
    assert events[0][6] == {"step": 4} and events[1][4:6] == (1.0, 0.5)


def test_the_timeline_picture_has_a_bar_per_span_and_a_row_per_track() -> None:
    pytest.importorskip("matplotlib")
    from mpicrossbow.report.timeline_figure import timeline_figure

    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "step"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 3, "args": {"name": "messages"}},
        {"ph": "X", "name": "forward+backward", "cat": "compute", "pid": 0, "tid": 0, "ts": 10.0, "dur": 5.0},
        {"ph": "X", "name": "exchange", "cat": "exchange", "pid": 0, "tid": 0, "ts": 15.0, "dur": 2.0},
        {"ph": "i", "name": "gossip send", "cat": "gossip", "pid": 0, "tid": 3, "ts": 16.0, "s": "t"},
    ]
    ax = timeline_figure(events).axes[0]
    assert len(ax.collections) == 2 and len(ax.lines) == 1
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 step", "rank 0 messages"]


START = World(rank=0, size=4, local_rank=0, local_size=4, node=0, nodes=1, hostname="h", launcher=None)
#: What the elastic digits job below records at its end: 3 survivors (start ranks 0, 1, 3) of 4, batch 16.
SURVIVORS = {
    "rank_steps_per_second": [51.4, 51.5, 51.6],
    "rank_exchange_share": [0.58, 0.61, 0.575],
    "rank_start_rank": [0, 1, 3],
}


def epochs(reporter: Reporter, first: int, last: int) -> None:
    """Epochs ``first``..``last`` (0-based) of 22 steps each, as the loop reports them."""
    for epoch in range(first, last + 1):
        for step in range(epoch * 22 + 1, epoch * 22 + 23):
            reporter.step_done(step)
        train, val, times = (1 / (epoch + 1), 0.9), (0.5, 0.9 + epoch / 100), (0.0, 0.01)
        reporter.epoch(epoch, (epoch + 1) * 22, 0.05, 1, train, val, times, 100.0 + 10 * epoch)


@pytest.fixture
def elastic_run(tmp_path: Path) -> Path:
    """A run folder as the digits job on 4 ranks writes it when start rank 2 is lost at step 40 (commit
    every step): the reporter's own rows and records; the per-rank attributes as the 3 survivors gather."""
    reporter = Reporter(load_config("launch/digits.cfg"), START, tmp_path, None)
    epochs(reporter, 0, 0)
    for step in range(23, 41):
        reporter.step_done(step)
    reporter.world = dataclasses.replace(START, size=3)  # what elastic training's recovery does
    epochs(reporter, 1, 3)
    reporter.close()
    with h5py.File(tmp_path / "metrics.h5", "a") as f:
        for key, value in SURVIVORS.items():
            f.attrs[key] = value
    return tmp_path


def test_the_reporter_records_the_world_of_every_epoch_and_where_it_changed(elastic_run: Path) -> None:
    metrics = read_metrics(elastic_run / "metrics.h5")
    assert metrics["train"]["world_size"].tolist() == [4, 3, 3, 3]
    ((step, before, after, seconds),) = metrics["attrs"]["world_changes"].tolist()
    assert (step, before, after) == (40, 4, 3) and 0 <= seconds <= metrics["train"]["time"][1]
    assert metrics["attrs"]["world_size"] == 4  # the size the job started with


def panels(run: RunData) -> dict[str, Any]:
    """The report figure of ``run``, its axes by title."""
    pytest.importorskip("matplotlib")
    from mpicrossbow.report.figure import PANELS, report_figure

    figure = report_figure([run])
    figure.canvas.draw()  # limits and labels settle as when saved
    assert [ax.get_title() for ax in figure.axes] == list(PANELS)
    return {ax.get_title(): ax for ax in figure.axes}


def bars(ax: Any, series: str) -> dict[int, Any]:
    """The bars of ``series`` by start rank."""
    ours = [p for p in ax.patches if str(p.get_gid()).startswith(f"0:{series}:")]
    return {int(p.get_gid().rsplit(":", 1)[1]): p for p in ours}


def test_the_per_rank_panels_are_bars_with_their_values_by_start_rank(elastic_run: Path) -> None:
    """samples/s (steps/s × batch 16) and exchange share: one bar per survivor at its start rank, its
    number above it inside the axes, the lost start rank 2 said so; the exchange's mean over ranks is the
    dashed line and the summary's figure, and the slowest and fastest rank are the summary's."""
    run = load_run(elastic_run)
    axes = panels(run)
    rates = axes["samples/s per rank"]
    drawn = bars(rates, "rank_samples_per_second")
    expected = dict(zip([0, 1, 3], np.asarray(SURVIVORS["rank_steps_per_second"]) * 16, strict=True))
    assert sorted(drawn) == [0, 1, 3]
    for rank, patch in drawn.items():
        assert patch.get_x() + patch.get_width() / 2 == pytest.approx(rank)
        assert patch.get_height() == pytest.approx(expected[rank])
    labels = [t.get_text() for t in rates.texts]
    assert [f"{v:,.0f}" for v in expected.values()] == [t for t in labels if t[0].isdigit()]
    assert any(t.startswith("lost") for t in labels)
    top = rates.get_ylim()[1]
    assert top >= 1.2 * max(expected.values())  # room for the numbers: no point on the top edge
    shares = axes["exchange share per rank"]
    assert [p.get_height() for p in bars(shares, "rank_exchange_share").values()] == SURVIVORS[
        "rank_exchange_share"
    ]
    (mean,) = [line for line in shares.lines if line.get_gid() == "0:exchange_share_mean"]
    assert mean.get_ydata()[0] == pytest.approx(np.mean(SURVIVORS["rank_exchange_share"]))
    assert shares.get_ylim()[1] > max(SURVIVORS["rank_exchange_share"])
    text = summary(run)
    figure = f"{run.exchange_share:.0%}"
    assert mean.get_label() == f"mean over ranks {figure}"
    assert f"exchange {figure} of training time (mean over ranks)" in text
    slow, fast = min(expected.items(), key=lambda kv: kv[1]), max(expected.items(), key=lambda kv: kv[1])
    assert f"slowest rank {slow[0]} {slow[1]:,.0f} samples/s, fastest rank {fast[0]} {fast[1]:,.0f}" in text


def test_an_elastic_loss_is_marked_on_every_time_axis_and_the_batch_follows_the_world(
    elastic_run: Path,
) -> None:
    """The loss at step 40 (epoch 1 + 18/22) is a line on every epoch panel and at its seconds on the time
    panel, labelled; the global batch is 64 for the epoch of 4 ranks, 48 (3 ranks × 16) after, and the
    summary says the same."""
    run = load_run(elastic_run)
    axes = panels(run)
    (change,) = run.world_changes
    assert (change.step, change.before, change.after) == (40, 4, 3)
    assert change.epoch == pytest.approx(1 + 18 / 22)
    for title, ax in axes.items():
        marks = [line for line in ax.lines if line.get_gid() == "0:world_change:0"]
        if title.endswith("per rank"):
            assert not marks
            continue
        where = change.seconds if ax.get_xlabel() == "seconds of training" else change.epoch
        assert [m.get_xdata()[0] for m in marks] == [pytest.approx(where)], title
    assert any("lost 1 rank: 4 \u2192 3\nfrom step 40" == t.get_text() for t in axes["loss"].texts)
    assert run.global_batches.tolist() == [64, 48, 48, 48]  # at each epoch's end
    noise = axes["gradient noise scale and global batch"]
    (batch,) = [line for line in noise.lines if line.get_gid() == "0:global_batch"]
    x, y = batch.get_xdata(), batch.get_ydata()  # drawn steps-post: y holds from its x to the next
    assert y[x < change.epoch].tolist() == [64, 64] and set(y[x >= change.epoch]) == {48}
    assert batch.get_label() == "global batch 64 \u2192 48"
    assert "elastic: lost 1 rank: 4 \u2192 3 ranks from step 40 (epoch 1.82), global batch 48" in summary(run)


def test_a_replacement_is_marked_too_and_the_batch_grows_back(elastic_run: Path) -> None:
    """Start rank 2 replaced at step 66 (epoch 3): a second marker, and the global batch 64 again."""
    with h5py.File(elastic_run / "metrics.h5", "a") as f:
        f.attrs["world_changes"] = [*f.attrs["world_changes"].tolist(), [66, 3, 4, 9.0]]
        f["train"]["world_size"][2:] = 4
    run = load_run(elastic_run)
    axes = panels(run)
    assert [c.text for c in run.world_changes] == ["lost 1 rank: 4 \u2192 3", "replaced: 3 \u2192 4"]
    (mark,) = [line for line in axes["loss"].lines if line.get_gid() == "0:world_change:1"]
    assert mark.get_xdata()[0] == pytest.approx(3.0)
    (batch,) = [
        line
        for line in axes["gradient noise scale and global batch"].lines
        if line.get_gid() == "0:global_batch"
    ]
    assert batch.get_label() == "global batch 64 \u2192 48 \u2192 64"
    assert "elastic: replaced: 3 \u2192 4 ranks from step 66 (epoch 3.00), global batch 64" in summary(run)


def test_every_point_lies_inside_its_panel(elastic_run: Path) -> None:
    """No curve, star or bar on or past an edge: each axis' limits hold every finite point drawn."""
    axes = panels(load_run(elastic_run))
    for title, ax in axes.items():
        low, high = ax.get_ylim()
        for line in ax.lines:
            if ":world_change:" in str(line.get_gid()) or line.get_gid() == "0:exchange_share_mean":
                continue
            y = np.asarray(line.get_ydata(), float)
            y = y[np.isfinite(y)]
            assert ((y > low) | (low == 0)).all() and (y < high).all(), (title, line.get_gid(), y, high)
        for patch in ax.patches:
            assert patch.get_height() < high, title


def test_the_summary_names_the_best_the_accuracy_panel_marks(elastic_run: Path) -> None:
    run = load_run(elastic_run)
    (star,) = [line for line in panels(run)["accuracy"].lines if line.get_gid() == "0:best_val_accuracy"]
    best, epoch, _ = run.best()
    assert star.get_xydata().tolist() == [[epoch, best]]
    assert f"best {best:.4f} at epoch {epoch:g}" in summary(run) and not math.isnan(best)
