"""The command line a benchmark writes into benchmarks/results/*.md (benchmarks/report.py): it reruns as
written, an argument with a space in it quoted."""

from __future__ import annotations

import shlex
import sys

import pytest

from benchmarks.report import command


def test_the_recorded_command_quotes_what_the_shell_would_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--configs 'period 4,period 16'`` comes back as one argument when split as a shell does."""
    monkeypatch.delenv("MPICROSSBOW_BENCH_COMMAND", raising=False)
    monkeypatch.setattr(sys, "argv", ["epochs_to_target.py", "--configs", "period 4,period 16"])
    line = command()
    assert shlex.split(line)[-2:] == ["--configs", "period 4,period 16"], line
    monkeypatch.setenv("MPICROSSBOW_BENCH_COMMAND", "python -m benchmarks.links --rules LOCALSGD")
    assert command() == "python -m benchmarks.links --rules LOCALSGD"  # as relaunch passed it down
