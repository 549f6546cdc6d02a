"""16-bit exchange (``[comm] compression``): the wrapper's own behaviour on the in-process world — which
buffers it compresses, when results are widened, buffer lifetimes, full-precision server state, and which
exchanges of every rule travel 16-bit.

What a compressed allreduce, broadcast or message delivers (rounded values, float32 sums rounded once, the
exact tail of a message, ``exact`` and splits), in process and over MPI, is the Communicator contract's:
tests/test_communicator_contract.py runs it on the wrapper with its model of lossy transfers.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import train_steps
from models.mlp import MLP
from mpicrossbow.comm import CompressedCommunicator, ReduceOp
from mpicrossbow.comm.base import Communicator, Handle
from mpicrossbow.comm.compressed import EXACT_TAIL
from mpicrossbow.config import OptimSection, load_config
from mpicrossbow.errors import ConfigError, UsageError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import ASGD, BSP, EASGD, GOSGD, PSGD, SMA, SSP, DiLoCo, LocalSGD, Rule, WeedOut
from mpicrossbow.rules.easgd_server import EASGDServer
from mpicrossbow.rules.parameter_server import (
    PULL_TAG,
    PUSH_HEADER,
    PUSH_TAG,
    REPLY_HEADER,
    ParameterServer,
    Policy,
)
from mpicrossbow.testing import InProcessWorld

WIRES = [torch.bfloat16, torch.float16]
N = 1500  # above the default threshold (1024), not a multiple of any world size


def values(rank: int, numel: int = N, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank-specific values with bits below 16-bit precision, so rounding is visible."""
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def rounded(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """``t`` through the wire type and back to float32."""
    return t.to(wire).to(torch.float32)


def message(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """What a point-to-point message of ``t`` delivers: rounded values, the last EXACT_TAIL bit-exact."""
    out = rounded(t, wire)
    out[-EXACT_TAIL:] = t[-EXACT_TAIL:]
    return out


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("op", list(ReduceOp))
def test_async_allreduce_is_widened_only_at_completion(wire: torch.dtype, op: ReduceOp) -> None:
    """The 16-bit result reaches the caller's tensor when the handle completes, not before (the in-process
    world has finished the reduction when ``allreduce`` returns)."""

    def body(comm: Communicator) -> bool:
        a = values(comm.rank)
        handle = CompressedCommunicator(comm, wire).allreduce(a, op, async_op=True)
        untouched = torch.equal(a, values(comm.rank))
        handle.wait()
        return untouched and not torch.equal(a, values(comm.rank))

    assert InProcessWorld(2).run(body) == [True, True]


@pytest.mark.parametrize("wire", WIRES)
def test_isend_copies_at_once_and_irecv_widens_at_completion(wire: torch.dtype) -> None:
    """The caller's tensor may change as soon as ``isend`` returns (a 16-bit copy is on the wire); nothing
    lands in the receive buffer before its handle completes, and ``test()`` completes it."""

    def body(comm: Communicator) -> dict[str, Any]:
        c = CompressedCommunicator(comm, wire)
        left, right = (c.rank - 1) % c.size, (c.rank + 1) % c.size
        out, into = values(c.rank), torch.zeros(N)
        recv = c.irecv(into, left, tag=5)
        send = c.isend(out, right, tag=5)
        out.fill_(7.0)
        before = into.clone()
        c.barrier()  # every rank has sent (in-process sends are buffered): test() completes the receive
        done = recv.test()
        send.wait()
        recv.wait()
        return {"into": into, "before": before, "done": done, "left": left}

    for result in InProcessWorld(3).run(body):
        assert result["done"]
        assert torch.equal(result["before"], torch.zeros(N))
        assert torch.equal(result["into"], message(values(result["left"]), wire))
        assert not torch.equal(result["into"], rounded(values(result["left"]), wire))  # the tail is exact


class DeferredHandle(Handle):
    """A handle that completes only when told to, and records whether the caller asked."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action, self.done = action, False

    def wait(self) -> None:
        if not self.done:
            self.action()
            self.done = True

    def test(self) -> bool:
        return self.done


class Deferred(Communicator):
    """A one-rank communicator whose sends and receives complete only on ``wait`` (like a slow MPI)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.mail: list[torch.Tensor] = []
        self.send_buffers: list[weakref.ref[torch.Tensor]] = []

    rank = 0  # type: ignore[assignment]
    size = 1  # type: ignore[assignment]

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        raise NotImplementedError

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        self.send_buffers.append(weakref.ref(tensor))  # only a weak reference: the handle must keep it
        ref = self.send_buffers[-1]

        def deliver() -> None:
            buffer = ref()
            assert buffer is not None, "the 16-bit send buffer was freed before the send completed"
            self.mail.append(buffer.clone())

        return DeferredHandle(deliver)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        ref = weakref.ref(tensor)

        def arrive() -> None:
            buffer = ref()
            assert buffer is not None, "the 16-bit receive buffer was freed before the message arrived"
            buffer.copy_(self.mail.pop(0))

        return DeferredHandle(arrive)

    def barrier(self) -> None:
        """Nothing to wait for."""

    def split(self, color: int, key: int | None = None) -> Communicator:
        raise NotImplementedError


@pytest.mark.parametrize("wire", WIRES)
def test_handles_keep_the_16_bit_buffers_alive_until_completion(wire: torch.dtype) -> None:
    inner = Deferred()
    comm = CompressedCommunicator(inner, wire)
    send = comm.isend(values(0), 0)  # the source tensor is a temporary: only the handle holds the copy
    into = torch.zeros(N)
    recv = comm.irecv(into, 0)
    gc.collect()
    assert inner.send_buffers[0]() is not None
    assert not recv.test() and torch.equal(into, torch.zeros(N))  # nothing widened before completion
    pointers = {send.buffer.data_ptr(), recv.buffer.data_ptr()}  # type: ignore[attr-defined]
    send.wait()
    recv.wait()
    assert torch.equal(into, message(values(0), wire))
    assert send.buffer is None and recv.buffer is None  # type: ignore[attr-defined]
    again = comm.isend(values(1), 0)  # completed buffers are reused, not reallocated
    assert again.buffer.data_ptr() in pointers  # type: ignore[attr-defined]
    again.wait()


def test_what_is_compressed() -> None:
    """float32/float64 tensors of at least ``min_numel`` elements travel 16-bit; integers, bools, tensors
    already 16-bit and smaller tensors (metrics, flags, counters) never do."""
    comm = CompressedCommunicator(Deferred(), torch.bfloat16)
    assert comm.min_numel == 1024
    for dtype in (torch.float32, torch.float64):
        assert comm.compresses(torch.zeros(1024, dtype=dtype))
        assert not comm.compresses(torch.zeros(1023, dtype=dtype))
    for dtype in (torch.int32, torch.int64, torch.bool, torch.uint8, torch.float16, torch.bfloat16):
        assert not comm.compresses(torch.zeros(N, dtype=dtype))
    assert CompressedCommunicator(comm.exact, torch.float16, min_numel=10).compresses(torch.zeros(10))


def test_bad_compression_is_one_clear_error() -> None:
    base = "RULE=BSP\nMODELFILE=models.mlp\nMODELCLASS=MLP\nDEVICES=cpu\n"
    message = r"\[comm\] compression: 'fp8' is not valid; choose one of none, fp16, bf16"
    with pytest.raises(ConfigError, match=message):
        load_config(text=base + "[comm]\ncompression = fp8\n")
    assert load_config(text=base + "[comm]\ncompression = bf16\n").comm.compression == "bf16"
    assert load_config(text=base).comm.compression == "none"
    with pytest.raises(UsageError, match="compression"):
        load_config(text=base + "[comm]\ncompression = int8\n")


# --------------------------------------------------------------- full-precision state of the servers


@pytest.mark.parametrize("wire", WIRES)
def test_parameter_server_keeps_w_in_float32(wire: torch.dtype) -> None:
    """Pushes arrive rounded; w accumulates them in float32 (not rounded); replies go out rounded."""
    w0 = values(99)
    deltas = [values(1) * 1e-3, values(2) * 1e-3]

    def body(comm: Communicator) -> Any:
        c = CompressedCommunicator(comm, wire)
        if c.rank == 0:
            server = ParameterServer(c, w0.clone(), 1.0, Policy(), None, [1])
            server.serve(lambda w, epoch: None)
            return server.w, server.progress[1]
        replies = []
        for i, delta in enumerate([*deltas, None]):
            request = torch.zeros(N + PUSH_HEADER)  # [Δ, flag, progress, seen, number]
            request[N] = 1.0 if delta is None else 0.0
            request[N + 1] = 0.1 * i + 1 / 3  # progress: not representable in 16 bits
            request[N + 2] = i
            request[N + 3] = i + (delta is not None)  # the push's number (a DONE: the pushes made)
            if delta is not None:
                request[:N] = delta
                reply = torch.zeros(N + REPLY_HEADER)  # [w, updates, confirmed]
                recv = c.irecv(reply, 0, PULL_TAG)
            c.isend(request, 0, PUSH_TAG).wait()
            if delta is not None:
                recv.wait()
                replies.append(reply)
        return replies

    (w, progress), replies = InProcessWorld(2).run(body)
    assert progress == float(torch.tensor(0.2 + 1 / 3))  # the done message's progress arrived bit-exact
    want = w0.clone()
    for i, delta in enumerate(deltas):
        # Δ's last EXACT_TAIL − PUSH_HEADER values ride in the exact tail
        want += message(torch.cat([delta, torch.zeros(PUSH_HEADER)]), wire)[:N]
        assert torch.equal(replies[i], message(torch.cat([want, torch.tensor([i + 1.0, i + 1.0])]), wire))
    assert w.dtype == torch.float32 and torch.equal(w, want)
    assert not torch.equal(w, rounded(w, wire))  # w itself was never rounded


@pytest.mark.parametrize("wire", WIRES)
def test_easgd_server_keeps_the_centre_in_float32(wire: torch.dtype) -> None:
    alpha, centre0, x = 0.25, values(50), values(51)

    def body(comm: Communicator) -> torch.Tensor:
        c = CompressedCommunicator(comm, wire)
        if c.rank == 0:
            server = EASGDServer(c, centre0.clone(), alpha)
            server.serve(lambda centre, epoch: None)
            return server.centre
        request, reply = torch.zeros(N + 2), torch.zeros(N)
        request[:N] = x
        recv = c.irecv(reply, 0, 7102)
        c.isend(request, 0, 7101).wait()
        recv.wait()
        request[:N], request[N] = 0.0, 1.0
        c.isend(request, 0, 7101).wait()
        return reply

    centre, reply = InProcessWorld(2).run(body)
    sent = message(torch.cat([x, torch.tensor([0.0, 0.0])]), wire)[:N]  # x's last 2 values are in the tail
    e = (sent - centre0) * alpha
    assert torch.equal(centre, centre0 + e) and torch.equal(reply, message(e, wire))
    assert not torch.equal(centre, rounded(centre, wire))


# --------------------------------------------- every rule: what travels 16-bit and what stays exact


class Spy(Communicator):
    """Delegates to an in-process communicator and logs (phase, operation, dtype, numel) of every transfer."""

    def __init__(
        self, inner: Communicator, log: list[tuple[str, str, torch.dtype, int]], phase: list[str]
    ) -> None:
        self.inner, self.log, self.phase = inner, log, phase

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _note(self, op: str, tensor: torch.Tensor) -> None:
        self.log.append((self.phase[0], op, tensor.dtype, tensor.numel()))

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        self._note("allreduce", tensor)
        return self.inner.allreduce(tensor, op, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, async_op: bool = False) -> Handle:
        self._note("broadcast", tensor)
        return self.inner.broadcast(tensor, root, async_op)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        self._note("isend", tensor)
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        self._note("irecv", tensor)
        return self.inner.irecv(tensor, src, tag)

    def barrier(self) -> None:
        self.inner.barrier()

    def split(self, color: int, key: int | None = None) -> Communicator:
        return Spy(self.inner.split(color, key), self.log, self.phase)

    def split_node(self) -> Communicator:
        return Spy(self.inner.split_node(), self.log, self.phase)


RULES: dict[str, Callable[[], Rule]] = {
    "BSP-grad": lambda: BSP(mode="grad"),
    "BSP-avg": lambda: BSP(mode="avg"),
    "SMA": lambda: SMA(),
    "EASGD-sync": lambda: EASGD(tau=2),
    "EASGD-async": lambda: EASGD(mode="async", tau=2),
    "GOSGD": lambda: GOSGD(p=1.0),
    "ASGD": lambda: ASGD(),
    "SSP": lambda: SSP(),
    "PSGD": lambda: PSGD(),
    "WEEDOUT": lambda: WeedOut(),
    "LOCALSGD-hier": lambda: LocalSGD(period=4, inner_period=2),
    "DILOCO": lambda: DiLoCo(period=2),
}


@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_exchanges_16_bit_while_training_and_exactly_otherwise(name: str) -> None:
    """Training exchanges of parameters/gradients reach the inner communicator as bf16 only; the initial
    broadcast and ``sync_state`` (the model every rank validates) reach it in float32; the state a rule
    keeps stays float32."""
    size, steps = 4, 6
    torch.manual_seed(0)
    optim = OptimSection(lr=0.05, momentum=0.9)
    pools = [
        SerialPool(MLP(hidden=16), PoolSpec(r, size, 8, optim, torch.device("cpu"), seed=1))
        for r in range(size)
    ]
    logs: list[list[tuple[str, str, torch.dtype, int]]] = [[] for _ in range(size)]

    def body(comm: Communicator) -> Rule:
        phase = ["bind"]
        c = CompressedCommunicator(Spy(comm, logs[comm.rank], phase), torch.bfloat16)
        pool, rule = pools[comm.rank], RULES[name]()
        rule.trains(comm.rank, size)
        rule.bind(c, pool)
        phase[0] = "train"
        if rule.trains(comm.rank, size):
            train_steps(pool, rule, steps)
        else:
            rule.serve(lambda w, epoch: None)
        rule.finish()
        phase[0] = "sync"
        rule.sync_state()
        return rule

    rules = InProcessWorld(size, timeout_s=60, ranks_per_node=2).run(body)
    n = pools[0].learners[0].params.numel()
    assert n >= 1024
    for log in logs:  # (a receive posted at bind, as GOSGD's, belongs to training)
        big = [(phase, op, dtype) for phase, op, dtype, numel in log if numel >= 1024]
        assert {dtype for phase, op, dtype in big if phase == "train" or op == "irecv"} <= {torch.bfloat16}
        assert {dtype for phase, op, dtype in big if phase != "train" and op != "irecv"} <= {torch.float32}
        assert ("bind", "broadcast", torch.float32) in big
    assert any(dtype == torch.bfloat16 for log in logs for *_, dtype, _ in log)
    for rule in rules:  # state kept by the rules is full precision
        for attr in ("z", "centre", "w", "average_params", "_mean"):
            state = getattr(rule, attr, None)
            if isinstance(state, torch.Tensor):
                assert state.dtype == torch.float32
