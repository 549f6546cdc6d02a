"""Is the network to a peer on another node still there? A link, switch port or interface that dies leaves
every process alive: the heartbeat files on the shared file system keep changing, and MPI's ranks poll
forever inside their collective. The watchdog asks this module too.

Each rank's watchdog thread holds one UDP socket on each of its host's IPv4 addresses (interfaces that are up,
not loopback; a kernel-chosen port) and publishes them in its heartbeat. Every interval it

1. answers each ping that reached its sockets (so the rank that watches it hears back), and
2. when the peer it watches (:mod:`.liveness`: the next rank in the ring) runs on another host, sends that
   peer a ping from its address on a subnet they share, and reads the answers.

No answer for ``timeout`` seconds, while the peer's heartbeat shows the process alive, means the network
between the two hosts is gone: the watchdog names both hosts and the peer's address and ends the job. The
datagrams carry the job's id, so a stray packet is ignored; nothing listens on the wildcard address. The
probe goes over the network the nodes share, not over the file system the heartbeats use, so the detection
does not depend on the link that died.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable

from ...comm.interfaces import host_addresses
from .heartbeat import Beat

log = logging.getLogger(__name__)

PING, PONG = b"xb-ping", b"xb-pong"


class LinkProbe:
    """This rank's UDP sockets: answers its watcher's pings, pings the peer it watches, tells when the network
    to that peer has been silent for ``timeout`` seconds."""

    def __init__(self, job: str, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.timeout, self.clock = job.encode(), timeout, clock
        self.sockets: list[tuple[ipaddress.IPv4Network, socket.socket]] = []
        for address in host_addresses():
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                sock.bind((address.address, 0))
            except OSError as exc:
                log.debug("no link probe on %s: %s", address.address, exc)
                sock.close()
                continue
            sock.setblocking(False)
            self.sockets.append((address.network(), sock))
        #: When the current silence began (the first ping not answered since the last answer).
        self.silent_since: float | None = None
        self.peer: tuple[int, str] | None = None

    def endpoints(self) -> list[list[str | int]]:
        """``[address, port]`` of each socket, for this rank's heartbeat."""
        return [[sock.getsockname()[0], sock.getsockname()[1]] for _, sock in self.sockets]

    def tick(self, me: Beat, peer: Beat | None) -> str | None:
        """Answer pings, ping ``peer`` (when on another host), and return why the network to it is gone — or
        None while it answers (or cannot be probed: same host, no shared subnet)."""
        answered = self._serve()
        target = self._target(me, peer)
        if target is None or peer is None:
            self.silent_since = None
            return None
        if self.peer != (peer.rank, peer.job):  # a new peer or job: start afresh
            self.peer, self.silent_since = (peer.rank, peer.job), None
        now = self.clock()
        if answered:
            self.silent_since = None
        sock, address = target
        try:
            sock.sendto(PING + b" " + self.job, address)
        except OSError as exc:  # "network unreachable" on a link that is down counts as silence
            log.debug("link probe to %s: %s", address, exc)
        if self.silent_since is None:
            self.silent_since = now
            return None
        silent = now - self.silent_since
        if self.timeout and silent >= self.timeout:
            return (
                f"the network between {me.host} and {peer.host} is gone or crawling: rank {peer.rank} on "
                f"{peer.host} (pid {peer.pid}, {address[0]}) has not answered for {silent:.0f} s though its "
                f"heartbeat goes on, last in {peer.phase} of step {peer.step} (a link, switch port or "
                "network interface failed or is saturated)"
            )
        return None

    def _serve(self) -> bool:
        """Answer every waiting ping; True when an answer to one of ours came back."""
        answered = False
        for _, sock in self.sockets:
            while True:
                try:
                    data, sender = sock.recvfrom(512)
                except OSError:  # nothing waiting (BlockingIOError) or the socket failed: done here
                    break
                if data == PING + b" " + self.job:
                    try:
                        sock.sendto(PONG + b" " + self.job, sender)
                    except OSError:
                        pass
                elif data == PONG + b" " + self.job:
                    answered = True
        return answered

    def _target(self, me: Beat, peer: Beat | None) -> tuple[socket.socket, tuple[str, int]] | None:
        """This rank's socket and the peer's endpoint on a subnet both have; None when the peer is on this
        host, has no endpoints, or shares no subnet."""
        if peer is None or peer.host == me.host or peer.job != me.job or peer.phase == "done":
            return None
        for address, port in peer.probes:
            for network, sock in self.sockets:
                if ipaddress.ip_address(str(address)) in network:
                    return sock, (str(address), int(port))
        return None

    def close(self) -> None:
        """Close the sockets."""
        for _, sock in self.sockets:
            sock.close()
        self.sockets = []
