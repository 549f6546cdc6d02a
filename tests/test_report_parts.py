"""The parts of seeing a run that need no MPI job: the missing-package messages, the trace recorder's
window and limit, and the timeline picture."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from mpicrossbow import trace
from mpicrossbow.errors import ConfigError
from mpicrossbow.report.cli import main as report_main
from mpicrossbow.training.tensorboard_log import check_available


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
    assert (
        capsys.readouterr().err
        == "crossbow-report: error: needs matplotlib: pip install 'mpicrossbow[report]'\n"
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
