"""Replica groups under real ``mpiexec`` (``[link] groups = 3``): three MPI jobs of one rank each train the
digits job with BSP across the link, and group 2's job is killed at step 40 (its only rank SIGKILLed: the
whole job goes, as with a lost node). Groups 0 and 1 finish with status 0, group 0 says in one line which
group was lost, and both end with the same model (the link's sums reach every group alike)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from slurm_cluster import free_ports

from conftest import REPO, launcher
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]

EPOCHS = 6


def test_a_killed_group_costs_itself_only_and_the_others_finish_alike(mpiexec: str, tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    procs = []
    for g in range(3):
        args = [mpiexec, "-n", "1", *launcher(), "-cfg", "launch/digits.cfg", "link.groups=3",
                f"link.group={g}", f"link.address={address}", f"session.epochs={EPOCHS}",
                f"session.output={tmp_path / 'runs'}"]  # fmt: skip
        if g == 2:
            args += ["inject.rank=0", "inject.step=40", "inject.action=kill"]
        out = subprocess.PIPE
        procs.append(subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # fmt: skip
        if g == 0:
            time.sleep(1.0)  # the rendezvous first
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # mpiexec and its ranks: its whole session
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [p.returncode for p in procs[:2]] == [0, 0] and procs[2].returncode != 0, outs
    lost = [line for line in outs[0].splitlines() if "link: group(s)" in line]
    assert len(lost) == 1 and re.search(r"link: group\(s\) 2 on \S+ lost at sum \d+; 2 group", lost[0])
    killed = next(line for line in outs[2].splitlines() if "[inject] kill at step 40" in line)
    gap = datetime.strptime(lost[0][:8], "%H:%M:%S") - datetime.strptime(killed[:8], "%H:%M:%S")
    assert gap.total_seconds() <= 5, (killed, lost[0])  # the survivors went on within seconds
    metrics = [read_metrics(next((tmp_path / "runs").glob(f"*-group{g}")) / "metrics.h5") for g in (0, 1)]
    assert len(metrics[0]["val"]["accuracy"]) == EPOCHS
    assert (metrics[0]["val"]["accuracy"] == metrics[1]["val"]["accuracy"]).all()
    assert (metrics[0]["val"]["loss"] == metrics[1]["val"]["loss"]).all()
    assert metrics[0]["val"]["accuracy"][-1] >= 0.9, metrics[0]["val"]["accuracy"]
