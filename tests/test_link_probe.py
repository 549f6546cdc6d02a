"""The watchdog's link probe (mpicrossbow/training/health/link_probe.py): two probes in one process stand for
two ranks on different hosts; a probe that stops answering (its sockets closed, as a dead link leaves them) is
named after ``timeout`` seconds of silence, and never before. Across real links:
tests/test_cluster_netns.py."""

from __future__ import annotations

import time

import pytest

from mpicrossbow.comm.interfaces import host_addresses
from mpicrossbow.training.health.heartbeat import Beat
from mpicrossbow.training.health.link_probe import LinkProbe

pytestmark = pytest.mark.skipif(not host_addresses(), reason="no IPv4 address but loopback")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(rank: int, host: str, probe: LinkProbe, job: str = "job") -> Beat:
    return Beat(rank, host, 1000 + rank, job=job, step=7, phase="exchange", probes=probe.endpoints())


def exchange(a: LinkProbe, b: LinkProbe, me: Beat, peer: Beat) -> tuple[str | None, str | None]:
    """One watchdog interval on both: each pings the other and answers; the datagrams need a moment."""
    first = a.tick(me, peer), b.tick(peer, me)
    time.sleep(0.02)
    return first


def test_a_peer_that_answers_is_never_reported_and_a_silent_one_is_after_the_timeout() -> None:
    clock = Clock()
    a, b = LinkProbe("job", 20.0, clock), LinkProbe("job", 20.0, clock)
    me, peer = beat(0, "node1", a), beat(1, "node2", b)
    try:
        for _ in range(5):
            assert exchange(a, b, me, peer) == (None, None)
            clock.now += 10.0  # answers keep coming: 50 s pass without a report
        b.close()  # the link is gone: b neither answers nor pings
        assert a.tick(me, peer) is None  # the last answer came in before; silence starts now
        clock.now += 19.0
        assert a.tick(me, peer) is None
        clock.now += 1.5
        reason = a.tick(me, peer)
        assert reason is not None
        address = peer.probes[0][0]
        assert reason.startswith(
            f"the network between node1 and node2 is gone or crawling: rank 1 on node2 (pid 1001, {address})"
        )
        assert "exchange of step 7" in reason
    finally:
        a.close()
        b.close()


def test_peers_on_the_same_host_finished_or_of_another_job_are_not_probed() -> None:
    clock = Clock()
    a, b = LinkProbe("job", 1.0, clock), LinkProbe("job", 1.0, clock)
    b.close()  # would never answer
    me = beat(0, "node1", a)
    try:
        for peer in (
            beat(1, "node1", b),  # same host: the pid check covers it
            Beat(1, "node2", 1001, job="job", phase="done", probes=me.probes),
            beat(1, "node2", b, job="an earlier job"),
            Beat(1, "node2", 1001, job="job"),  # no probe sockets published
        ):
            for _ in range(3):
                assert a.tick(me, peer) is None
                clock.now += 5.0
    finally:
        a.close()


def test_stray_datagrams_are_ignored() -> None:
    clock = Clock()
    a, b = LinkProbe("job", 5.0, clock), LinkProbe("other job", 5.0, clock)
    me, peer = beat(0, "node1", a), beat(1, "node2", b, job="job")  # b answers only its own job's pings
    try:
        assert a.tick(me, peer) is None
        for _ in range(3):
            time.sleep(0.02)
            b.tick(Beat(1, "node2", 1001, job="other job"), None)
            clock.now += 3.0
            reason = a.tick(me, peer)
        assert reason is not None and "has not answered for 9 s" in reason
    finally:
        a.close()
        b.close()
