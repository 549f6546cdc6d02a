"""The torch.distributed communicator (Gloo on CPU, NCCL on GPU), bootstrapped from MPI.

MPI already knows every rank, so no ``MASTER_ADDR``/``MASTER_PORT`` is needed, and no rendezvous listener
on every interface either: :func:`~mpicrossbow.comm.rendezvous.rendezvous` picks the store over MPI and every
rank calls ``init_process_group(store=...)``. On one node (hostnames gathered over MPI) the store is a file
in a private folder rank 0 made (no socket; removed by :meth:`TorchDistCommunicator.close`) and Gloo's
sockets are on loopback; across nodes it is a TCP store rank 0 serves on one address (``[comm] interface``'s,
else its hostname's), under a random per-job key prefix.

``split`` builds torch groups: the (color, key) pairs are gathered over MPI, then every rank creates one group
per color in sorted order (``new_group`` is collective over the whole default group). ``new_group`` orders its
members by global rank, so the communicator keeps its own key-ordered member list and translates ranks
itself; peers and roots are always passed to torch as global ranks. Splitting a split uses
``use_local_synchronization`` (only the parent's ranks take part), which torch keys by the member set: such a
nested split cannot create the same member set twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpicrossbow.comm.base import Communicator, DoneHandle, Handle, ReduceOp
from mpicrossbow.comm.rendezvous import Rendezvous, rendezvous

log = logging.getLogger(__name__)

#: The torch.distributed backends this communicator drives.
TORCH_BACKENDS = ("gloo", "nccl")

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.MIN: dist.ReduceOp.MIN}


class TorchDistHandle(Handle):
    """A torch.distributed ``Work``: ``wait()`` makes the result usable (for NCCL, on the current stream)."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self) -> None:
        """Block until the work completes."""
        self._work.wait()

    def test(self) -> bool:
        """True once the work has completed; never blocks."""
        return self._work.is_completed()


class StagedHandle(Handle):
    """An operation that ran on a device copy of a CPU tensor (NCCL reduces CUDA tensors only): completing it
    copies the result back into the CPU tensor, once; the copy is kept alive until then."""

    def __init__(self, inner: Handle, staged: torch.Tensor, target: torch.Tensor | None) -> None:
        self._inner, self._staged, self._target = inner, staged, target
        self._done = False

    def wait(self) -> None:
        """Block until the operation completes, then copy its result back (receives and collectives)."""
        if self._done:  # a Gloo receive's wait() does not return a second time
            return
        self._inner.wait()
        if self._target is not None:
            self._target.copy_(self._staged)
        self._done = True

    def test(self) -> bool:
        """True once the operation has completed (its result then copied back); never blocks on it."""
        if not self._done and self._inner.test():
            self.wait()
        return self._done


class TorchDistCommunicator(Communicator):
    """A :class:`Communicator` over a torch.distributed process group; build it with :meth:`from_mpi`."""

    name = "torchdist"

    def __init__(
        self,
        mpi_comm: MPI.Comm,
        members: list[int],
        group: dist.ProcessGroup | None,
        backend: str,
        timeout_s: float,
        owns_default_group: bool = False,
        owns_mpi_comm: bool = False,
    ) -> None:
        self.name = backend
        self._mpi = mpi_comm
        self._members = members  # global torch ranks, in this communicator's rank order
        self._group = group  # None: the default group
        self._timeout = timedelta(seconds=timeout_s)
        self._rank = members.index(dist.get_rank())
        self._owns_default_group = owns_default_group
        self._owns_mpi_comm = owns_mpi_comm
        self._closed = False
        self._rendezvous: Rendezvous | None = None  # set on the communicator that made the default group
        #: Where CPU tensors go for an operation (None: they are used in place). NCCL runs on CUDA tensors
        #: only, while the training loop also agrees on small CPU values (the stop-signal flag, a rule's
        #: timings): under NCCL they travel through this rank's current CUDA device.
        self.stage_cpu_through: torch.device | None = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        )

    @classmethod
    def from_mpi(
        cls,
        mpi_comm: MPI.Comm | None = None,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        interface: str = "",
        single_node: bool | None = None,
    ) -> TorchDistCommunicator:
        """Initialise torch.distributed over the ranks of ``mpi_comm`` (default ``COMM_WORLD``); collective.

        ``interface`` (``[comm] interface``) is the network interface of a job across nodes; ``single_node``
        forces the one-node or several-node rendezvous (None: decided over MPI; see
        :func:`~mpicrossbow.comm.rendezvous.rendezvous`). If torch.distributed is already initialised with
        the same rank and size, its default group is reused (and left alone by :meth:`close`).
        """
        if backend not in TORCH_BACKENDS:
            valid = ", ".join(TORCH_BACKENDS)
            raise ValueError(f"unknown torch.distributed backend {backend!r}; valid: {valid}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("the nccl backend needs CUDA, and torch.cuda.is_available() is False here")
        comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        rank, size = comm.Get_rank(), comm.Get_size()
        members = list(range(size))
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (rank, size):
                raise RuntimeError("torch.distributed is already initialised with another rank or size")
            log.info("reusing the initialised torch.distributed default group")
            return cls(comm, members, None, dist.get_backend(), timeout_s)
        start = time.perf_counter()
        met = rendezvous(comm, backend, interface, timeout_s, single_node)
        try:
            dist.init_process_group(
                backend, store=met.store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
            )
        except BaseException:
            met.restore_env()
            raise
        log.info(
            "torch.distributed %s up: %d ranks via %s in %.2f s",
            backend,
            size,
            met.where,
            time.perf_counter() - start,
        )
        made = cls(comm, members, None, backend, timeout_s, owns_default_group=True)
        made._rendezvous = met
        return made

    @property
    def rendezvous(self) -> Rendezvous | None:
        """How the ranks met (the store, where it was, what close undoes); None on a split or a reused group,
        and once closed."""
        return self._rendezvous

    @property
    def mpi(self) -> MPI.Comm:
        """The mpi4py communicator spanning the same ranks (used for bootstrap and splits)."""
        return self._mpi

    @property
    def rank(self) -> int:
        """This process's rank in the communicator (key order after a split)."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the communicator."""
        return len(self._members)

    @staticmethod
    def _flat(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("TorchDistCommunicator needs a contiguous tensor; call .contiguous() first")
        return tensor.detach()

    @staticmethod
    def _handle(work: dist.Work | None) -> Handle:
        return DoneHandle() if work is None else TorchDistHandle(work)

    def _run(
        self, start: Callable[[torch.Tensor], dist.Work | None], tensor: torch.Tensor, writes: bool
    ) -> Handle:
        """``start`` the operation on ``tensor``, or on a device copy of it (:attr:`stage_cpu_through`);
        ``writes``: the result is copied back when the returned handle completes (at once if blocking)."""
        flat = self._flat(tensor)
        if self.stage_cpu_through is None or flat.device.type != "cpu":
            return self._handle(start(flat))
        staged = torch.empty_like(flat, device=self.stage_cpu_through).copy_(flat)
        work = start(staged)
        handle = StagedHandle(self._handle(work), staged, flat if writes else None)
        if work is None:  # blocking: the result is copied back now
            handle.wait()
        return handle

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """``dist.all_reduce`` in place."""
        return self._run(
            lambda t: dist.all_reduce(t, _OPS[op], group=self._group, async_op=async_op), tensor, writes=True
        )

    def allreduce_scalars(self, values: list[float], op: ReduceOp = ReduceOp.SUM) -> list[float]:
        """Allreduce a short list of floats in float64; blocking (under NCCL through the CUDA device, as
        every CPU tensor: :attr:`stage_cpu_through`)."""
        t = torch.tensor(values, dtype=torch.float64)
        self.allreduce(t, op).wait()
        return t.tolist()

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        """``dist.broadcast`` from communicator rank ``root``."""
        root_rank = self._members[root]
        return self._run(
            lambda t: dist.broadcast(t, root_rank, group=self._group, async_op=async_op),
            tensor,
            writes=self._rank != root,
        )

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """``dist.isend`` to communicator rank ``dst``."""
        peer = self._members[dst]
        return self._run(lambda t: dist.isend(t, peer, group=self._group, tag=tag), tensor, writes=False)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """``dist.irecv`` from communicator rank ``src``."""
        peer = self._members[src]
        return self._run(lambda t: dist.irecv(t, peer, group=self._group, tag=tag), tensor, writes=True)

    def split_node(self) -> TorchDistCommunicator:
        """Colour every rank by the lowest rank of its MPI shared-memory group, then :meth:`split`."""
        local = self._mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        try:
            color = local.bcast(self._rank, root=0)
        finally:
            local.Free()
        return self.split(color)

    def barrier(self) -> None:
        """``dist.barrier`` over the group (on the current device for NCCL)."""
        if self.name == "nccl":
            dist.barrier(group=self._group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=self._group)

    def split(self, color: int, key: int | None = None) -> TorchDistCommunicator:
        """One torch group per color, members ordered by (key, rank); collective over this communicator."""
        entries = self._mpi.allgather((color, self._rank if key is None else key))
        mine: tuple[list[int], dist.ProcessGroup] | None = None
        for c in sorted({c for c, _ in entries}):
            order = sorted((k, r) for r, (cc, k) in enumerate(entries) if cc == c)
            members = [self._members[r] for _, r in order]
            group = dist.new_group(
                members, timeout=self._timeout, use_local_synchronization=self._group is not None
            )
            if c == color:
                mine = (members, group)
        assert mine is not None
        child_mpi = self._mpi.Split(color, self._rank if key is None else key)
        child = TorchDistCommunicator(
            child_mpi, mine[0], mine[1], self.name, self._timeout.total_seconds(), owns_mpi_comm=True
        )
        return self._adopt(child)

    def close(self) -> None:
        """Close splits, free their MPI communicators, and destroy the default group if this one made it
        (then its rendezvous: the store folder goes, the environment is put back); collective."""
        if not self._close_children():
            return
        if self._owns_mpi_comm:
            self._mpi.Free()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._rendezvous is not None:
            self._rendezvous.close(self._mpi)
            self._rendezvous = None
