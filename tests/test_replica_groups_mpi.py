"""Replica groups under real ``mpiexec`` (``[link] groups = 3``): three MPI jobs of one rank each train the
digits job with BSP across the link; group 2's job is killed at step 40 (its only rank SIGKILLed: the whole
job goes, as with a lost node) and then started again, as a Slurm template restarts a lost group on a spare
node. Groups 0 and 1 train on within seconds, group 0 naming the lost group in one line; the restarted
group takes a peer's state at a step's boundary and trains with them to the end: every job ends with status
0 and the same model, bit for bit (BSP's replicas: every step's averaged gradient reached every group)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from slurm_cluster import free_ports

from conftest import REPO, launcher
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]

EPOCHS = 6


def test_a_killed_group_costs_itself_only_and_comes_back_with_a_peers_state(
    mpiexec: str, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    # every group's rank sleeps 0.1 s a step while a group is missing: the run goes on while group 2 restarts
    slowed = ["session.slow_ranks=0", "session.slow_seconds=0.1", "session.slow_while_short=true"]
    saved = "checkpoint.every_epochs=3"  # and the final one: each group's model at the end

    def group(g: int, *extra: str) -> subprocess.Popen[str]:
        args = [mpiexec, "-n", "1", *launcher(), "-cfg", "launch/digits.cfg", "link.groups=3",
                f"link.group={g}", f"link.address={address}", f"session.epochs={EPOCHS}",
                f"session.output={tmp_path / 'runs'}", saved, *slowed, *extra]  # fmt: skip
        return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

    procs = [group(0)]
    time.sleep(1.0)  # the rendezvous first
    procs += [group(1), group(2, "inject.rank=0", "inject.step=40", "inject.action=kill")]
    try:
        killed_out = procs[2].communicate(timeout=120)[0]
        restarted = time.monotonic()
        procs.append(group(2, "link.restarted=true"))  # as groups.sbatch starts a lost group again
        outs = [p.communicate(timeout=240)[0] for p in (procs[0], procs[1], procs[3])]
    finally:
        for p in procs:
            if p.poll() is None:  # mpiexec and its ranks: its whole session
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert procs[2].returncode != 0, killed_out
    assert [p.returncode for p in (procs[0], procs[1], procs[3])] == [0, 0, 0], outs
    lost = [line for line in outs[0].splitlines() if "link: group(s)" in line and "lost" in line]
    assert len(lost) == 1 and re.search(r"link: group\(s\) 2 on \S+ lost at sum \d+; 2 group", lost[0])
    killed = next(line for line in killed_out.splitlines() if "[inject] kill at step 40" in line)
    gap = datetime.strptime(lost[0][:8], "%H:%M:%S") - datetime.strptime(killed[:8], "%H:%M:%S")
    assert gap.total_seconds() <= 5, (killed, lost[0])  # the survivors went on within seconds
    # one line each side: the source group (0) handed over, the group back took it, at the same step
    handed = re.findall(r"link: group\(s\) 2 back at step (\d+) \(epoch (\d+)\): group 0 handed", outs[0])
    took = re.findall(r"link: group 2 back at step (\d+) \(epoch (\d+)\), its state from a peer", outs[2])
    assert len(handed) == 1 and handed == took, (handed, took, outs[2][-3000:])
    assert 40 < int(took[0][0]) and time.monotonic() - restarted < 200
    runs = tmp_path / "runs"
    folders = [next(runs.glob(f"*-group{g}")) for g in (0, 1)]
    (again,) = [p for p in runs.glob("*-group2") if any((p / "checkpoints").glob("step-*"))]  # the restart's
    folders.append(again)
    metrics = [read_metrics(folder / "metrics.h5") for folder in folders]
    assert list(metrics[0]["val"]["epoch"]) == list(range(1, EPOCHS + 1))
    back = list(metrics[2]["val"]["epoch"])  # the epochs the restarted group trained in
    assert back == list(range(int(took[0][1]), EPOCHS + 1)), back
    assert (metrics[0]["val"]["accuracy"] == metrics[1]["val"]["accuracy"]).all()
    assert (metrics[0]["val"]["accuracy"][-len(back) :] == metrics[2]["val"]["accuracy"]).all()
    assert metrics[0]["val"]["accuracy"][-1] >= 0.9, metrics[0]["val"]["accuracy"]
    finals = [sorted((folder / "checkpoints").glob("step-*"))[-1] for folder in folders]
    assert len({final.name for final in finals}) == 1, finals
    states = [torch.load(final / "rank-00000.pt", weights_only=True) for final in finals]
    params = [state["pool"]["learners"][0]["params"] for state in states]
    assert torch.equal(params[0], params[1]) and torch.equal(params[0], params[2])
