"""Hierarchical allreduce through node-shared memory: faster than MPI's own allreduce inside a node.

Inside a node the ranks share one MPI-3 window (``MPI_Win_allocate_shared`` on the node communicator from
``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``). A float SUM allreduce of ``n`` elements runs, per chunk of at
most ``window_bytes`` of input per rank:

1. **copy in**: every rank copies its chunk into its own slot of the window;
2. **reduce-scatter by slices**: node rank ``r`` owns slice ``[n*r//p, n*(r+1)//p)`` (``p`` ranks on the
   node; sizes need not be multiples of ``p``) and sums that slice of every slot into the window's result
   area, **in node-rank order** ``((x_0 + x_1) + x_2) + ...``, in the accumulation dtype;
3. **across nodes** (only when the job spans several): the node leaders (node rank 0) run ``MPI_Allreduce``
   in place on the result area, among one leader per node;
4. **read back**: every rank copies the whole result into its tensor (bfloat16/float16 are rounded here,
   once).

A rank reads its own slice straight from its tensor and writes its own slice of the result straight into
it, so only the other slices are copied in and out. On one node the chunks are pipelined: phase j copies
chunk j-2 out, reduces chunk j-1 and copies chunk j in, so a chunk costs one synchronisation, and the window
is double-buffered (chunks alternate between two halves) so nothing is overwritten before it has been read.

Synchronisation follows the MPI-3 idiom for the unified memory model: the window stays in one passive-target
epoch (``MPI_Win_lock_all``); a sync is ``MPI_Win_sync``, then each rank publishes an epoch counter in its
header and polls the others' (``MPI_Win_sync`` between polls, the core yielded after a few polls), then
``MPI_Win_sync`` (``sync="barrier"`` uses ``MPI_Barrier`` on the node communicator instead). After the first
sync of every allreduce the ranks compare what they are reducing (size, dtype, path) and all raise the same
``ValueError`` if they differ, instead of summing unrelated memory.

**No copy at all**: :meth:`SharedMemoryCommunicator.share` moves a tensor's memory (its whole storage, so
every view follows) into a node-shared segment in place and maps every node peer's counterpart; the session
does this for the pool's flat parameter, gradient and buffer storage and the rules for their exchange
buffers, so it is the default path of training. (:meth:`SharedMemoryCommunicator.shared_buffer` hands out a
fresh tensor in its own window instead.) An allreduce of such a tensor (or of a slice at the same offset on
every rank) skips steps 1 and 4: node rank r sums slice r of every rank's buffer (same order) and writes the
sum into all of them — one read and one write of the buffer per rank, the traffic of one memcpy. Across
nodes the leaders then allreduce their node sums in place and the other ranks copy the result from their
leader's buffer (one copy instead of two; 16-bit dtypes take the copying path there, to sum in float32).

Summation order, bit for bit: the sum is ``S = Σ_nodes N_k`` with ``N_k = ((x_0 + x_1) + x_2) + ...`` over
node k's ranks in node-rank order, each addition rounded in the accumulation dtype (float32 for float32,
bfloat16 and float16; float64 for float64). On one node ``S = N_0``: exactly reproducible, independent of
chunking and of the MPI library. Across nodes the node sums are combined by the library's ``MPI_Allreduce``
among the leaders (for two nodes ``N_0 + N_1``, commutative and so exact; beyond, the order of the library's
algorithm, which the MPI standard recommends give the same result for the same arguments on the same ranks).
bfloat16/float16 inputs are accumulated in float32 (also across nodes) and rounded once, when read back.

Everything else — MAX/MIN, integer dtypes, CUDA tensors, broadcast, point-to-point, split — is the plain
:class:`~mpicrossbow.comm.mpi.MPICommunicator`'s, as are SUMs smaller than ``min_bytes`` (MPI's latency is
lower there). ``allreduce(..., async_op=True)`` on the shared-memory path completes before it returns and
hands back a :class:`~mpicrossbow.comm.base.DoneHandle`: the reduction is memory-bound and the machine's
cores are busy with backward anyway, so a background thread would only compete for them.

The window is freed by :meth:`SharedMemoryCommunicator.close` (collective, as ``MPI_Win_free`` is). MPICH
and Open MPI unlink the segment's file as soon as every rank has mapped it, so a rank that dies (an
exception followed by ``MPI_Abort``) leaves no segment behind in ``/dev/shm`` either.

**Elastic training** (``notice_failures``): a wait asks MPI for the failures ULFM knows of (``MPI_Iprobe``
on the run's communicator, after :data:`SPINS` polls), and the leaders' sum across nodes is non-blocking and
polled the same way, so a lost rank ends every survivor's wait with MPI's error and the survivors recover
(:mod:`mpicrossbow.comm.elastic`). The window is then torch's descriptor-backed shared memory, each rank's
segment mapped by its node peers (as the zero-copy buffers are), ordered by a memory fence instead of
``MPI_Win_sync``: no MPI window, which Open MPI warns about in a fault-tolerant job and which could not be
freed once a member is dead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import weakref
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from mpi4py import MPI

from mpicrossbow.comm.backoff import Backoff
from mpicrossbow.comm.base import DoneHandle, Handle, ReduceOp
from mpicrossbow.comm.mpi import MPICommunicator
from mpicrossbow.comm.peer_watch import PeerWatch

log = logging.getLogger(__name__)

#: Dtypes summed through the window, and the dtype each is accumulated in.
ACCUMULATE = {
    torch.float32: torch.float32,
    torch.float64: torch.float64,
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
}
#: Bytes of input per rank per chunk, by default. Measured at 100 MB, 2 ranks (results/exchange.md):
#: on a loaded machine 16 and 64 MB chunks took 0.43 and 0.41 x raw MPI's time, 4 MB 0.53 and 1 MB 1.2 (each
#: sync waits for a descheduled rank). The window then takes (2p + 4) x 16 MB of shared memory.
DEFAULT_WINDOW_BYTES = 16 << 20
#: SUMs below this many bytes go to MPI_Allreduce (lower latency; measured crossover in exchange.md).
DEFAULT_MIN_BYTES = 64 << 10
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(ACCUMULATE)}
_DTYPE_NAMES = {i: str(dtype) for dtype, i in _DTYPE_CODES.items()}
#: Elements per tile of the zero-copy path's accumulator (1 MB of float32: stays in L2).
TILE = 1 << 18
#: Polls of the other ranks' flags before each further poll gives the core back (:class:`.Backoff`).
SPINS = 100
#: With ``notice_failures``: polls past :data:`SPINS` between two questions to MPI while the wait yields
#: (``MPI_Iprobe`` takes about 1.4 us here, a yielding poll about 1 us: asking at every poll delayed each
#: sync's end by up to one question, 6 us of a digits allreduce); once it naps, after every nap. Every 32nd
#: nap (the count alone, before) let a SIGKILLed peer's survivors wait 160-270 ms on the dead: ULFM needs
#: a few of these progress calls to raise the failure (benchmarks.vs_torchft: the stall at the loss).
ASK_EVERY = 32
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedMemoryUnavailable(RuntimeError):
    """The descriptor-backed window of ``notice_failures`` cannot be made on some node (raised on every rank
    of the job alike): the caller exchanges through MPI instead."""


class _Window:
    """One shared window on a node, an MPI-3 window (``MPI_Win_allocate_shared``). Each rank's segment: a
    64-byte header (its sync epoch and what its current allreduce is, int64), then two input slots of
    ``slot_bytes``; node rank 0's also holds two result areas of ``2 * slot_bytes`` (room for float32
    accumulators of a 16-bit input)."""

    def __init__(self, node: MPI.Comm, slot_bytes: int) -> None:
        self.slot_bytes = _align(slot_bytes)
        self.result_bytes = 2 * self.slot_bytes
        mine = _ALIGN + 2 * self.slot_bytes + (2 * self.result_bytes if node.Get_rank() == 0 else 0)
        self.segments = self._allocate(node, mine)
        # per rank: [sync epoch, path, byte offset, bytes, dtype] — see SharedMemoryCommunicator._agree
        self.headers = [seg[:40].numpy().view(np.int64) for seg in self.segments]
        self.headers[node.Get_rank()][:] = 0
        base = _ALIGN + 2 * self.slot_bytes
        self.results = [self.segments[0][base + i * self.result_bytes :][: self.result_bytes] for i in (0, 1)]
        self.slots = [
            [seg[_ALIGN + i * self.slot_bytes :][: self.slot_bytes] for seg in self.segments] for i in (0, 1)
        ]
        self.sync()
        node.Barrier()  # every flag is initialised before anyone waits on it
        self.sync()

    def _allocate(self, node: MPI.Comm, mine: int) -> list[torch.Tensor]:
        """Every node rank's segment as bytes, this rank's of ``mine`` bytes (collective over the node)."""
        try:
            self.win = MPI.Win.Allocate_shared(mine, 1, comm=node)
        except MPI.Exception as exc:
            raise RuntimeError(
                f"could not allocate a {mine} B shared window ({exc}); is /dev/shm big enough? A smaller "
                "[comm] shm_window_mb, or shared_memory = off, needs less"
            ) from exc
        try:
            self.win.Lock_all(MPI.MODE_NOCHECK)
            return [self._segment(q) for q in range(node.Get_size())]
        except BaseException:
            self.win.Free()
            raise

    def _segment(self, rank: int) -> torch.Tensor:
        buf, _ = self.win.Shared_query(rank)
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))

    def sync(self) -> None:
        """``MPI_Win_sync``: this rank's stores to the window are visible before its later ones, and its
        later loads see what the others made visible (the unified memory model's idiom)."""
        self.win.Sync()

    def refresh(self) -> None:
        """Between two reads of a peer's flag: ``MPI_Win_sync`` (the idiom's poll)."""
        self.win.Sync()

    def free(self) -> None:
        """End the epoch and free the window (collective over the node)."""
        self.segments, self.slots, self.results, self.headers = [], [], [], []
        self.win.Unlock_all()
        self.win.Free()


class _DescriptorWindow(_Window):
    """The same window in torch's descriptor-backed shared memory, each rank's segment mapped by its node
    peers through ``/proc/<pid>/fd`` (as :meth:`SharedMemoryCommunicator.share` maps buffers): no MPI window,
    for elastic training. Open MPI warns, at every window a fault-tolerant job makes, that its one-sided
    components are "not tested for post-failure operation"; and an MPI window cannot be freed once a member
    is dead (``MPI_Win_free`` is collective), where these segments are unmapped when the communicator that
    holds them is dropped. The ordering ``MPI_Win_sync`` gave is a sequentially consistent fence
    (:data:`FENCE`)."""

    def _allocate(self, node: MPI.Comm, mine: int) -> list[torch.Tensor]:
        """Every node rank's segment, mapped; RuntimeError on every node rank when one cannot be."""
        if FENCE is None:
            raise RuntimeError(f"no memory fence for node-shared memory on {platform.machine()} (libatomic)")
        segments, problems = _share_with_node(node, _fresh_segment(mine), same_size=False)
        if segments is None:
            reasons = "; ".join(f"node rank {q}: {r}" for q, r in enumerate(problems) if r)
            raise RuntimeError(f"node-shared memory cannot be mapped ({reasons})")
        return segments

    def sync(self) -> None:
        """A sequentially consistent fence (:data:`FENCE`)."""
        assert FENCE is not None
        FENCE()

    def refresh(self) -> None:
        """Nothing: every read of a flag loads it from memory again (caches are coherent); the fence after
        the poll orders what follows."""

    def free(self) -> None:
        """Drop the mappings (local: each process unmaps its own)."""
        self.segments, self.slots, self.results, self.headers = [], [], [], []


def _fence() -> Callable[[], None] | None:
    """Nothing on x86-64, whose memory model (TSO) already gives what the flag protocol needs: a rank's stores
    are seen in program order by every other core, and its loads are not reordered with loads nor with later
    stores. Elsewhere ``atomic_thread_fence(memory_order_seq_cst)`` from libatomic, or None where that is
    missing (the descriptor-backed window is then unavailable)."""
    if platform.machine() in ("x86_64", "AMD64"):
        return lambda: None
    try:
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        return None
    fence.argtypes, fence.restype = [ctypes.c_int], None
    return functools.partial(fence, 5)  # memory_order_seq_cst


#: The memory fence of :class:`_DescriptorWindow`, or None where this machine has none for Python.
FENCE = _fence()


class _Buffer:
    """A window of ``nbytes`` per rank handed out by :meth:`SharedMemoryCommunicator.shared_buffer`."""

    def __init__(self, node: MPI.Comm, nbytes: int) -> None:
        self.win = MPI.Win.Allocate_shared(_align(max(nbytes, 1)), 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.segments = [
            torch.from_numpy(np.frombuffer(self.win.Shared_query(q)[0], dtype=np.uint8))
            for q in range(node.Get_size())
        ]
        mine = self.segments[node.Get_rank()]
        self.start, self.stop = mine.data_ptr(), mine.data_ptr() + mine.numel()

    def alive(self) -> bool:
        """Always: the window lives until :meth:`free`."""
        return True

    def free(self) -> None:
        """End the epoch and free the window (collective over the node)."""
        self.segments = []
        self.win.Unlock_all()
        self.win.Free()


class _Moved:
    """A tensor's storage moved into node-shared memory in place (torch's descriptor-backed shared memory,
    a mechanism of ``torch.multiprocessing``), with every node peer's counterpart mapped (:func:`_map_peers`).

    Valid while the tensor handed to :meth:`SharedMemoryCommunicator.share` lives (a weak reference): a pool
    that rebuilds its buffers drops the old entry, and memory reused at the same address is never mistaken
    for it. The memory is freed when the last process unmaps it.
    """

    def __init__(self, owner: torch.Tensor, segments: list[torch.Tensor]) -> None:
        self.owner = weakref.ref(owner)
        self.segments = segments
        self.start = owner.untyped_storage().data_ptr()
        self.stop = self.start + owner.untyped_storage().nbytes()

    def alive(self) -> bool:
        """Whether the tensor it was made for still exists and still holds this storage."""
        owner = self.owner()
        return owner is not None and owner.untyped_storage().data_ptr() == self.start

    def free(self) -> None:
        """Drop the mappings (local: each process unmaps its own)."""
        self.segments = []


def _map_peers(
    gathered: list[tuple[int, int, int] | None],
    me: int,
    storage: torch.UntypedStorage,
    same_size: bool = True,
) -> list[torch.Tensor] | None:
    """Every node rank's segment as bytes (this rank's own ``storage``), from the ``(pid, fd, bytes)`` each
    published; None if a segment is missing, of another size than this rank's (when ``same_size``), or
    cannot be opened.

    torch's descriptor-backed shared memory has no name from the start (``shm_open`` then ``shm_unlink``):
    nothing can be left in ``/dev/shm``, however a job ends — a job ended by ``MPI_Abort`` kills torch's
    shared-memory manager, which would otherwise leave named segments behind (measured). A peer opens the
    owner's descriptor through ``/proc/<pid>/fd``, which Linux allows between processes of one user.
    """
    segments = []
    for q, entry in enumerate(gathered):
        if entry is None or (same_size and entry[2] != storage.nbytes()):
            return None
        if q == me:
            segments.append(_bytes_of(storage))
            continue
        pid, fd, nbytes = entry
        try:
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError:
            return None
        try:
            segments.append(_bytes_of(torch.UntypedStorage._new_shared_fd_cpu(opened, nbytes)))
        finally:
            os.close(opened)
    return segments


def _share_with_node(
    node: MPI.Comm, storage: torch.UntypedStorage, same_size: bool = True
) -> tuple[list[torch.Tensor] | None, list[str]]:
    """Publish ``storage``'s descriptor to the node and map every peer's (collective over the node): every
    node rank's segment (None on every rank when some rank could not take part), and each rank's problem
    ('' where none)."""
    problem = ""
    try:
        fd, _ = storage._share_fd_cpu_()
        mine: tuple[int, int, int] | None = (os.getpid(), fd, storage.nbytes())
    except RuntimeError as exc:  # a storage shared another way already (a DataLoader worker's, say)
        mine, problem = None, str(exc).splitlines()[0]
    gathered = node.allgather(mine)
    segments = _map_peers(gathered, node.Get_rank(), storage, same_size) if mine else None
    if segments is None and not problem:
        problem = "a node peer's segment could not be opened through /proc"
    problems = node.allgather(problem)
    return (None if any(problems) else segments), problems


def _fresh_segment(nbytes: int) -> torch.UntypedStorage:
    """A zeroed descriptor-backed segment of ``nbytes`` (a memfd: no name anywhere, as torch's own has none
    once unlinked) whose pages are taken as they are first written, where torch's ``_new_shared`` writes
    every page up front: 23 ms for 64 MB here, and an elastic run builds its window again in every recovery
    and replacement, with the survivors waiting (0.1 ms this way)."""
    fd = os.memfd_create("mpicrossbow-window", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps a duplicate of the descriptor
    finally:
        os.close(fd)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class SharedMemoryCommunicator(MPICommunicator):
    """An :class:`MPICommunicator` whose float SUM allreduce goes through node-shared memory (see module doc).

    ``node`` overrides the node communicator (default: ``Split_type(COMM_TYPE_SHARED)`` of ``comm``); its
    ranks must share memory. Tests pass a split of one machine's ranks to run the multi-node path.

    ``notice_failures`` (elastic training): a wait past :data:`SPINS` polls also calls ``MPI_Iprobe`` on
    ``comm`` (every :data:`ASK_EVERY` polls), which makes MPI progress, so a failure ULFM reports on ``comm``
    (a member lost, the communicator revoked by a member that met one) ends the wait with MPI's own error
    within milliseconds (measured: 5 ms after a SIGKILL) instead of waiting on the dead; the leaders' sum
    across nodes is then non-blocking and polled the same way, since a loss on another node leaves the
    leaders' communicator intact. The caller turns that error into its recovery
    (:mod:`mpicrossbow.comm.elastic`).
    """

    name = "mpi+shm"

    @property
    def overlaps(self) -> bool:
        """False: a shared-memory sum completes before ``allreduce`` returns, even with ``async_op``."""
        return False

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        node: MPI.Comm | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        min_bytes: int = DEFAULT_MIN_BYTES,
        sync: Literal["flags", "barrier"] = "flags",
        notice_failures: bool = False,
        _owned: bool = False,
    ) -> None:
        super().__init__(comm, _owned=_owned)
        if sync not in ("flags", "barrier"):
            raise ValueError(f"sync must be flags or barrier, got {sync!r}")
        self.sync = sync
        #: Whether a wait also asks MPI for the failures it knows of (elastic training, see the class doc)
        self.notice_failures = notice_failures
        self._epoch = 0
        if window_bytes < _ALIGN:
            raise ValueError(f"window_bytes must be at least {_ALIGN}, got {window_bytes}")
        world = self._comm
        self._node = (node if node is not None else world).Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
        if node is not None and self._node.Get_size() != node.Get_size():
            size = self._node.Get_size()
            self._node.Free()
            raise ValueError(f"the ranks of the given node communicator do not all share memory ({size})")
        leader = self._node.Get_rank() == 0
        #: Whether the peers the flag poll waits for can still answer (a dead peer, a job that ended)
        self._watch = PeerWatch(
            self._node.Get_rank(), dict(enumerate(self._node.allgather(PeerWatch.mine())))
        )
        #: How a wait past :data:`SPINS` polls gives the core back (yield, then nap)
        self._backoff = Backoff()
        self._leaders = world.Split(0 if leader else MPI.UNDEFINED, key=world.rank)
        self.nodes = world.allreduce(int(leader))
        self.window_bytes = window_bytes
        self.min_bytes = min_bytes
        self._window: _Window | None = None
        self._buffers: list[_Buffer | _Moved] = []
        self._tiles: dict[torch.dtype, torch.Tensor] = {}
        self._parity = 0
        if notice_failures:  # at once, agreed by the job: the caller can still fall back on every rank
            problem = ""
            try:
                self._ensure_window()
            except RuntimeError as exc:
                problem = str(exc)
            problems = [p for p in world.allgather(problem) if p]
            if problems:
                if self._window is not None:
                    self._window.free()  # local: a descriptor-backed window
                if self._leaders != MPI.COMM_NULL:
                    self._leaders.Free()
                self._node.Free()
                raise SharedMemoryUnavailable(problems[0])

    @property
    def node_size(self) -> int:
        """Ranks on this rank's node."""
        return self._node.Get_size()

    def _sync(self) -> None:
        """Make this rank's stores to the window visible to the node, and wait for every rank's.

        ``flags`` (default): the MPI-3 shared-memory polling idiom — ``MPI_Win_sync``, publish this rank's
        epoch in its flag, poll the other ranks' flags (giving the core back after :data:`SPINS` polls,
        yielding then napping (:class:`.Backoff`), which matters when ranks outnumber free cores or wait
        long for a straggler; a wait past a second asks :class:`PeerWatch` whether the peer is still alive
        and the job still running, and ends in its ``PeerGone`` if not),
        ``MPI_Win_sync``. ``barrier``: ``MPI_Win_sync``, a barrier on the node communicator, ``MPI_Win_sync``.
        """
        window = self._window
        assert window is not None
        window.sync()
        if self.sync == "barrier":
            self._node.Barrier()
        else:
            self._epoch += 1
            epoch, me = self._epoch, self._node.Get_rank()
            window.headers[me][0] = epoch
            window.sync()
            polls = 0
            for q, header in enumerate(window.headers):
                while q != me and header[0] < epoch:
                    polls += 1
                    if polls > SPINS:
                        napped = self._backoff.pause()
                        self._watch.waiting("the shared-memory allreduce")
                        self._ask_mpi(polls, napped)
                    window.refresh()
            self._watch.reset()
            self._backoff.reset()
        window.sync()

    def _ask_mpi(self, polls: int, napped: bool) -> None:
        """With ``notice_failures``, at every :data:`ASK_EVERY`-th poll, and after every nap (``napped``):
        let MPI progress on the run's communicator, where ULFM raises a failure it knows of
        (ERR_PROC_FAILED, ERR_REVOKED); nothing is received (``MPI_Iprobe`` only looks)."""
        if self.notice_failures and (napped or polls % ASK_EVERY == 0):
            self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def _across_nodes(self, buf: np.ndarray) -> None:
        """Step 3: the leaders' ``MPI_Allreduce`` in place of their node sums, non-blocking, its wait polled
        (napping as :meth:`_sync` does; with ``notice_failures`` asking MPI for failures, since a rank lost on
        another node fails the run's communicator, not the leaders'). Never the blocking call: MPICH's
        blocking ``MPI_Allreduce`` died of SIGSEGV when the other node's leader vanished (a whole node killed,
        on a loaded 2-core machine: 2 of 3 fresh-clone CIs, and 1 of 1 by hand under load; polled, 0 of 4),
        and a rank dead of a crash hid the lost node from the job's failure line; polled, the rank stays in
        Python, where the watchdog names the lost node's ranks (tests/test_slurm_netns.py)."""
        if self._leaders == MPI.COMM_NULL:
            return
        request, polls = self._leaders.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM), 0
        while not request.Test():
            polls += 1
            if polls > SPINS:
                self._ask_mpi(polls, self._backoff.pause())
        self._backoff.reset()

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """SUM of a float CPU tensor through the shared window (blocking even when ``async_op``: the handle
        returned is already complete); anything else through :class:`MPICommunicator`."""
        if (
            op is not ReduceOp.SUM
            or tensor.dtype not in ACCUMULATE
            or tensor.device.type != "cpu"
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or self._closed
        ):
            return super().allreduce(tensor, op, async_op)
        if not tensor.is_contiguous():
            raise ValueError("SharedMemoryCommunicator needs a contiguous tensor; call .contiguous() first")
        self._ensure_window()
        flat = tensor.detach().view(-1)
        nbytes = flat.numel() * flat.element_size()
        buffer = self._shared_holding(flat)
        if buffer is not None and (self.nodes == 1 or flat.dtype == ACCUMULATE[flat.dtype]):
            self._in_place(flat, buffer, flat.data_ptr() - buffer.start)
            return DoneHandle()
        self._publish(0, 0, nbytes, flat.dtype)
        assert self._window is not None
        step = self._window.slot_bytes // flat.element_size()
        chunks = [flat[start : start + step] for start in range(0, flat.numel(), step)]
        if self.nodes == 1:
            self._pipeline(chunks)
        else:
            for i, part in enumerate(chunks):
                self._hierarchical(part, check=i == 0)
        return DoneHandle()

    def _ensure_window(self) -> None:
        if self._window is None:
            kind = _DescriptorWindow if self.notice_failures else _Window
            self._window = kind(self._node, self.window_bytes)
            log.debug(
                "shared window: %d B per slot, %d rank(s) on this node", self.window_bytes, self.node_size
            )

    def _shared_holding(self, flat: torch.Tensor) -> _Buffer | _Moved | None:
        """The shared buffer ``flat`` lies in, if any (entries whose tensor is gone are dropped first)."""
        for stale in [b for b in self._buffers if not b.alive()]:
            stale.free()
            self._buffers.remove(stale)
        ptr = flat.data_ptr()
        return next((b for b in self._buffers if b.start <= ptr and ptr + flat.nbytes <= b.stop), None)

    def share(self, tensor: torch.Tensor) -> None:
        """Move ``tensor``'s storage into node-shared memory in place and map the node peers' (collective over
        the node; every rank passes a tensor with a storage of the same size). Every view of the storage
        follows (a pool's module parameters, its learners' flat rows); allreduces of it then take the
        zero-copy path. Tensors this path never sums (not a float CPU tensor, or a storage under
        ``min_bytes``) are left where they are, on every rank alike; so is a storage some rank cannot share
        (one shared another way already, or a peer's memory it may not open), with a warning.
        """
        storage = tensor.untyped_storage()
        if (
            self._closed
            or tensor.device.type != "cpu"
            or tensor.dtype not in ACCUMULATE
            or storage.nbytes() < max(self.min_bytes, 1)
        ):
            return
        segments, reasons = _share_with_node(self._node, storage)
        if segments is None:
            log.warning(
                "shared memory: a %d B buffer stays private, its allreduces copy in and out (%s)",
                storage.nbytes(),
                "; ".join(f"node rank {q}: {r}" for q, r in enumerate(reasons) if r),
            )
            return
        assert segments is not None
        self._buffers = [b for b in self._buffers if b.start != storage.data_ptr()]
        self._buffers.append(_Moved(tensor, segments))
        log.debug("shared memory: %d B buffer shared with %d node rank(s)", storage.nbytes(), len(segments))

    def shared_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D CPU tensor that lives in node-shared memory (collective over the node; every rank
        asks for the same ``numel`` and ``dtype``). An allreduce of it (or of a slice of it at the same
        offset on every rank) needs no copy in or out: node rank r sums slice r of every rank's buffer, in
        the same order as the copying path, and writes the sum into every rank's buffer. Use it as a flat
        buffer (``pool.flat.point_into``); it is valid until :meth:`close`, which frees it.
        """
        if dtype not in ACCUMULATE:
            raise TypeError(f"shared buffers hold {', '.join(map(str, ACCUMULATE))}, not {dtype}")
        if self.notice_failures:  # no MPI window (see _DescriptorWindow): a tensor shared in place instead
            tensor = torch.zeros(numel, dtype=dtype)
            self.share(tensor)
            return tensor
        self._ensure_window()
        buffer = _Buffer(self._node, numel * dtype.itemsize)
        self._buffers.append(buffer)
        mine = buffer.segments[self._node.Get_rank()][: numel * dtype.itemsize].view(dtype)
        mine.zero_()
        return mine

    def _publish(self, path: int, offset: int, nbytes: int, dtype: torch.dtype) -> None:
        """Write what this rank's allreduce is into its header, for :meth:`_agree` after the first sync."""
        assert self._window is not None
        header = self._window.headers[self._node.Get_rank()]
        header[1:5] = (path, offset, nbytes, _DTYPE_CODES[dtype])

    def _agree(self) -> None:
        """After the first sync of an allreduce: every rank of the node must be running the same one (path,
        offset into a shared buffer, size, dtype). Each rank reads the same headers and so raises alike."""
        assert self._window is not None
        seen = [tuple(int(v) for v in header[1:5]) for header in self._window.headers]
        if len(set(seen)) > 1:
            self._parity = 0  # every rank stops at the same point: start the next call in step
            described = "; ".join(
                f"node rank {q}: {'shared buffer' if path else 'copy'} path, offset {off} B, {n} B, "
                f"{_DTYPE_NAMES[code]}"
                for q, (path, off, n, code) in enumerate(seen)
            )
            raise ValueError(f"ranks called allreduce on different buffers: {described}")

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """As :meth:`Communicator.allreduce_mean`; on the zero-copy path of one node each tile is divided
        while in cache (the same per-element sum and one division: the same bits as ``div_`` after)."""
        flat = tensor.detach().view(-1) if tensor.is_contiguous() else None
        buffer = self._shared_holding(flat) if flat is not None and tensor.device.type == "cpu" else None
        if (
            buffer is None
            or self.nodes > 1
            or tensor.dtype != ACCUMULATE.get(tensor.dtype)
            or flat.nbytes < self.min_bytes
            or self._closed
        ):
            super().allreduce_mean(tensor, count)
            return
        self._ensure_window()  # its headers synchronise the ranks
        self._in_place(flat, buffer, flat.data_ptr() - buffer.start, count)

    def _in_place(self, flat: torch.Tensor, buffer: _Buffer | _Moved, offset: int, divisor: int = 1) -> None:
        """Zero-copy allreduce of a slice of a shared buffer: sync; node rank r sums slice r of every
        rank's buffer, tile by tile (the accumulator stays in cache), and writes it into all of them; sync.
        Several nodes: then the leaders allreduce in place, sync, the others copy their leader's, sync."""
        dtype, acc = flat.dtype, ACCUMULATE[flat.dtype]
        n, p, me, nbytes = (
            flat.numel(),
            self.node_size,
            self._node.Get_rank(),
            flat.numel() * flat.element_size(),
        )
        self._publish(1, offset, nbytes, dtype)
        self._sync()
        self._agree()
        views = [seg[offset : offset + nbytes].view(dtype) for seg in buffer.segments]
        lo, hi = n * me // p, n * (me + 1) // p
        scratch = self._scratch(acc)
        for start in range(lo, hi, TILE):
            stop = min(start + TILE, hi)
            out = scratch[: stop - start]
            terms = [view[start:stop] for view in views]
            if p > 1 and dtype == acc:
                torch.add(terms[0], terms[1], out=out)
            else:
                out.copy_(terms[0])
                if p > 1:
                    out.add_(terms[1])
            for term in terms[2:]:
                out.add_(term)
            if divisor != 1:
                out.div_(divisor)
            for term in terms:
                term.copy_(out)
        self._sync()
        if self.nodes > 1:
            self._across_nodes(flat.numpy())
            self._sync()
            if me:
                flat.copy_(views[0])
            self._sync()  # the leader's buffer is read until here

    def _scratch(self, acc: torch.dtype) -> torch.Tensor:
        """A private accumulator tile per accumulation dtype."""
        tile = self._tiles.get(acc)
        if tile is None:
            tile = self._tiles[acc] = torch.empty(TILE, dtype=acc)
        return tile

    def _views(self, part: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, int, int]:
        """For the next chunk: every rank's slot and the result area (window half of the current parity),
        and this rank's slice bounds."""
        window = self._window
        assert window is not None
        dtype, acc = part.dtype, ACCUMULATE[part.dtype]
        n, p, me = part.numel(), self.node_size, self._node.Get_rank()
        slots = [s[: n * part.element_size()].view(dtype) for s in window.slots[self._parity]]
        result = window.results[self._parity][: n * acc.itemsize].view(acc)
        self._parity ^= 1
        return slots, result, n * me // p, n * (me + 1) // p

    def _copy_in(self, part: torch.Tensor, slots: list[torch.Tensor], lo: int, hi: int) -> None:
        """Step 1, without this rank's own slice: only this rank reads it, straight from ``part``."""
        mine = slots[self._node.Get_rank()]
        mine[:lo].copy_(part[:lo])
        mine[hi:].copy_(part[hi:])

    def _reduce(
        self, part: torch.Tensor, slots: list[torch.Tensor], result: torch.Tensor, lo: int, hi: int
    ) -> None:
        """Step 2: ``result[lo:hi] = ((x_0 + x_1) + x_2) + ...`` over node ranks, in accumulation dtype."""
        me = self._node.Get_rank()
        terms = [part[lo:hi] if q == me else slot[lo:hi] for q, slot in enumerate(slots)]
        out = result[lo:hi]
        if len(terms) > 1 and part.dtype == out.dtype:
            torch.add(terms[0], terms[1], out=out)
        else:
            out.copy_(terms[0])
            if len(terms) > 1:
                out.add_(terms[1])
        for term in terms[2:]:
            out.add_(term)

    def _pipeline(self, chunks: list[torch.Tensor]) -> None:
        """One node: phase j copies chunk j-2 out, reduces chunk j-1 and copies chunk j in, then one sync.

        A chunk's slots are written in phase j and read in j+1, its result written in j+1 and read in j+2;
        the two window halves alternate, so a half is rewritten only after a sync that follows every read
        of it (also across calls: the parity carries on). Own slices go straight into the tensor.
        """
        views = [self._views(part) for part in chunks]
        for phase in range(len(chunks) + 2):
            if phase >= 2:
                part, (_, result, lo, hi) = chunks[phase - 2], views[phase - 2]
                part[:lo].copy_(result[:lo])
                part[hi:].copy_(result[hi:])
            if 1 <= phase <= len(chunks):
                part, (slots, result, lo, hi) = chunks[phase - 1], views[phase - 1]
                self._reduce(part, slots, result, lo, hi)
                part[lo:hi].copy_(result[lo:hi])
            if phase < len(chunks):
                part, (slots, _, lo, hi) = chunks[phase], views[phase]
                self._copy_in(part, slots, lo, hi)
            if phase <= len(chunks):
                self._sync()
            if phase == 0:
                self._agree()

    def _hierarchical(self, part: torch.Tensor, check: bool) -> None:
        """Several nodes, one chunk: copy in, sync, reduce the slice, sync, leaders allreduce the node sums,
        sync, copy the whole result out."""
        slots, result, lo, hi = self._views(part)
        self._copy_in(part, slots, lo, hi)
        self._sync()
        if check:
            self._agree()
        self._reduce(part, slots, result, lo, hi)
        self._sync()
        self._across_nodes(result.numpy())
        self._sync()
        part.copy_(result)

    def close(self) -> None:
        """Free the window and the node and leader communicators (collective), then what
        :meth:`MPICommunicator.close` frees. Idempotent."""
        if self._closed:
            return
        for buffer in self._buffers:
            buffer.free()
        self._buffers.clear()
        if self._window is not None:
            self._window.free()
            self._window = None
        if self._leaders != MPI.COMM_NULL:
            self._leaders.Free()
        self._node.Free()
        super().close()
