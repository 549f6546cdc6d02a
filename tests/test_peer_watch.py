"""PeerWatch (mpicrossbow/comm/peer_watch.py): a wait on node-shared memory ends when a peer dies or the
job ends around the rank, and never judges a peer it cannot see (issue 50: the orphan spinning in shm.py's
flag poll after its job had ended)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from mpicrossbow.comm import peer_watch
from mpicrossbow.comm.peer_watch import PeerGone, PeerWatch, start_time


def sleeper() -> subprocess.Popen[bytes]:
    """A process standing in for a node peer."""
    return subprocess.Popen(["sleep", "60"])


def test_a_live_peer_passes_and_a_dead_one_is_named() -> None:
    peer = sleeper()
    try:
        watch = PeerWatch(0, {0: PeerWatch.mine(), 1: (peer.pid, start_time(peer.pid))})
        assert set(watch.peers) == {1}
        watch.check("the test")  # alive: nothing
        peer.kill()
        time.sleep(0.2)  # not reaped yet: a zombie, which will never write to the window again
        with pytest.raises(PeerGone, match=rf"node rank 1 \(pid {peer.pid}\) is gone, .* in the test"):
            watch.check("the test")
        peer.wait()
        with pytest.raises(PeerGone, match="node rank 1"):
            watch.check("the test")
    finally:
        peer.kill()
        peer.wait()


def test_a_peer_this_process_cannot_see_is_not_judged() -> None:
    """A pid that names another process here (a rank in another pid namespace) or no start time at all:
    the watch leaves that peer alone, so it can never stop a healthy job."""
    peer = sleeper()
    try:
        watch = PeerWatch(0, {1: (peer.pid, (start_time(peer.pid) or 0) + 1), 2: (os.getpid(), None)})
        assert watch.peers == {}
        watch.check("the test")
    finally:
        peer.kill()
        peer.wait()


def test_waiting_is_quiet_at_first_then_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = sleeper()
    watch = PeerWatch(0, {1: (peer.pid, start_time(peer.pid))})
    peer.kill()
    peer.wait()
    clock = [100.0]
    monkeypatch.setattr(peer_watch.time, "monotonic", lambda: clock[0])
    watch.waiting("the poll")  # the wait starts
    clock[0] += peer_watch.QUIET_S / 2
    watch.waiting("the poll")  # within the quiet time: no check, although the peer is dead
    clock[0] += peer_watch.QUIET_S
    with pytest.raises(PeerGone, match=r"after 1\.5 s waiting for it in the poll"):
        watch.waiting("the poll")
    watch.reset()
    watch.waiting("the poll")  # a new wait starts quiet again


ORPHAN = """
import os, sys, time
from mpicrossbow.comm.peer_watch import PeerGone, PeerWatch
if os.fork():
    time.sleep(0.5)
    os._exit(0)  # the launcher goes away: the child is re-parented
watch = PeerWatch(0, {0: PeerWatch.mine()})
start = time.monotonic()
try:
    while time.monotonic() - start < 20:
        watch.waiting("the test's poll")
        time.sleep(0.01)
    message = "still waiting after 20 s"
except PeerGone as exc:
    message = f"{exc} [{time.monotonic() - start:.1f}]"
with open(sys.argv[1], "w") as out:
    out.write(message)
"""


@pytest.mark.slow
def test_a_process_whose_launcher_went_away_stops_waiting(tmp_path: Path) -> None:
    """The orphan: its parent exits while it polls; within seconds the poll ends in PeerGone."""
    said = tmp_path / "said"
    subprocess.run(
        [sys.executable, "-c", ORPHAN, str(said)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=30,
        check=True,
    )
    deadline = time.monotonic() + 25
    while not said.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = said.read_text()
    assert text.startswith("the job ended around this rank: its launcher (pid "), text
    assert "waiting in the test's poll" in text
    assert float(text.rsplit("[", 1)[1].rstrip("]")) < 5


def test_the_shared_memory_poll_asks_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """SharedMemoryCommunicator's flag poll hands a long wait to its PeerWatch (checked here on one rank's
    window with a peer flag that never moves: the watch's PeerGone ends the wait)."""
    from mpicrossbow.comm.shm import SharedMemoryCommunicator

    calls: list[str] = []

    def waiting(self: PeerWatch, what: str) -> None:
        calls.append(what)
        if len(calls) > 3:
            raise PeerGone("node rank 1 is gone (test)")

    monkeypatch.setattr(PeerWatch, "waiting", waiting)
    comm = SharedMemoryCommunicator()
    try:
        comm._window = window = _OneStuckPeer()  # type: ignore[assignment]
        with pytest.raises(PeerGone, match="node rank 1 is gone"):
            comm._sync()
        assert window.syncs > 100 and calls[0] == "the shared-memory allreduce"
    finally:
        comm._window = None
        comm.close()


class _OneStuckPeer:
    """A window of two node ranks whose peer (node rank 1) never publishes its epoch."""

    def __init__(self) -> None:
        self.headers = [[0], [0]]
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1

    def refresh(self) -> None:
        self.syncs += 1


def test_start_time_of_a_gone_process_is_none() -> None:
    peer = sleeper()
    assert start_time(peer.pid) is not None
    os.kill(peer.pid, signal.SIGKILL)
    peer.wait()
    assert start_time(peer.pid) is None
