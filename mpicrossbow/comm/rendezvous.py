"""How the ranks of a torch.distributed job find each other, with no listener that anyone else can reach.

``init_process_group`` needs a key-value store every rank can reach: the ranks publish their Gloo or NCCL
addresses in it, and :meth:`~torch.distributed.new_group` uses it again for every later group. torch's usual
``tcp://`` store listens on every interface (``*:port``, IPv4 and IPv6) for the whole job, unauthenticated:
anyone on the network could read or poison its keys, or end the job. MPI already connects the ranks, so the
store is chosen and announced over MPI instead:

- **One node** (every rank reports the same hostname and sees rank 0's folder): a
  :class:`~torch.distributed.FileStore` on a file in a private folder (mode 0700) that rank 0 creates under
  ``$TMPDIR`` (else /tmp): no socket at all, and only the job's user can open it. The folder is removed
  when the communicator closes. Gloo's own data sockets are put on the loopback interface
  (``GLOO_SOCKET_IFNAME``, unless the user set it): Gloo otherwise picks the address the hostname resolves
  to, which may be the node's network address. (NCCL keeps the interface it picks: NCCL on loopback has not
  been tried.) Should rank 0 make no folder, or a rank not see it, the ranks take the several-node way,
  where a hostname on loopback is then allowed.
- **Several nodes**: a :class:`~torch.distributed.TCPStore` whose server is a socket rank 0 binds itself to
  one address, never the wildcard: that of ``[comm] interface`` on rank 0's host when given, else the
  address rank 0's hostname resolves to (refused when it is a loopback address, which other nodes cannot
  reach). The store is wrapped in a :class:`~torch.distributed.PrefixStore` with a random per-job prefix
  broadcast over MPI, so a client that does connect cannot guess the keys. ``[comm] interface`` also
  becomes Gloo's (``GLOO_SOCKET_IFNAME``) or NCCL's (``NCCL_SOCKET_IFNAME``) interface, unless the user set
  those. Without ``[comm] interface``, when some rank's hostname resolves to a loopback address (Debian's
  ``127.0.1.1 <hostname>`` line in /etc/hosts: Gloo would then listen where no other node can connect, and
  the job would hang), the ranks pick the interface themselves (:func:`shared_interfaces`): the first IPv4
  subnet of rank 0's interfaces that every rank has an address in; each rank uses its own interface on it
  (the names may differ between nodes) and the store listens on rank 0's address there. A rank that cannot
  reach the store ends with one line naming the address it tried.

Every decision is made on rank 0 or agreed by all ranks over MPI, and a problem raises the same error on
every rank (no rank is left waiting in a collective).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from .interfaces import (
    Address,
    host_addresses,
    interface_ipv4,
    interface_names,
    loopback_interface,
    resolves_to_loopback,
    shared_interfaces,
)

log = logging.getLogger(__name__)

#: The environment variable that names the network interface of each torch.distributed backend.
SOCKET_IFNAME = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}

#: Name prefix of rank 0's private store folder (under ``$TMPDIR`` or /tmp).
FOLDER_PREFIX = "mpicrossbow-rendezvous-"


class BootstrapComm(Protocol):
    """The part of an mpi4py communicator the rendezvous uses (``MPI.Comm`` has it)."""

    def Get_rank(self) -> int:
        """This process's rank."""

    def Get_size(self) -> int:
        """Number of ranks."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``obj`` from ``root`` on every rank."""

    def allgather(self, sendobj: Any) -> list[Any]:
        """Every rank's ``sendobj``, in rank order."""

    def Barrier(self) -> None:
        """Wait for every rank."""


@dataclass
class Rendezvous:
    """The store the ranks met through, what to log about it, and what :meth:`close` undoes."""

    #: The store to hand to ``init_process_group(store=...)``.
    store: dist.Store | None
    #: How the ranks met, for the log line.
    where: str
    #: The private folder of a file store (every rank knows it; rank 0 made it and removes it), or None.
    folder: str | None = None
    #: The environment variables this rendezvous set, with the values they had before (None: unset).
    saved_env: dict[str, str | None] = field(default_factory=dict)

    def close(self, comm: BootstrapComm) -> None:
        """Drop the store, put back the environment, and (file store) remove rank 0's folder once every
        rank is done with it; collective. Call it after ``destroy_process_group``."""
        self.store = None
        self.restore_env()
        if self.folder is not None:
            comm.Barrier()  # no rank still opens the store file
            if comm.Get_rank() == 0:
                remove_folder(self.folder)
            self.folder = None

    def restore_env(self) -> None:
        """Put back the environment variables this rendezvous set (alone: when ``init_process_group`` failed,
        the folder is left to the exit-time removal rather than to a collective that may never complete)."""
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_env = {}


#: Store folders rank 0 made and has not removed yet: removed at exit if the communicator was never closed.
_LEFT_AT_EXIT: set[str] = set()


def _remove_at_exit() -> None:
    """Remove the store folders this process still has (a job that never closed its communicator)."""
    for path in sorted(_LEFT_AT_EXIT):
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_at_exit)


def remove_folder(path: str) -> None:
    """Remove a store folder now, and from the exit-time list (rank 0)."""
    _LEFT_AT_EXIT.discard(path)
    shutil.rmtree(path, ignore_errors=True)


def rendezvous(
    comm: BootstrapComm,
    backend: str,
    interface: str = "",
    timeout_s: float = 300.0,
    single_node: bool | None = None,
) -> Rendezvous:
    """The store every rank of ``comm`` hands to ``init_process_group``, and the backend's network interface
    set as the module docstring says; collective.

    ``interface`` is ``[comm] interface`` (a network interface name; empty: rank 0's hostname). It applies
    only across nodes: one node uses loopback. ``single_node`` forces the one-node (True) or several-node
    (False) way; None decides from the hostnames gathered over MPI and from whether every rank sees rank 0's
    folder.
    """
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1 if single_node is None else single_node
    folder = shared_folder(comm) if one_host else None
    if folder is not None:
        store: dist.Store = dist.FileStore(os.path.join(folder, "store"), comm.Get_size())
        where, device = f"file store in {folder}", loopback_interface() if backend == "gloo" else ""
    else:
        device = interface
        if interface:
            check_interface(comm, interface)
        elif not one_host and any(comm.allgather(resolves_to_loopback(socket.gethostname()))):
            mine = pick_interface(comm)
            interface, device = mine.interface if comm.Get_rank() == 0 else "", mine.interface
        store, where = tcp_store(comm, hosts[0], interface, one_host, timeout_s)
    prefix = comm.bcast(secrets.token_hex(16) if comm.Get_rank() == 0 else None, root=0)
    saved = use_interface(backend, device) if device else {}
    return Rendezvous(dist.PrefixStore(f"mpicrossbow/{prefix}", store), where, folder, saved)


def pick_interface(comm: BootstrapComm) -> Address:
    """This rank's address on the subnet every rank shares (:func:`shared_interfaces`), the same error on
    every rank when there is none; collective. Rank 0 logs the choice."""
    per_rank = comm.allgather(host_addresses())
    try:
        chosen = shared_interfaces(per_rank)
    except ValueError as exc:
        raise RuntimeError(f"rendezvous across nodes: {exc}") from None
    if comm.Get_rank() == 0:
        log.info(
            "a hostname is on loopback: meeting on %s (rank 0: %s %s; [comm] interface overrides)",
            chosen[0].network(), chosen[0].interface, chosen[0].address,
        )  # fmt: skip
    return chosen[comm.Get_rank()]


def shared_folder(comm: BootstrapComm) -> str | None:
    """A private folder (mode 0700) rank 0 made under ``$TMPDIR`` or /tmp, if every rank sees it; else None
    (rank 0 could not make one, or the ranks do not share its file system). Collective."""
    made = None
    if comm.Get_rank() == 0:
        try:
            path = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
            info = os.stat(path)
            made = (path, info.st_dev, info.st_ino)
        except OSError as exc:
            log.warning("no private folder for the rendezvous store (%s): using a TCP store", exc)
    made = comm.bcast(made, root=0)
    if made is None:
        return None
    path, dev, ino = made
    try:
        info = os.stat(path)
        sees = (info.st_dev, info.st_ino) == (dev, ino)
    except OSError:
        sees = False
    if all(comm.allgather(sees)):
        if comm.Get_rank() == 0:
            _LEFT_AT_EXIT.add(path)
        return path
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        log.warning("the ranks share a hostname but not %s: using a TCP store", os.path.dirname(path))
    return None


def check_interface(comm: BootstrapComm, interface: str) -> None:
    """Raise the same ValueError on every rank unless every rank's host has network interface
    ``interface``; collective."""
    missing = comm.allgather(None if interface in interface_names() else socket.gethostname())
    hosts = sorted({host for host in missing if host is not None})
    if hosts:
        raise ValueError(
            f"[comm] interface = {interface}: no such network interface on {', '.join(hosts)} "
            f"(this host has {', '.join(interface_names())})"
        )


def store_address(host: str, interface: str, one_host: bool) -> str:
    """The address rank 0's store listens on: ``interface``'s IPv4 address, else what ``host`` (rank 0's
    hostname) resolves to; a loopback address only when every rank is on rank 0's host."""
    if interface:
        address = interface_ipv4(interface)
        if address is None:
            raise ValueError(f"[comm] interface = {interface}: the interface has no IPv4 address on {host}")
        return address
    address = socket.gethostbyname(host)
    if address.startswith("127.") and not one_host:
        raise ValueError(
            f"rank 0's hostname {host} resolves to {address}, which the other nodes cannot reach: "
            "set [comm] interface to the network interface the nodes share (e.g. ib0 or eth0)"
        )
    return address


def listening_socket(address: str) -> socket.socket:
    """A TCP socket bound to ``address`` (one address, never the wildcard) on a port the kernel picks,
    listening."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 0))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def tcp_store(
    comm: BootstrapComm, host: str, interface: str, one_host: bool, timeout_s: float
) -> tuple[dist.TCPStore, str]:
    """A TCPStore served by rank 0 on a socket bound to :func:`store_address`, and where; collective."""
    rank = comm.Get_rank()
    listener, endpoint = None, None
    if rank == 0:
        try:
            listener = listening_socket(store_address(host, interface, one_host))
            endpoint = (*listener.getsockname()[:2], None)
        except (OSError, ValueError) as exc:
            endpoint = (None, 0, f"rank 0 cannot serve the rendezvous store: {exc}")
    address, port, problem = comm.bcast(endpoint, root=0)
    if problem is not None:
        raise RuntimeError(problem)
    try:
        store = dist.TCPStore(
            address,
            port,
            comm.Get_size(),
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.detach() if listener is not None else None,  # the store owns it now
        )
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        who = (
            "rank 0 waited for the other ranks at" if rank == 0 else f"{socket.gethostname()} could not reach"
        )
        raise RuntimeError(
            f"rendezvous: {who} the store on {address}:{port} for {timeout_s:g} s ({first}); check that "
            "the nodes reach each other there, or set [comm] interface"
        ) from None
    return store, f"tcp store on {address}:{port}"


def use_interface(backend: str, interface: str) -> dict[str, str | None]:
    """Make ``backend`` put its sockets on network interface ``interface`` (its ``*_SOCKET_IFNAME``
    variable), unless the user set that variable; returns what was set, with its previous value (None)."""
    name = SOCKET_IFNAME.get(backend)
    if name is None:
        return {}
    if os.environ.get(name):
        log.info("%s=%s set by the user: %s uses it", name, os.environ[name], backend)
        return {}
    os.environ[name] = interface
    return {name: None}
