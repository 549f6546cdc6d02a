"""Seeing a run: the progress bar through a pseudo-terminal, ``crossbow-report``'s figure against
metrics.h5 (of the default job, and of an elastic job that loses a rank), TensorBoard's own reader against
metrics.h5, and the Chrome-trace timeline of a BSP and a GOSGD run (tests/mpi_scripts/digits_runs.py: two
digits runs in one MPI job)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, launcher, mpi_env, only_run, run_local, run_mpi
from mpicrossbow.report.cli import main as report_main
from mpicrossbow.report.figure import PANELS
from mpicrossbow.report.run_data import load_run
from mpicrossbow.training.reporting.metrics import read_metrics
from openmpi_env import OpenMPIEnv

pytestmark = [pytest.mark.mpi]
SCRIPTS = Path(__file__).parent / "mpi_scripts"


def through_a_terminal(args: list[str], timeout: float) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on a pseudo-terminal, as at a person's shell; (status, output)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
    env = mpi_env()
    for inherited in ("COLUMNS", "LINES"):  # pytest-xdist's workers set 80 x 24; the terminal is 120 wide
        env.pop(inherited, None)
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdin=child, stdout=child, stderr=child)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the other end is closed: every process that held it has ended
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif proc.poll() is not None:
            break
    os.close(main)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = -9
    return code, b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``crossbow-launch -cfg launch/digits.cfg`` at a terminal: (its run folder, what the terminal shows)."""
    out = tmp_path_factory.mktemp("default")
    code, shown = through_a_terminal([*launcher(), "-cfg", "launch/digits.cfg", f"session.output={out}"], 180)
    assert code == 0, shown[-3000:]
    return only_run(out), shown


def test_a_person_at_a_terminal_sees_the_bar(default_job: tuple[Path, str]) -> None:
    """Rank 0's bar reaches the terminal through the launcher's mpiexec: carriage returns, samples/s, the
    epoch and loss in its postfix, ending at 100 %."""
    _, shown = default_job
    assert "\r" in shown and "sample/s" in shown and "100%" in shown, shown[-2000:]
    assert re.search(r"epoch 20 loss \d\.\d{4} val acc \d\.\d{4}\]", shown), shown[-2000:]


def test_output_to_a_file_is_one_line_per_epoch(tmp_path: Path) -> None:
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={tmp_path}", "session.epochs=3"]
    proc = run_local(args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr + proc.stdout
    epochs = [line for line in proc.stderr.splitlines() if re.search(r"INFO epoch \d+ step \d+:", line)]
    assert len(epochs) == 3, proc.stderr[-3000:]


def test_the_report_draws_what_metrics_h5_holds(
    default_job: tuple[Path, str], capsys: pytest.CaptureFixture
) -> None:
    """crossbow-report on the default job's folder: report.png and .svg, and every curve's data is the
    metrics table's; the summary names the best accuracy."""
    folder, _ = default_job
    assert report_main([str(folder)]) == 0
    assert (folder / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (
        folder / "report.svg"
    ).is_file()
    assert "best " in capsys.readouterr().out
    from mpicrossbow.report.figure import CURVES, report_figure

    metrics = read_metrics(folder / "metrics.h5")
    figure = report_figure([load_run(folder)])
    assert [ax.get_title() for ax in figure.axes] == list(PANELS)
    lines = {line.get_gid(): line for ax in figure.axes for line in ax.lines}
    for _, series, table, x, y in CURVES:
        xy = lines[f"0:{series}"].get_xydata()
        np.testing.assert_array_equal(xy[:, 0], metrics[table][x])
        np.testing.assert_array_equal(xy[:, 1], metrics[table][y])
    ranks = figure.axes[PANELS.index("samples/s per rank")]
    bars = [p for p in ranks.patches if str(p.get_gid()).startswith("0:rank_samples_per_second:")]
    expected = np.asarray(metrics["attrs"]["rank_steps_per_second"]) * 16  # batch 16, 1 learner per rank
    np.testing.assert_allclose([p.get_height() for p in bars], expected)
    assert ranks.get_ylim()[1] > max(expected)  # every bar and its number inside the panel
    assert len(bars) == int(metrics["attrs"]["world_size"]) and len(metrics["train"]["epoch"]) == 20
    assert metrics["train"]["world_size"].tolist() == [2] * 20 and "world_changes" not in metrics["attrs"]


def test_report_compares_runs_and_refuses_a_folder_without_metrics(
    default_job: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder, _ = default_job
    compare = tmp_path / "both.png"
    assert report_main([str(folder), str(folder), "--compare", str(compare)]) == 0 and compare.is_file()
    assert report_main([str(tmp_path)]) == 2
    assert "no metrics.h5 here" in capsys.readouterr().err


def test_the_report_of_an_elastic_job_marks_the_loss_and_the_smaller_world(
    openmpi: OpenMPIEnv, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The digits job on 4 ranks under ULFM, start rank 2 killed at step 40, a commit every step (so the
    survivors go on from step 40 itself): metrics.h5 records 4 ranks for epoch 1 and 3 after, and the loss at
    step 40; the report marks it at epoch 40/22 of the loss panel, the global batch goes from 64 to 48
    (3 ranks × batch 16), the per-rank bars stand at start ranks 0, 1 and 3, and the summary says the same."""
    overrides = ["session.epochs=3", "elastic.enabled=true", "elastic.commit_every=1"]
    overrides += ["inject.rank=2", "inject.step=40", "inject.action=kill"]
    args = [openmpi.launch, "-cfg", "launch/digits.cfg", f"session.output={tmp_path}", *overrides]
    proc = run_local(openmpi.ft_command(4, *args), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = only_run(tmp_path)
    metrics = read_metrics(folder / "metrics.h5")
    assert metrics["train"]["world_size"].tolist() == [4, 3, 3]
    assert metrics["attrs"]["world_changes"][:, :3].tolist() == [[40, 4, 3]]
    assert metrics["attrs"]["rank_start_rank"].tolist() == [0, 1, 3]
    assert report_main([str(folder)]) == 0
    said = capsys.readouterr().out
    assert "elastic: lost 1 rank: 4 \u2192 3 ranks from step 40 (epoch 1.82), global batch 48" in said, said
    from mpicrossbow.report.figure import report_figure

    run = load_run(folder)
    figure = report_figure([run])
    axes = {ax.get_title(): ax for ax in figure.axes}
    (mark,) = [line for line in axes["loss"].lines if line.get_gid() == "0:world_change:0"]
    assert mark.get_xdata()[0] == pytest.approx(40 / 22)
    (batch,) = [
        line for line in axes["gradient noise scale and global batch"].lines if "batch" in line.get_gid()
    ]
    x, y = batch.get_xdata(), batch.get_ydata()
    assert set(y[x < 40 / 22]) == {64} and set(y[x >= 40 / 22]) == {48}
    bars = axes["samples/s per rank"].patches
    assert sorted(int(p.get_gid().rsplit(":", 1)[1]) for p in bars) == [0, 1, 3]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, mpiexec: str) -> tuple[Path, str]:
    """A BSP and a GOSGD digits run on 2 ranks with TensorBoard and a 20-step timeline: (out, stderr)."""
    out = tmp_path_factory.mktemp("traced")
    args = [
        sys.executable,
        str(SCRIPTS / "digits_runs.py"),
        str(out),
        "BSP=RULE=BSP",
        "GOSGD=RULE=GOSGD",
        "--",
        "session.epochs=2",
        "session.tensorboard=true",
        "session.timeline=20",
    ]
    proc = run_mpi(mpiexec, 2, args, timeout=180)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    return out, proc.stderr


def test_tensorboards_reader_reads_the_scalars_of_metrics_h5(traced: tuple[Path, str]) -> None:
    pytest.importorskip("tensorboard", reason="pip install 'mpicrossbow[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = only_run(traced[0] / "BSP")
    metrics = read_metrics(folder / "metrics.h5")
    events = EventAccumulator(str(folder / "tb")).Reload()
    for table in ("train", "val"):
        for column, values in metrics[table].items():
            if column == "step":
                continue
            scalars = events.Scalars(f"{table}/{column}")
            assert [s.step for s in scalars] == metrics[table]["step"].astype(int).tolist()
            np.testing.assert_allclose([s.value for s in scalars], values, rtol=1e-6)
    assert "config" in events.Tags()["tensors"] or "config/text_summary" in events.Tags()["tensors"]
    assert len(events.Scalars("rank1/steps_per_second")) == 1


def test_the_timeline_is_a_chrome_trace_whose_exchange_is_the_logs(traced: tuple[Path, str]) -> None:
    """One process (track group) per rank; the exchange spans of rank 0 over the window sum to the
    exchange seconds the log line reports, within 10 %; 20 steps of forward+backward per rank."""
    out, stderr = traced
    folder = only_run(out / "BSP")
    trace = json.loads((folder / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        steps = [e for e in trace if e["pid"] == rank and e["name"] == "forward+backward"]
        assert len(steps) == 20 and all(e["dur"] > 0 for e in steps)
    logged = re.search(
        rf"timeline of steps 1-20 on 2 rank\(s\): {re.escape(str(folder))}.* exchange ([\d.]+) s", stderr
    )
    assert logged, stderr[-3000:]
    spans = sum(e["dur"] for e in trace if e["pid"] == 0 and e.get("cat") == "exchange") / 1e6
    assert spans == pytest.approx(float(logged[1]), rel=0.1)


def test_the_gossip_timeline_shows_its_messages(traced: tuple[Path, str]) -> None:
    trace = json.loads((only_run(traced[0] / "GOSGD") / "timeline.json").read_text())["traceEvents"]
    sends = [e for e in trace if e["name"] == "gossip send"]
    merges = [e for e in trace if e["name"] == "gossip merge"]
    assert sends and merges and {e["pid"] for e in sends} == {0, 1}
    assert all(e["ph"] == "i" and e["args"]["to_rank"] != e["pid"] for e in sends)
