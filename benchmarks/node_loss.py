"""A lost node (issue 52): three namespace nodes (tests/netns_cluster.py, as root), each its own MPI job of
one rank — a replica group (``[link] groups = 3``, the rendezvous on node1) — train the digits job; once
group 0 logs epoch ``--kill-epoch``, node3 is killed whole (every process of it at once, as a node losing
power). Per rule, one line::

    node loss <RULE>: exit <code>, survivors trained again in <s> s, accuracy <a> (uninterrupted <b>)

With ``--restart`` node3 boots again at once and its group's job is started there anew (as groups.sbatch
starts it on a spare node): it takes a live group's state at a step's boundary, and the line adds
``node3's group back in <s> s, exit <code>``: from the kill's start to group 0's line that it handed its
state over (the world whole again), and the restarted job's status.
``exit``: the survivors' (groups 0 and 1) worst exit status; ``survivors trained again``: from the kill's
start to group 0's line naming the lost group, which it logs as the new quorum forms, right before the step
is summed again over the survivors; accuracy: group 0's last validation, against the same job without a
kill (3 groups throughout). ``--repeats`` runs each (medians). Run as
``python -m benchmarks.faults --node-loss`` (or this module); writes benchmarks/results/faults.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import REPO, append_result
from mpicrossbow.training.reporting.metrics import read_metrics

sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster is the test suite's own fixture
from netns_cluster import NetnsCluster, missing_reason, started

RULES = ("BSP", "SMA")
#: Seconds one job may take.
TIMEOUT_S = 300


@dataclass
class Drill:
    """One job of three groups: each group's exit status and output lines (with arrival times), the kill's
    time, and group 0's accuracies."""

    codes: list[int | None] = field(default_factory=list)
    lines: list[list[tuple[float, str]]] = field(default_factory=list)
    killed_at: float | None = None
    accuracy: list[float] = field(default_factory=list)

    def lost_line(self) -> tuple[float, str] | None:
        """Group 0's line naming a lost group, and when it came."""
        return next(((t, line) for t, line in self.lines[0] if "link: group(s)" in line), None)

    def back_s(self) -> float | None:
        """Seconds from the kill to that line."""
        lost = self.lost_line()
        return lost[0] - self.killed_at if lost and self.killed_at is not None else None

    def whole_s(self) -> float | None:
        """Seconds from the kill to group 0's line that the restarted group took its state (None: never)."""
        back = next((t for t, line in self.lines[0] if "link: group(s) 2 back at step" in line), None)
        return back - self.killed_at if back is not None and self.killed_at is not None else None


def drill(
    cluster: NetnsCluster,
    rule: str,
    out: Path,
    epochs: int,
    kill_epoch: int | None,
    restart: bool = False,
    extra: tuple[str, ...] = (),
) -> Drill:
    """Three groups, one per node (each ``mpiexec -n 1`` inside its node), ``rule`` for ``epochs`` (and the
    overrides ``extra``); node3 killed once group 0 logs epoch ``kill_epoch`` (None: no kill); ``restart``:
    booted again at once and its group's job started anew (a fourth process), else booted again
    afterwards."""
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    launch = str(Path(sys.executable).parent / "crossbow-launch")
    address = f"{cluster.hosts[0]}:{random.randrange(20000, 30000)}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    result, procs, readers = Drill(), [], []

    def start(g: int, host: str) -> None:
        argv = [mpiexec, "-n", "1", launch, "-cfg", "launch/digits.cfg", f"RULE={rule}", "link.groups=3",
                f"link.group={g}", f"link.address={address}", f"session.epochs={epochs}",
                f"session.output={out}", "session.progress=log", *extra]  # fmt: skip
        proc = subprocess.Popen(cluster.node_command(host, argv), cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        result.lines.append([])
        reader = threading.Thread(target=_read, args=(proc, result.lines[-1]), daemon=True)
        reader.start()
        readers.append(reader)

    for g, host in enumerate(cluster.hosts):
        start(g, host)
        if g == 0:
            time.sleep(1.0)  # the rendezvous first
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if kill_epoch is not None and result.killed_at is None:
                if any(f"epoch {kill_epoch} step" in line for _, line in list(result.lines[0])):
                    result.killed_at = time.monotonic()  # the kill's start (it returns once node3 is gone)
                    cluster.kill_node(cluster.hosts[2])
                    if restart:
                        cluster.restart_node(cluster.hosts[2])
                        start(2, cluster.hosts[2])
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(10)
        if kill_epoch is not None and not restart:
            cluster.restart_node(cluster.hosts[2])
    result.codes = [p.returncode for p in procs]
    runs = list(out.glob("*-group0"))
    if runs and (runs[0] / "metrics.h5").exists():
        result.accuracy = [float(a) for a in read_metrics(runs[0] / "metrics.h5")["val"]["accuracy"]]
    return result


def _read(proc: subprocess.Popen[str], into: list[tuple[float, str]]) -> None:
    """Every line of ``proc``'s output with its arrival time."""
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append((time.monotonic(), line.rstrip("\n")))


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each rule, with and without a kill")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of the digits job (its cfg's 20)")
    parser.add_argument("--kill-epoch", type=int, default=3, help="node3 dies once group 0 logs this epoch")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="node3 boots again at once and its group's job starts anew there",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; do not write results/")
    args = parser.parse_args(argv)
    reason = missing_reason()
    if reason:
        print(f"node_loss: {reason}", file=sys.stderr)
        return 2
    lines = []
    with started(NetnsCluster(3)) as cluster, tempfile.TemporaryDirectory() as tmp:
        for rule in RULES:
            lost, whole = [], []
            for i in range(args.repeats):
                folder = Path(tmp) / f"{rule}-{i}"
                whole.append(drill(cluster, rule, folder / "whole", args.epochs, None))
                lost.append(drill(cluster, rule, folder / "lost", args.epochs, args.kill_epoch, args.restart))
            lines.append(summary(rule, lost, whole, args.restart))
            print(lines[-1], flush=True)
    text = "\n".join(f"    {line}" for line in lines) + (
        f"\n\n3 namespace nodes × 1 rank, each its own MPI job (MPICH) and replica group ([link] groups = "
        f"3, the rendezvous on node1); digits, {args.epochs} epochs; node3 killed whole once group 0 logged "
        f"epoch {args.kill_epoch}"
        + ("; node3 booted again at once and its group's job started there anew" if args.restart else "")
        + f". Medians of {args.repeats} run(s) each, with and without the kill."
    )
    print(text)
    if not args.no_write:
        title = "A lost node: replica groups, node3 killed" + (
            " and its group restarted" if args.restart else ""
        )
        print("appended to", append_result("faults", title, text))
    return 0


def summary(rule: str, lost: list[Drill], whole: list[Drill], restart: bool = False) -> str:
    """The rule's line: the survivors' worst exit status, medians of the rest (``restart``: and the restarted
    group's return and worst status)."""
    codes = [c for d in lost for c in d.codes[:2]]
    worst = max(codes, key=lambda c: (c != 0, abs(c or 0))) if codes else None
    back = [b for d in lost if (b := d.back_s()) is not None]
    acc = [d.accuracy[-1] for d in lost if d.accuracy]
    base = [d.accuracy[-1] for d in whole if d.accuracy]
    back_s = f"{statistics.median(back):.1f}" if len(back) == len(lost) else f"({len(back)} of {len(lost)})"
    line = (
        f"node loss {rule}: exit {worst}, survivors trained again in {back_s} s, accuracy "
        f"{_median(acc)} (uninterrupted {_median(base)})"
    )
    if restart:
        again = [w for d in lost if (w := d.whole_s()) is not None]
        codes = [d.codes[3] for d in lost if len(d.codes) > 3]
        back = (
            f"{statistics.median(again):.1f}" if len(again) == len(lost) else f"({len(again)} of {len(lost)})"
        )
        line += f", node3's group back in {back} s, exit {max(codes, key=abs) if codes else None}"
    return line


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.4f}" if values else "none"


if __name__ == "__main__":
    sys.exit(main())
