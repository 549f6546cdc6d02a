"""The listening TCP sockets of processes, read from /proc (Linux): what a rank exposes to the network.

``/proc/net/tcp`` and ``/proc/net/tcp6`` list the sockets of this network namespace (state ``0A``: LISTEN)
with their inodes; ``/proc/<pid>/fd/*`` links to ``socket:[inode]`` for each socket a process holds.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    """One listening socket held by process ``pid``."""

    pid: int
    address: str
    port: int

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        """The bound address (an IPv4-mapped IPv6 address as its IPv4 one)."""
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return mapped if mapped is not None else ip

    @property
    def wildcard(self) -> bool:
        """Bound to every interface (0.0.0.0 or ::)."""
        return self.ip.is_unspecified

    @property
    def loopback(self) -> bool:
        """Bound to a loopback address (127.0.0.0/8 or ::1)."""
        return self.ip.is_loopback


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds (empty when it is gone)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> str:
    """A /proc/net/tcp* address (32-bit words in host order, little-endian here) as text."""
    raw = bytes.fromhex(hex_address)
    return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) that one of ``pids`` holds, once per holder (a socket
    inherited from a parent is held by each child), sorted."""
    holders: dict[str, list[int]] = {}
    for pid in pids:
        for inode in socket_inodes(pid):
            holders.setdefault(inode, []).append(pid)
    found = []
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in holders:
                address, port = fields[1].split(":")
                found += [Listener(pid, _address(address), int(port, 16)) for pid in holders[fields[9]]]
    return sorted(found, key=lambda s: (s.pid, s.address, s.port))
