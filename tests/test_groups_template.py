"""launch/slurm/groups.sbatch's own logic, run by bash with the variables Slurm sets and stand-ins for
``srun`` and ``scontrol``: a group that group 0 finds lost (its line in ``$CROSSBOW_LOST_GROUPS_FILE``, as
crossbow-launch's group 0 writes it) is started again on the next spare node, its old srun — hanging, as a
lost node's does until Slurm declares the node down — ended; without a spare the others go on and the job
says so. No Slurm needed; the template under a real Slurm is tests/test_slurm_netns.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

TEMPLATE = REPO / "launch" / "slurm" / "groups.sbatch"
VENV = Path(sys.executable).parent.parent

#: A stand-in srun: logs ``start <group> <node> <pid> <args>``, then plays its part. Group 0 reports group 2
#: lost a second in, then waits (at most 20 s) until group 2 was started on node4 when there is one, and
#: finishes 2.5 s later (0.5 s let the template's once-a-second look miss the line under load); group 1
#: finishes; group 2 on node3 hangs (a lost node's srun) or, with GROUP2_FAILS, ends with status 1; group 2
#: started elsewhere finishes.
SRUN = r"""#!/bin/bash
node=""
for arg in "$@"; do [[ "$arg" == --nodelist=* ]] && node=${arg#--nodelist=}; done
echo "start $CROSSBOW_GROUP $node $$ $*" >> "$SRUN_LOG"
case "$CROSSBOW_GROUP $node" in
"0 node1")
    sleep 1
    echo "2 node3" >> "$CROSSBOW_LOST_GROUPS_FILE"
    if [[ "$NODES" == *node4* ]]; then
        for _ in {1..200}; do grep -q "^start 2 node4" "$SRUN_LOG" && break; sleep 0.1; done
    fi
    sleep 2.5 ;; # past two of the template's looks at the file (once a second), also on a busy machine
"1 node2") sleep 2 ;;
"2 node3") if [[ -n "${GROUP2_FAILS:-}" ]]; then sleep 2; exit 1; fi; exec sleep 600 ;;
esac
exit 0
"""
SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf '%s\\n' $NODES
"""


def run_template(
    tmp_path: Path, nodes: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run groups.sbatch as sbatch would on ``nodes`` (one task each), the stand-ins first on PATH; its
    result and the stand-in srun's log lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "srun.log"
    environ = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VENV": str(VENV),
        "RUNS": str(tmp_path / "runs"),
        "NODES": nodes,
        "SRUN_LOG": str(log),
        "SLURM_JOB_ID": "9",
        "SLURM_JOB_NODELIST": "stand-in",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(TEMPLATE)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=90,
        start_new_session=True,
    )
    return proc, log.read_text().splitlines() if log.exists() else []


def warnings_of(err: str) -> list[str]:
    """The template's own warning lines."""
    return [line for line in err.splitlines() if line.startswith("crossbow-launch: warning:")]


def test_a_lost_group_starts_again_on_the_spare_node_and_its_hanging_srun_is_ended(tmp_path: Path) -> None:
    """Three groups on node1-3, node4 spare: group 0 reports group 2 lost; the template starts group 2 on
    node4 with the same settings (``link.groups=3``, the user's arguments), ends node3's srun, which hangs
    as a lost node's does, and the job ends with group 0's status, 0, well before that srun would."""
    started = time.monotonic()
    proc, log = run_template(tmp_path, "node1 node2 node3 node4", REPLICA_GROUPS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warnings_of(proc.stderr) == [
        "crossbow-launch: warning: replica group 2 on node3 was lost; starting it again on the spare node "
        "node4"
    ], proc.stderr
    starts = [line.split()[1:3] for line in log]
    assert sorted(starts[:3]) == [["0", "node1"], ["1", "node2"], ["2", "node3"]], log
    assert starts[3:] == [["2", "node4"]], log
    again = log[3]
    assert "link.groups=3" in again and "--nodelist=node4" in again, again
    assert again.endswith(" link.restarted=true") and "link.restarted" not in " ".join(log[:3]), log
    (hung,) = [int(line.split()[3]) for line in log if line.startswith("start 2 node3")]
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)
    assert (tmp_path / "runs" / "9" / "lost-groups").read_text() == "2 node3\n"
    assert time.monotonic() - started < 30


def test_without_a_spare_the_other_groups_go_on_and_the_job_says_so(tmp_path: Path) -> None:
    """Three groups on three nodes: group 2 lost, no spare: one line says so, one more its srun's status,
    and the job ends with group 0's status, 0."""
    proc, log = run_template(tmp_path, "node1 node2 node3", GROUP2_FAILS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warnings_of(proc.stderr) == [
        "crossbow-launch: warning: replica group 2 on node3 was lost and no spare node is left; the other "
        "groups train on without it",
        "crossbow-launch: warning: replica group 2 on node3 ended with status 1; the other groups trained on "
        "without it",
    ], proc.stderr
    assert sorted(line.split()[1] for line in log) == ["0", "1", "2"]


def test_more_groups_than_nodes_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """REPLICA_GROUPS above the node count stops before any srun, in one line."""
    proc, log = run_template(tmp_path, "node1 node2", REPLICA_GROUPS="3")
    assert proc.returncode == 2 and log == [], proc.stderr
    assert proc.stderr.strip() == (
        "crossbow-launch: error: REPLICA_GROUPS=3: give 1 to 2 (the job's nodes; the rest are spares)"
    )
