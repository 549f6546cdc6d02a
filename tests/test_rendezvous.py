"""The rendezvous store of the torch.distributed communicators (mpicrossbow/comm/rendezvous.py), in one
process: a one-rank stand-in for the MPI communicator drives both ways, the one-node file store and the
several-node TCP store (forced with ``single_node=False``), and /proc tells which sockets they listen on.

The same on real ranks, and a whole training job: tests/test_rendezvous_mpi.py.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from listeners import listeners
from mpicrossbow.comm.interfaces import (
    Address,
    host_addresses,
    interface_ipv4,
    interface_names,
    loopback_interface,
    shared_interfaces,
)
from mpicrossbow.comm.rendezvous import FOLDER_PREFIX, rendezvous, tcp_store
from mpicrossbow.config import CommSection

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GLOO = "GLOO_SOCKET_IFNAME"


class SoloComm:
    """The part of an mpi4py communicator the rendezvous uses, for a world of one rank."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, sendobj: Any) -> list[Any]:
        return [sendobj]

    def Barrier(self) -> None:
        pass


def mine() -> set[tuple[str, int]]:
    """This process's listening sockets as (address, port)."""
    return {(s.address, s.port) for s in listeners([os.getpid()])}


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tempfile``'s folder (``$TMPDIR``) is a fresh folder of this test; Gloo's interface is unset."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # forget the cached folder
    monkeypatch.delenv(GLOO, raising=False)
    return folder


def ipv4_interfaces() -> list[tuple[str, str]]:
    """(name, IPv4 address) of every interface of this host that has one."""
    return [(name, a) for name in interface_names() if (a := interface_ipv4(name)) is not None]


def test_loopback_interface_holds_127_0_0_1() -> None:
    name = loopback_interface()
    assert name in interface_names()
    assert interface_ipv4(name) == "127.0.0.1"


def test_one_node_store_is_a_file_in_a_private_folder_and_no_socket(private_tmp: Path) -> None:
    before = mine()
    met = rendezvous(SoloComm(), "gloo", interface="eth-unused", single_node=True)  # interface: across nodes
    try:
        assert met.folder is not None and Path(met.folder).parent == private_tmp
        assert Path(met.folder).name.startswith(FOLDER_PREFIX)
        assert stat.S_IMODE(os.stat(met.folder).st_mode) == 0o700
        assert met.where == f"file store in {met.folder}"
        met.store.set("key", "value")
        assert met.store.get("key") == b"value"
        assert os.listdir(met.folder) == ["store"]
        assert mine() == before, "the file store opened a listening socket"
        assert os.environ[GLOO] == loopback_interface()  # Gloo's own sockets on loopback
    finally:
        met.close(SoloComm())
    assert list(private_tmp.iterdir()) == []
    assert GLOO not in os.environ


def test_a_users_gloo_interface_is_kept(private_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO, "mine0")
    met = rendezvous(SoloComm(), "gloo", single_node=True)
    assert os.environ[GLOO] == "mine0"
    met.close(SoloComm())
    assert os.environ[GLOO] == "mine0"


@pytest.mark.parametrize("name, address", ipv4_interfaces())
def test_several_nodes_store_listens_on_the_interface_address_only(
    private_tmp: Path, name: str, address: str
) -> None:
    """Across nodes rank 0 serves the store on ``[comm] interface``'s address, never on the wildcard; the
    interface becomes Gloo's; no file is made."""
    before = mine()
    met = rendezvous(SoloComm(), "gloo", interface=name, timeout_s=10, single_node=False)
    try:
        new = mine() - before
        assert len(new) == 1, new
        ((bound, port),) = new
        assert bound == address
        assert met.where == f"tcp store on {address}:{port}"
        assert met.folder is None and list(private_tmp.iterdir()) == []
        assert os.environ[GLOO] == name
        met.store.set("key", "value")
        assert met.store.get("key") == b"value"
        # The keys live under the job's random prefix: a client that connects without it finds none.
        outsider = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=10))
        assert not outsider.check(["key"])
        del outsider
    finally:
        met.close(SoloComm())
    assert GLOO not in os.environ


def test_several_nodes_default_address_is_rank_0s_hostname(
    private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No interface: the address rank 0's hostname resolves to (here: stood in for by an interface's)."""
    _, address = ipv4_interfaces()[-1]
    monkeypatch.setattr(socket, "gethostbyname", lambda host: address)
    before = mine()
    met = rendezvous(SoloComm(), "gloo", timeout_s=10, single_node=False)
    try:
        assert {a for a, _ in mine() - before} == {address}
        assert GLOO not in os.environ  # Gloo chooses as it always does
    finally:
        met.close(SoloComm())


def test_several_nodes_with_a_hostname_on_loopback_meet_on_a_shared_subnet(
    private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian's ``127.0.1.1 <hostname>``: no refusal and no hang; the ranks pick the interface of a subnet
    they all share, rank 0's store listens on its address there, and Gloo uses that interface."""
    addresses = host_addresses()
    if not addresses:
        pytest.skip("this host has no IPv4 address but loopback")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    met = rendezvous(SoloComm(), "gloo", timeout_s=10, single_node=False)
    try:
        assert met.where.startswith(f"tcp store on {addresses[0].address}:")
        assert os.environ[GLOO] == addresses[0].interface
    finally:
        met.close(SoloComm())
    assert GLOO not in os.environ


def test_each_rank_takes_its_own_interface_on_the_first_subnet_all_share() -> None:
    ranks = [
        [Address("eth0", "10.0.0.1", 24), Address("ib0", "192.168.1.1", 16)],
        [Address("ens3", "10.0.9.9", 24), Address("ib1", "192.168.7.2", 16)],
        [Address("ib0", "192.168.3.3", 16)],
    ]
    assert shared_interfaces(ranks) == [ranks[0][1], ranks[1][1], ranks[2][0]]
    assert shared_interfaces(ranks[:2])[0].interface == "ib0"  # eth0's /24 is not shared either
    both = [[Address("eth0", "10.0.0.1", 24)], [Address("eth1", "10.0.0.2", 24)]]
    assert [a.interface for a in shared_interfaces(both)] == ["eth0", "eth1"]


def test_ranks_without_a_shared_subnet_are_told_what_each_has() -> None:
    apart = [[Address("eth0", "10.0.0.1", 24)], [Address("eth0", "10.0.1.1", 24)], []]
    with pytest.raises(
        ValueError, match=r"rank 0: eth0 10\.0\.0\.1/24; rank 1: eth0 10\.0\.1\.1/24; rank 2: none"
    ):
        shared_interfaces(apart)


class SecondOfTwo(SoloComm):
    """Rank 1 of 2, told by "rank 0" where the store is."""

    def __init__(self, port: int) -> None:
        self.port = port

    def Get_rank(self) -> int:
        return 1

    def Get_size(self) -> int:
        return 2

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return ("127.0.0.1", self.port, None)


def test_a_store_that_cannot_be_reached_ends_with_the_address_tried() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RuntimeError, match=rf"could not reach the store on 127\.0\.0\.1:{port} for 1 s"):
        tcp_store(SecondOfTwo(port), "head", "", one_host=False, timeout_s=1)


def test_an_unknown_interface_is_refused_by_name(private_tmp: Path) -> None:
    with pytest.raises(ValueError, match=r"\[comm\] interface = nosuch0: no such network interface on .*lo"):
        rendezvous(SoloComm(), "gloo", interface="nosuch0", single_node=False)


def test_interface_setting_defaults_to_empty() -> None:
    assert CommSection().interface == ""
    assert CommSection(interface="ib0").interface == "ib0"
