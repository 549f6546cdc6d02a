"""What a torch.distributed job exposes to the network, under a real ``mpiexec``: the ranks' listening
sockets, read from /proc while the job runs (tests/listeners.py).

The ranks hold listeners that are not mpicrossbow's: the MPI library's own (MPICH's netmod listens on the
node's address) and the launcher's (Hydra's control port, a wildcard socket its children inherit). So the
digits job runs twice, with ``backend = mpi`` (those listeners alone) and with ``backend = gloo``; what the
gloo job adds must be on loopback and the same on every rank (rank 0 serves no rendezvous store). The
rendezvous itself on real ranks, one node and (forced) several: tests/mpi_scripts/rendezvous_check.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, launcher, mpi_env, run_mpi, verdicts
from listeners import Listener, listeners
from mpicrossbow.comm.rendezvous import FOLDER_PREFIX
from mpicrossbow.errors import STOPPED_EXIT_CODE

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

RANKS = 2


@dataclass
class Snapshot:
    """What a running digits job showed, and how it ended."""

    #: Each rank's listening sockets while it trained.
    sockets: dict[int, list[Listener]]
    #: The rendezvous folders in the job's ``$TMPDIR`` while it trained, with their permission bits.
    folders: dict[str, int]
    #: The rendezvous folders left in the job's ``$TMPDIR`` after it ended (torch keeps caches there too).
    left: list[str]
    returncode: int | None
    stderr: str

    def addresses(self, rank: int) -> Counter[str]:
        """How many sockets rank ``rank`` listened on, by address."""
        return Counter(s.address for s in self.sockets[rank])


def heartbeat_pids(out: Path, deadline: float) -> dict[int, int]:
    """Every rank's pid, from its heartbeat file (written once the communicator is up)."""
    pids: dict[int, int] = {}
    while len(pids) < RANKS and time.monotonic() < deadline:
        time.sleep(0.5)
        for rank in range(RANKS):
            beat = next(iter(out.glob(f"*/heartbeats/rank-{rank:05d}.json")), None)
            if beat is not None and rank not in pids:
                try:
                    pids[rank] = json.loads(beat.read_text())["pid"]
                except (ValueError, KeyError):
                    pass  # being written
    assert len(pids) == RANKS, f"heartbeats of ranks {sorted(pids)} only"
    return pids


def snapshot(mpiexec: str, tmp_path: Path, backend: str) -> Snapshot:
    """Start the digits job on 2 ranks with ``comm.backend=backend`` and its own ``$TMPDIR``, read the
    ranks' listening sockets once both train, then stop it with SIGUSR1 (checkpoint, exit status 75: the
    ranks close their communicators)."""
    out, tmpdir, log = tmp_path / backend, tmp_path / f"tmp-{backend}", tmp_path / f"{backend}.stderr"
    tmpdir.mkdir()
    env = mpi_env({"TMPDIR": str(tmpdir)})
    env.pop("GLOO_SOCKET_IFNAME", None)
    args = [*launcher(), "-cfg", "launch/digits.cfg", f"session.output={out}", "session.epochs=200",
            f"comm.backend={backend}"]  # fmt: skip
    with open(log, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(
            [mpiexec, "-n", str(RANKS), *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            pids = heartbeat_pids(out, time.monotonic() + 90)
            time.sleep(1)
            found = listeners(list(pids.values()))
            sockets = {rank: [s for s in found if s.pid == pid] for rank, pid in pids.items()}
            folders = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmpdir.glob(f"{FOLDER_PREFIX}*")}
            os.kill(pids[RANKS - 1], signal.SIGUSR1)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    left = sorted(p.name for p in tmpdir.glob(f"{FOLDER_PREFIX}*"))
    return Snapshot(sockets, folders, left, proc.returncode, log.read_text(encoding="utf-8"))


def test_a_gloo_job_listens_on_loopback_only_and_serves_no_store(mpiexec: str, tmp_path: Path) -> None:
    """The acceptance test of the single-node rendezvous: beyond the MPI library's and the launcher's own
    listeners, a gloo job's ranks listen on loopback only, none on a wildcard, and rank 0 on no more sockets
    than rank 1 (no TCP store); the store is a file in a 0700 folder of ``$TMPDIR``, gone after the job."""
    base = snapshot(mpiexec, tmp_path, "mpi")
    gloo = snapshot(mpiexec, tmp_path, "gloo")
    for job in (base, gloo):
        assert job.returncode == STOPPED_EXIT_CODE, job.stderr[-3000:]
    seen = f"\nmpi job: {base.sockets}\ngloo job: {gloo.sockets}"
    added = {rank: gloo.addresses(rank) - base.addresses(rank) for rank in range(RANKS)}
    for rank, addresses in added.items():
        outside = [a for a in addresses if not Listener(0, a, 0).loopback]
        assert not outside, f"rank {rank} listens outside loopback on {outside}{seen}"
    assert added[0].total() == added[1].total(), f"rank 0 serves more sockets: {added}{seen}"
    wildcards = [[s for s in job.sockets[r] if s.wildcard] for job in (base, gloo) for r in range(RANKS)]
    assert [len(w) for w in wildcards[RANKS:]] == [len(w) for w in wildcards[:RANKS]], f"wildcards{seen}"
    assert list(gloo.folders.values()) == [0o700], gloo.folders
    assert "torch.distributed gloo up: 2 ranks via file store in " in gloo.stderr
    assert gloo.left == [], f"left in $TMPDIR: {gloo.left}"


def test_rendezvous_on_real_ranks(mpiexec: str) -> None:
    """One node: a file store, loopback only, no store on rank 0, folder removed at close. Several nodes
    (forced, over loopback): rank 0 serves the TCP store on the interface's address, never the wildcard."""
    script = REPO / "tests" / "mpi_scripts" / "rendezvous_check.py"
    proc = run_mpi(mpiexec, RANKS, [sys.executable, str(script)], timeout=180)
    found = verdicts(proc.stdout)
    tail = f"\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    for check in ("one_node", "several_nodes"):
        assert found.get(f"rendezvous.{check}") == "OK", f"{check}: {found.get(f'rendezvous.{check}')}{tail}"
    assert proc.returncode == 0 and "DONE" in proc.stdout, tail
