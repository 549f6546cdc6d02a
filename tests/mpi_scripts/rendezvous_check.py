"""The torch.distributed rendezvous on real ranks (mpicrossbow/comm/rendezvous.py): which sockets the ranks
listen on once Gloo is up, compared with what they listened on before (the MPI library's and the launcher's
own), on one node and across nodes (forced: ``single_node=False`` over the loopback interface).

Run as ``mpiexec -n N python tests/mpi_scripts/rendezvous_check.py``; tests/test_rendezvous_mpi.py asserts
the verdicts. Each check also prints ``NEW <check> rank <r> <address>:<port>`` for every socket the ranks
started to listen on.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from verdicts import WORLD, finish, run_checks, run_main, say

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the /proc reader

from listeners import Listener, listeners
from mpicrossbow.comm.interfaces import loopback_interface
from mpicrossbow.comm.torchdist import TorchDistCommunicator


def new_listeners(before: set[Listener], label: str) -> list[Listener]:
    """The sockets this rank listens on now and did not in ``before``, printed on rank 0 for every rank."""
    new = [s for s in listeners([os.getpid()]) if s not in before]
    for rank, found in enumerate(WORLD.allgather(new)):
        for s in found:
            say(f"NEW {label} rank {rank} {s.address}:{s.port}")
    return new


def exchange(comm: TorchDistCommunicator) -> None:
    """An allreduce over the job and one over a split (a new group: a second use of the store)."""
    t = torch.ones(3)
    comm.allreduce(t)
    assert t.tolist() == [WORLD.size] * 3, t
    sub = comm.split(WORLD.rank % 2)
    t = torch.ones(1)
    sub.allreduce(t)
    assert t.item() == len(range(WORLD.rank % 2, WORLD.size, 2)), t


def check_one_node() -> None:
    """A file store in a private folder, removed at close; no rank listens outside loopback, and rank 0
    listens on no more sockets than the others (it serves no store)."""
    before = set(listeners([os.getpid()]))
    comm = TorchDistCommunicator.from_mpi(backend="gloo", timeout_s=60)
    assert comm.rendezvous is not None
    folder = comm.rendezvous.folder
    assert folder is not None and comm.rendezvous.where == f"file store in {folder}"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    exchange(comm)
    new = new_listeners(before, "one_node")
    outside = [s for s in new if not s.loopback]
    assert not outside, f"listening outside loopback: {outside}"
    counts = WORLD.allgather(len(new))
    assert counts[0] == min(counts), f"rank 0 listens on more sockets than another rank: {counts}"
    comm.close()
    WORLD.Barrier()  # rank 0 removed the folder in close()
    assert not os.path.exists(folder), f"{folder} left behind"
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def check_several_nodes() -> None:
    """Rank 0 serves a TCP store on the interface's address (loopback here), never the wildcard; Gloo
    follows the interface."""
    before = set(listeners([os.getpid()]))
    lo = loopback_interface()
    comm = TorchDistCommunicator.from_mpi(backend="gloo", timeout_s=60, interface=lo, single_node=False)
    assert comm.rendezvous is not None and comm.rendezvous.folder is None
    where = comm.rendezvous.where
    assert where.startswith("tcp store on 127.0.0.1:"), where
    exchange(comm)
    new = new_listeners(before, "several_nodes")
    assert all(s.loopback for s in new), f"listening outside {lo}: {new}"
    port = int(where.rsplit(":", 1)[1])
    serves = any(s.port == port for s in new)
    assert serves == (WORLD.rank == 0), f"rank {WORLD.rank} serves the {where}: {serves}"
    comm.close()
    assert "GLOO_SOCKET_IFNAME" not in os.environ


CHECKS: list[tuple[str, Callable[[], None]]] = [
    ("one_node", check_one_node),
    ("several_nodes", check_several_nodes),
]


def main() -> int:
    """Run the checks; the exit status is non-zero if one failed on any rank."""
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    return finish(run_checks("rendezvous", CHECKS))


if __name__ == "__main__":
    run_main(main)
