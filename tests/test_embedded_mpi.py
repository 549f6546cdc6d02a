"""The embedded API under real ``mpiexec`` (and in a plain process): every rule inside the example script,
against crossbow-launch's own path; the API's checks at 1, 2 and 4 ranks; the failure protocol.

tests/mpi_scripts/embedded_runs.py trains each rule twice per launch — crossbow-launch's path, then
examples/train_digits.py's ``main`` — so torch starts once per rank for a whole group of rules.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_local, run_mpi, verdicts
from data.digits import digits_dataset

pytestmark = [pytest.mark.mpi]

SCRIPTS = Path(__file__).parent / "mpi_scripts"
#: The checks tests/mpi_scripts/embedded_checks.py runs (each says OK, SKIP or FAIL).
CHECKS = 13
#: Every synchronous rule: the example's final weights equal crossbow-launch's (observed: bitwise).
SYNCHRONOUS = ("BSP", "SMA", "EASGD", "LOCALSGD", "DILOCO")
#: Validation accuracy both paths reach on the digits in 4 epochs (chance is 0.1; DiLoCo is the slowest
#: rule here at 0.83, asynchronous rules end at 0.93-0.98 under both paths).
TARGET = 0.8
GROUPS = {
    1: ("BSP", "SMA"),
    2: ("BSP", "SMA", "EASGD", "GOSGD", "LOCALSGD", "DILOCO"),
    4: ("SMA", "ASGD", "SSP", "PSGD", "WEEDOUT", "GSP", "EASGD mode=async"),
}


def launch(mpiexec: str, n: int, args: list[str], timeout: float) -> str:
    """Run ``args`` on n ranks (n = 1: a plain process, no launcher); assert it succeeded; its stdout."""
    command = [sys.executable, *args]
    proc = run_local(command, timeout) if n == 1 else run_mpi(mpiexec, n, command, timeout)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("n", sorted(GROUPS))
def test_every_rule_in_the_example_script_matches_crossbow_launch(
    mpiexec: str, tmp_path: Path, n: int
) -> None:
    """The same target accuracy under both paths; a synchronous rule's final weights are crossbow-launch's."""
    launch(mpiexec, n, [str(SCRIPTS / "embedded_runs.py"), str(tmp_path), "4", *GROUPS[n]], 120 + 40 * n)
    rows = json.loads((tmp_path / "embedded.json").read_text())
    assert [row["rule"] for row in rows] == list(GROUPS[n])
    for row in rows:
        assert row["launch"] >= TARGET and row["embedded"] >= TARGET, row
        if row["rule"] in SYNCHRONOUS:
            assert row["max_weight_difference"] <= 1e-5, row


@pytest.mark.parametrize("n", [1, 2, 4])
def test_embedded_api_checks(mpiexec: str, tmp_path: Path, n: int) -> None:
    """tests/mpi_scripts/embedded_checks.py: every check passes (or does not apply) at n ranks."""
    stdout = launch(mpiexec, n, [str(SCRIPTS / "embedded_checks.py"), str(tmp_path)], 60 + 30 * n)
    found = verdicts(stdout)
    assert len(found) == CHECKS, stdout
    failed = {name: v for name, v in found.items() if not (v == "OK" or (n == 1 and v.startswith("SKIP")))}
    assert not failed, failed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_embedded_api_checks_on_a_gpu(tmp_path: Path) -> None:
    """The checks with every model, batch and flat buffer on CUDA device 0 (NCCL), in one process."""
    args = [sys.executable, str(SCRIPTS / "embedded_checks.py"), str(tmp_path)]
    proc = run_local(args, timeout=300, env={"EMBEDDED_DEVICES": "cuda0"})
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = verdicts(proc.stdout)
    assert len(found) == CHECKS and all(v == "OK" or v.startswith("SKIP") for v in found.values()), found


def test_the_example_runs_under_mpiexec_as_the_docs_say(mpiexec: str, tmp_path: Path) -> None:
    """``mpiexec -n 2 python examples/train_digits.py --rule SMA``: both ranks test the same z each epoch;
    rank 0 alone saves the final model."""
    saved = tmp_path / "model.pt"
    args = [
        sys.executable,
        "examples/train_digits.py",
        "--rule",
        "SMA",
        "--epochs",
        "2",
        "--save-model",
        str(saved),
    ]
    proc = run_mpi(mpiexec, 2, args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the launcher forwards each rank's output in chunks: two ranks' lines may share a line of stdout
    tests = re.findall(r"Test: average loss [\d.]+, accuracy \d+/\d+ \([\d.]+%\)", proc.stdout)
    assert len(tests) == 4 and all(tests.count(line) == 2 for line in tests), tests
    state = torch.load(saved, weights_only=True)
    assert set(state) == {
        "conv1.weight",
        "conv1.bias",
        "conv2.weight",
        "conv2.bias",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    }


def test_the_example_trains_mnist1d_in_one_plain_process() -> None:
    """``python examples/train_digits.py --dataset mnist1d``: no launcher, one rank, SMA; the accuracy rises
    well above chance (0.1) within 3 epochs (measured 0.62)."""
    args = [
        sys.executable,
        "examples/train_digits.py",
        "--dataset",
        "mnist1d",
        "--rule",
        "SMA",
        "--epochs",
        "3",
    ]
    proc = run_local(args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tests = [line for line in proc.stdout.splitlines() if line.startswith("Test:")]
    assert len(tests) == 3 and float(tests[-1].rsplit("(", 1)[1].rstrip("%)")) >= 50, tests


@pytest.mark.parametrize(
    ("mode", "words"),
    [
        ("raise", "failed: RuntimeError: injected failure in the user's loop (embedded_fail.py:"),
        ("unfinished", "reached the end of the script with RULE=BSP unfinished: call xb.finish()"),
    ],
)
def test_a_failing_rank_ends_the_job_with_one_line(mpiexec: str, mode: str, words: str) -> None:
    """Rank 1 raises, or leaves without xb.finish(), while rank 0 waits in BSP's allreduce: the job ends
    (no hang) with one line naming rank 1 and a non-zero status."""
    proc = run_mpi(mpiexec, 2, [sys.executable, str(SCRIPTS / "embedded_fail.py"), mode], timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpicrossbow: error:")]
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert len(lines) == 1 and "rank 1 of 2" in lines[0] and words in lines[0], proc.stderr[-2000:]
    if mode == "raise":
        traceback = Path(lines[0].rsplit("traceback in ", 1)[1])
        assert "injected failure" in traceback.read_text()
        traceback.unlink()
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("call", "line"),
    [
        (
            "xb.init(devices='gpu0')",
            "xb.init(devices='gpu0'): unknown device 'gpu0'; valid forms: cudaN, cpu, cpuN, host:cuda0,cuda1",
        ),
        ("xb.init(bind='tight')", "xb.init(bind='tight'): 'tight' is not valid; choose one of none, core, "),
    ],
)
def test_a_bad_init_argument_is_one_line_naming_the_argument(mpiexec: str, call: str, line: str) -> None:
    """``mpiexec -n 2`` of a script whose xb.init gets a bad ``devices=`` or ``bind=``: rank 0 prints one
    line naming the argument as written (not crossbow-launch's DEVICES / [numa] bind), every rank exits 2."""
    script = f"import mpicrossbow as xb\n{call}\nprint('NOT REACHED')\n"
    proc = run_mpi(mpiexec, 2, [sys.executable, "-c", script], timeout=90)
    lines = [text for text in proc.stderr.splitlines() if text.startswith("mpicrossbow: error: ")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"mpicrossbow: error: {line}"), proc.stderr[-2000:]
    assert "NOT REACHED" not in proc.stdout and "Traceback" not in proc.stderr


def test_a_second_xb_init_that_asks_for_more_is_one_line_and_leaves_nothing(
    mpiexec: str, tmp_path: Path
) -> None:
    """``xb.init()`` then ``xb.init(bind="core")`` on 2 ranks (issue 51): rank 0 alone prints the line, every
    rank exits 2, and no shared-memory segment nor traceback folder is left (it was one line per rank, a
    /dev/shm segment and a traceback folder)."""
    script = "import mpicrossbow as xb\nxb.init()\nxb.init(bind='core')\nprint('NOT REACHED')\n"
    job = [mpiexec, "-n", "2", sys.executable, "-c", script]
    private = os.geteuid() == 0 and shutil.which("unshare") is not None
    shm_before = set(os.listdir("/dev/shm"))
    if private:  # the job alone in a /dev/shm of its own: what it leaves is exactly what is there after it
        listing = 'rc=0; "$@" || rc=$?; echo "SHM_LEFT:$(ls -A /dev/shm | tr "\\n" " ")"; exit $rc'
        mount = "mount -t tmpfs -o size=256m shm /dev/shm && "
        job = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount + listing, "sh", *job]
    proc = run_local(job, timeout=90, env={"TMPDIR": str(tmp_path)})
    lines = [text for text in proc.stderr.splitlines() if text.startswith("mpicrossbow: error: ")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = "mpicrossbow: error: xb.init(bind='core'): xb.init already ran in this process with bind='none'"
    assert len(lines) == 1 and lines[0].startswith(said), proc.stderr[-2000:]
    assert "NOT REACHED" not in proc.stdout and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
    if private:
        left = [line.split(":", 1)[1].split() for line in proc.stdout.splitlines() if "SHM_LEFT:" in line]
        assert left == [[]], proc.stdout[-2000:]
    else:  # the host's /dev/shm: right when no other job runs beside this one
        assert set(os.listdir("/dev/shm")) - shm_before == set()


@pytest.mark.parametrize("n", [2, 3])
def test_the_horovod_port_counts_every_test_sample_and_averages_with_xb_allreduce(
    mpiexec: str, n: int
) -> None:
    """examples/horovod_port.py (Horovod's pytorch_mnist.py on the embedded API, issue 51) at 2 and 3 ranks:
    the evaluation shares hold every sample of the digits' validation set once (uneven at 3 ranks), the
    printed accuracy is the sum of the ranks' hits over that total, it trains, and the port reaches into
    no MPI object of its own."""
    source = (REPO / "examples" / "horovod_port.py").read_text(encoding="utf-8")
    assert ".mpi" not in source and "mpi4py" not in source
    proc = run_mpi(mpiexec, n, [sys.executable, "examples/horovod_port.py", "--epochs", "3"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (last,) = re.findall(r"epoch 3: test set (\d+) samples: .* accuracy ([0-9.]+) %", proc.stdout)
    ranks = re.findall(r"rank (\d+): (\d+) test samples, (\d+) correct", proc.stdout)[-n:]
    assert sorted(int(r) for r, _, _ in ranks) == list(range(n))
    counts = [int(c) for _, c, _ in ranks]
    assert sum(counts) == int(last[0]) == len(digits_dataset("val")) and max(counts) - min(counts) <= 1
    assert float(last[1]) == pytest.approx(100 * sum(int(h) for _, _, h in ranks) / sum(counts), abs=0.006)
    assert float(last[1]) > 50, proc.stdout[-2000:]
    # the run's last line names what it wrote; the embedded API writes no metrics.h5, so none is named
    (ended,) = [line for line in proc.stderr.splitlines() if "RULE=BSP finished after" in line]
    assert ended.endswith(
        "; mpicrossbow wrote no files (no run folder, no metrics.h5): save the model yourself"
    )
    assert "metrics.h5 holds" not in proc.stderr
