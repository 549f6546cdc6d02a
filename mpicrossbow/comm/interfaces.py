"""This host's network interfaces: names, IPv4 addresses and subnets (Linux ioctls, no extra package), and
the subnet a set of hosts shares. The rendezvous (:mod:`.rendezvous`) meets on it and the watchdog's link
probe (:mod:`mpicrossbow.training.health.link_probe`) pings peers through it."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_SIOCGIFNETMASK = 0x891B  # ... its netmask
_SIOCGIFFLAGS = 0x8913  # ... its flags (IFF_UP = 1, IFF_LOOPBACK = 8)


def _ioctl(name: str, request: int) -> bytes | None:
    """The answer of a Linux interface ioctl for interface ``name`` (an ``ifreq``), or None (no such
    interface, no address, or not Linux)."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except (ImportError, OSError):
        return None


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface ``name``, or None when it has none (or this is not Linux)."""
    answer = _ioctl(name, _SIOCGIFADDR)
    return socket.inet_ntoa(answer[20:24]) if answer is not None else None


@dataclass(frozen=True)
class Address:
    """One IPv4 address of a network interface that is up and not loopback."""

    interface: str
    address: str
    prefix: int

    def network(self) -> ipaddress.IPv4Network:
        """The subnet the address is in."""
        return ipaddress.ip_network(f"{self.address}/{self.prefix}", strict=False)  # type: ignore[return-value]


def host_addresses() -> list[Address]:
    """This host's IPv4 addresses on interfaces that are up and not loopback, in interface order."""
    out = []
    for name in interface_names():
        flags, address, mask = (
            _ioctl(name, _SIOCGIFFLAGS),
            interface_ipv4(name),
            _ioctl(name, _SIOCGIFNETMASK),
        )
        if flags is None or address is None or mask is None:
            continue
        up, loopback = flags[16] & 1, flags[16] & 8  # ifr_flags, after the 16-byte name
        if up and not loopback:
            prefix = ipaddress.ip_network(f"0.0.0.0/{socket.inet_ntoa(mask[20:24])}").prefixlen
            out.append(Address(name, address, prefix))
    return out


def shared_interfaces(per_rank: list[list[Address]]) -> list[Address]:
    """Each rank's address in the first subnet of rank 0's addresses that every rank has an address in.

    ``per_rank[r]`` is rank r's :func:`host_addresses`. Raises ValueError naming every rank's addresses when
    the ranks share no subnet (they then need ``[comm] interface`` or a route the user names)."""
    for candidate in per_rank[0]:
        net = candidate.network()
        chosen = [
            next((a for a in mine if ipaddress.ip_address(a.address) in net), None) for mine in per_rank
        ]
        if all(a is not None for a in chosen):
            return chosen  # type: ignore[return-value]
    seen = "; ".join(
        f"rank {r}: " + (", ".join(f"{a.interface} {a.address}/{a.prefix}" for a in mine) or "none")
        for r, mine in enumerate(per_rank)
    )
    raise ValueError(
        f"the ranks share no IPv4 subnet to meet on ({seen}): set [comm] interface to the network interface "
        "the nodes share"
    )


def resolves_to_loopback(host: str) -> bool:
    """``host`` resolves to a loopback address (or not at all): other nodes cannot reach it by name."""
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return True


def interface_names() -> list[str]:
    """The names of this host's network interfaces."""
    return [name for _, name in socket.if_nameindex()]


def loopback_interface() -> str:
    """The name of the loopback interface: the one holding 127.0.0.1 (``lo`` on Linux), else the first
    named ``lo...`` (``lo0`` on BSD and macOS), else ``lo``."""
    names = interface_names()
    for name in names:
        if interface_ipv4(name) == "127.0.0.1":
            return name
    return next((name for name in names if name.startswith("lo")), "lo")
