"""The watchdog thread: heartbeats, dead peers (by pid on this kernel, by silence elsewhere) and stalls."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from mpicrossbow.training.health.heartbeat import (
    Beat,
    fault_file,
    heartbeat_file,
    read_heartbeats,
    write_heartbeat,
)
from mpicrossbow.training.health.liveness import PeerLiveness
from mpicrossbow.training.health.watchdog import AUTO_FIRST_STEP_S, AUTO_FLOOR_S, Watchdog

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pids are checked through /proc")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finished_process() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def wait_for(messages: list[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not messages and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_peer_on_this_node_whose_process_is_gone_is_named_with_how_it_died(tmp_path: Path) -> None:
    me, peer = Beat.mine(0, "job"), Beat.mine(1, "job")
    liveness = PeerLiveness(me, 2, tmp_path, timeout=20)
    assert liveness.watched == [1]
    assert liveness.gone({1: peer}) == {}  # this very process: alive
    peer.pid, peer.step, peer.phase = finished_process(), 7, "exchange"
    (why,) = liveness.gone({1: peer}).values()
    assert why.startswith(f"rank 1 on {peer.host} (pid {peer.pid}) is gone: its process ended without")
    assert "last seen in exchange of step 7" in why
    fault_file(tmp_path, 1).write_text("Fatal Python error: Segmentation fault\n\nCurrent thread ...\n")
    assert liveness.gone({1: peer})[1].startswith(
        f"rank 1 on {peer.host} (pid {peer.pid}) died: Fatal Python error: Segmentation fault (its stack: "
    )
    reused = Beat.mine(1, "job")
    reused.started -= 1  # the same pid, another process: the one that wrote the heartbeat is gone
    assert 1 in liveness.gone({1: reused})
    peer.phase = "done"  # finished ranks stop writing and are never reported
    assert liveness.gone({1: peer}) == {}


def test_each_rank_watches_the_next_one_in_a_ring(tmp_path: Path) -> None:
    assert [PeerLiveness(Beat.mine(r, "j"), 4, tmp_path, 20).watched for r in range(4)] == [
        [1],
        [2],
        [3],
        [0],
    ]
    assert PeerLiveness(Beat.mine(0, "j"), 1, tmp_path, 20).watched == []
    dead = Beat.mine(2, "j")
    dead.pid = finished_process()
    assert PeerLiveness(Beat.mine(0, "j"), 4, tmp_path, 20).gone({2: dead}) == {}  # rank 1's to see


def test_a_peer_elsewhere_is_dead_only_after_timeout_seconds_of_silence(tmp_path: Path) -> None:
    clock = Clock()
    liveness = PeerLiveness(Beat.mine(0, "job"), 2, tmp_path, timeout=20, clock=clock)
    remote = Beat(rank=1, host="node9", pid=4242, boot="other-boot", pidns="pid:[1]", job="job", seq=5)
    assert liveness.gone({1: remote}) == {}
    clock.now += 19
    assert liveness.gone({1: remote}) == {}
    remote.seq += 1  # it wrote again: alive, the silence starts over
    assert liveness.gone({1: remote}) == {}
    clock.now += 20
    why = liveness.gone({1: remote})[1]
    assert why.startswith("rank 1 on node9 (pid 4242) has written no heartbeat for 20 s, last in compute")
    stale = Beat(rank=1, host="node9", pid=1, boot="other-boot", job="an earlier job")
    fresh = PeerLiveness(Beat.mine(0, "job"), 2, tmp_path, timeout=20, clock=clock)
    fresh.gone({1: stale})
    clock.now += 21  # an earlier job's file in a resumed run folder counts as no heartbeat at all
    assert "has written no heartbeat to" in fresh.gone({1: stale})[1]


def test_heartbeats_round_trip_and_partial_files_are_read(tmp_path: Path) -> None:
    beat = Beat.mine(3, "job")
    assert write_heartbeat(tmp_path, beat)
    assert read_heartbeats(tmp_path, 4) == {3: beat}
    heartbeat_file(tmp_path, 1).write_text(json.dumps({"rank": 1, "host": "h", "pid": 9}))
    heartbeat_file(tmp_path, 2).write_text("{not json")
    beats = read_heartbeats(tmp_path, 4)
    assert sorted(beats) == [1, 3] and beats[1].boot == ""
    assert not write_heartbeat(tmp_path / "missing", beat)


def test_the_rank_before_a_dead_peer_aborts_the_job(tmp_path: Path) -> None:
    dead = Beat.mine(2, "job")
    dead.pid = finished_process()
    write_heartbeat(tmp_path, dead)
    for rank in (0, 1):
        write_heartbeat(tmp_path, Beat.mine(rank, "job"))
    lines: dict[int, list[str]] = {0: [], 1: []}
    dogs = [
        Watchdog(
            tmp_path, r, 3, 0, 0, 0.05, lambda line, _, r=r: lines[r].append(line), peer_timeout=20, job="job"
        )
        for r in (0, 1)
    ]
    for dog in dogs:
        dog.start()
    wait_for(lines[1])
    time.sleep(0.2)
    for dog in dogs:
        dog.stop()
    assert len(lines[1]) == 1 and lines[1][0].startswith(f"rank 2 on {dead.host} (pid {dead.pid}) is gone")
    assert lines[1][0].endswith("rank 1 aborts the job")
    assert lines[0] == []  # rank 0 watches rank 1, which is alive
    assert json.loads(heartbeat_file(tmp_path, 0).read_text())["phase"] == "done"
    assert not fault_file(tmp_path, 0).exists()  # a clean stop leaves no fault file


def test_a_stalled_step_names_the_rank_behind_and_aborts(tmp_path: Path) -> None:
    messages: list[str] = []
    behind = Beat(rank=1, host="node7", pid=4242, boot="b", job="job", step=41, progressed=time.time() - 9)
    write_heartbeat(tmp_path, behind)
    dog = Watchdog(tmp_path, 0, 2, 0.2, 0.6, 0.05, lambda line, _: messages.append(line), job="job").start()
    dog.beat(41, "exchange")  # rank 0 waits in step 41's exchange; rank 1 never arrived
    wait_for(messages)
    dog.stop()
    assert messages, "the watchdog did not abort"
    assert "step 41 (exchange) has not progressed" in messages[0]
    assert "waiting for rank(s) 1 on node7 (pid 4242, in compute of step 41" in messages[0]
    assert messages[0].endswith("aborting ([watchdog] abort_after = 0.6 s)")


def test_auto_abort_after_follows_the_longest_step_and_spares_validation(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, 0, 1, 60, "auto", 1.0, lambda line, _: None)
    assert dog.limit() == AUTO_FIRST_STEP_S
    dog.beat(0, "compute")
    dog.beat(0, "exchange")
    dog._step_started -= 90.0  # the first step took 90 s
    dog.beat(1, "compute")
    assert dog.longest == pytest.approx(90.0, abs=1) and dog.limit() == pytest.approx(900.0, abs=10)
    dog.longest = 2.0
    assert dog.limit() == AUTO_FLOOR_S
    dog.beat(1, "validate")
    assert dog.limit() == 0.0  # validation and checkpoints are not timed by auto
    dog._step_started -= 5000.0
    dog.beat(2, "compute")  # a step that spans validation does not count as a step's length
    assert dog.longest == 2.0
    assert asdict(dog.me)["rank"] == 0
