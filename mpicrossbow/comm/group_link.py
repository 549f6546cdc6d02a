"""The link between replica groups: the leaders of several MPI jobs (a node each, or a set of nodes) sum a
tensor over Gloo, and a group's loss costs that group, never the others (issue 52: a lost node).

Why a link between jobs rather than one job: Open MPI 5.0's runtime ends every rank when it loses a node's
daemon, whatever its fault-tolerance options (docs/reliability.md), so a node must not share a runtime with
the others. Why not torchft's Manager for it: its quorum every step cost 78 ms a step against 4.2 ms on the
same job (benchmarks/results/faults.md); here the quorum is formed again only after a loss, and a step pays
one Gloo allreduce and three or four store round trips.

Who sends what to whom, and when (groups ``0..G-1``; the rendezvous, a ``TCPStore``, on group 0's leader,
which therefore must outlive the others, as torchft's lighthouse must):

* **Heartbeats.** A thread of every leader adds 1 to ``beat/<g>`` every :data:`BEAT_S` over a store
  connection of its own. A member whose count has not moved for ``dead_after_s`` is lost.
* **A sum** (:meth:`GroupLink.allreduce`), the n-th committed one in era ``e`` (keys under ``e/n/``): the
  era's leaders allreduce over its Gloo group, each polling; then each adds 1 to ``done``, and the one that
  brings it to the quorum's size sets ``outcome`` to ``commit``. A leader whose allreduce failed, or that
  sees a member's heartbeat stop while it waits, sets ``outcome`` to ``fail`` instead. Both by
  compare-and-set: the first word stands, and every leader acts on the same one.
* **After a fail**, every survivor aborts the era's Gloo group and registers under ``e+1/alive/<g>``; group
  0's leader waits until every member whose heartbeat still moves has registered (at most ``join_s``), writes
  ``e+1/members`` and logs one line naming the lost group(s); every member builds era ``e+1``'s Gloo group
  over them and does sum n again from its own input, saved before the first try. A leader left out (its
  heartbeat stopped: too slow, or cut off) raises :class:`GroupLost`, as does any leader when the rendezvous
  itself is gone.

* **A group back** (its job restarted after a loss, on the same node or a spare): its leader finds the run
  under way (``started``, set by group 0's leader once every group first reached the rendezvous: ``1`` when
  it admits groups back, ``admit``; else the returning leader ends at once with one line), sets
  ``join/<g>`` and adds 1 to ``joins``. Group 0's leader looks at ``joins`` before each sum; when a joiner
  waits, it sets the try's ``grow`` to the joiners before its own part of the sum, so the leader that
  completes the sum (which needs group 0's part) sees it and says ``grow`` instead of ``commit``. A grow is a
  commit that leaves the joiners **pending** (:attr:`GroupLink.pending`, the same on every member): the
  members go on summing without them until their caller reaches a point where its state is whole (a
  training step's boundary) and calls :meth:`GroupLink.admit_pending` there, every member at the same sum.
  Then group 0's leader writes era ``e+1``'s members (the quorum and the joiners) and ``admit/<g>`` (the era
  and the sums committed), every member and joiner builds the era's Gloo group, and the quorum's lowest
  group (the source) hands its state to the joiners (:meth:`GroupLink.share_state`, collective over the
  era: a broadcast over Gloo). The joiner takes its first part in the next sum, at the same count as the
  others: nothing is summed twice or without it. A run that ends with a joiner still waiting tells it so
  (``admit/<g>`` = ``ended``).

The sum returned is over the groups of the quorum :meth:`GroupLink.allreduce` returns: a caller that
averages divides by what it summed (a count element in the tensor), not by the group count of the start;
when :meth:`GroupLink.admit_pending` returns a quorum whose ``joined`` is not empty, every member calls
:meth:`GroupLink.share_state` next.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from .backoff import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The reductions the link carries.
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

#: Seconds between two heartbeats of a leader.
BEAT_S = 0.25
#: Seconds between two looks at the store (outcome, heartbeats) while a Gloo allreduce is in flight.
LOOK_S = 0.05
#: Seconds every group's leader has to reach the rendezvous at the start (its job's start-up: imports, the
#: data, another node's Slurm step starting later).
START_S = 120.0
#: Seconds a restarted group's leader tries to reach the rendezvous: the run was under way when its job was
#: started again, so a store not there by then has ended with the run (the store's own connection timeout,
#: ``join_s`` + 30 s, is for a first start, where group 0's job may start later than the others).
RESTART_CONNECT_S = 10.0
#: Gloo's own timeout on an operation: the backstop behind the heartbeats (an aborted era's operation that
#: a peer never finishes ends by it).
GLOO_TIMEOUT_S = 120.0


class GroupLost(RuntimeError):
    """This group left the quorum (its heartbeat was seen stopped), or the rendezvous is gone."""


@dataclass(frozen=True)
class Quorum:
    """The groups that sum together in one era: ``era`` counts the quorums formed after a loss or a return;
    ``joined``: the groups that came back at its start (they take ``source``'s state first)."""

    era: int
    groups: tuple[int, ...]
    joined: tuple[int, ...] = ()
    source: int = 0

    def index(self, group: int) -> int:
        """``group``'s rank in the era's Gloo group."""
        return self.groups.index(group)


def _route_address(address: str, port: int) -> str:
    """This host's address on the route to ``address`` (no packet sent): where the other leaders can reach
    this one, whatever its hostname resolves to (a loopback address on many Debian hosts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))
        return str(probe.getsockname()[0])


def _listening(address: str, port: int, within_s: float) -> bool:
    """Whether something accepts a TCP connection on ``address:port`` within ``within_s`` (tried every 0.2 s;
    the connection is closed at once): a plain probe, so that an absent store costs neither the store
    client's retries nor its C++ error lines."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 0.1)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _retire(held: list[dist.ProcessGroupGloo]) -> None:
    """Abort the Gloo group in ``held`` (its only reference) and keep it for the rest of the process, never
    destroyed: its destructor waits for an operation still in flight with a member that stopped (up to
    :data:`GLOO_TIMEOUT_S`), and one run from a thread at exit ends the process with ``terminate``. One
    such group a loss."""
    try:
        held[0].abort()
    except RuntimeError:
        pass
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(held.pop()))


class _Heartbeat:
    """A thread adding 1 to ``beat/<group>`` every :data:`BEAT_S` over a store connection of its own."""

    def __init__(self, host: str, port: int, group: int) -> None:
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
        self._key, self._stop = f"beat/{group}", threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._beat, name=f"link-beat-{group}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._store.add(self._key, 1)
            except (RuntimeError, OSError):  # the rendezvous is gone: the main thread says so
                return

    def stop(self, wait: bool = True) -> None:
        """End the thread (its last beat at most :data:`BEAT_S` ago); ``wait``: for it to end."""
        self._stop.set()
        if wait:
            self._thread.join(BEAT_S * 4)


class GroupLink:
    """One group leader's end of the link (the protocol: the module doc). ``groups`` groups start in era 0;
    :meth:`allreduce` sums over the live ones; :meth:`close` at the end. ``restarted``: this leader's job
    started its group again after a loss, so the rendezvous is tried for ``restart_connect_s`` only (the run
    ended if it is not there by then)."""

    def __init__(
        self,
        host: str,
        port: int,
        group: int,
        groups: int,
        dead_after_s: float = 2.0,
        join_s: float = 30.0,
        start_s: float = START_S,
        admit: bool = False,
        on_lost: Callable[[dict[int, str]], None] | None = None,
        restarted: bool = False,
        restart_connect_s: float = RESTART_CONNECT_S,
    ) -> None:
        if not 0 <= group < groups:
            raise ValueError(f"group {group} of {groups}: groups are 0..{groups - 1}")
        self.group, self.groups, self.dead_after_s, self.join_s = group, groups, dead_after_s, join_s
        #: Group 0's leader: whether groups that come back are admitted (their callers take the state).
        self.admit = admit
        #: Group 0's leader: called with the groups lost (group -> host) as it forms a quorum without them.
        self.on_lost = on_lost
        timeout = datetime.timedelta(seconds=join_s + 30.0)
        address = socket.gethostbyname(host)
        #: Where this leader's Gloo sockets listen: its address on the route to the rendezvous.
        self.local_address = _route_address(address, port)
        listener = socket.create_server((address, port)) if group == 0 else None  # never the wildcard
        if restarted and group != 0 and not _listening(address, port, restart_connect_s):
            raise GroupLost(
                f"link: group {group} started again, but the rendezvous on {host}:{port} was not there "
                f"within {restart_connect_s:g} s: the run has ended, nothing left to train"
            )
        try:
            self._store = dist.TCPStore(
                address, port, is_master=group == 0, wait_for_workers=False, timeout=timeout,
                master_listen_fd=listener.detach() if listener is not None else None,  # the store owns it
            )  # fmt: skip
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise GroupLost(
                f"link: group {group} cannot reach the rendezvous on {host}:{port} ({first})"
            ) from None
        # Before this leader announces itself: a run under way means its group's job was restarted.
        returning = group != 0 and self._store_call(lambda: self._store.check(["started"]))
        self._store_call(lambda: self._store.set(f"host/{group}", socket.gethostname()))
        self._beat = _Heartbeat(address, port, group)
        #: The committed sums so far (the same number on every member).
        self.committed = 0
        self.quorum = Quorum(0, tuple(range(groups)))
        self._seen: dict[int, tuple[int, float]] = {}
        self._joins = 0
        #: Groups back and admitted at a commit, waiting for :meth:`admit_pending` (the same on every member).
        self.pending: tuple[int, ...] = ()
        self._pg: dist.ProcessGroupGloo | None = None
        #: :meth:`close` ran: a second call does nothing (group 0's leader may have ended the rendezvous).
        self._closed = False
        if returning:
            self._rejoin(start_s)
            return
        self._await_start(groups, start_s, f"{host}:{port}")
        if group == 0:
            self._store_call(lambda: self._store.set("started", "1" if admit else "0"))
        self._pg = self._connect()

    def _await_start(self, groups: int, start_s: float, where: str) -> None:
        """Wait until every group's leader has reached the rendezvous, at most ``start_s``: a group that
        never starts (its job failed first, another address or group count given to it) is named in one
        line, not in Gloo's timeout of its connection."""
        deadline, missing = time.monotonic() + start_s, list(range(groups))
        while True:
            missing = [
                g for g in missing if not self._store_call(lambda g=g: self._store.check([f"host/{g}"]))
            ]
            if not missing:
                return
            if time.monotonic() >= deadline:
                self._beat.stop(wait=False)
                raise GroupLost(
                    f"link: group(s) {', '.join(map(str, missing))} of {groups} never reached the rendezvous "
                    f"on {where} within {start_s:g} s: start every group's job with the same [link] "
                    "address and groups"
                )
            time.sleep(0.1)

    def _rejoin(self, wait_s: float) -> None:
        """A returning group: ask to join, wait (at most ``wait_s``) until group 0's leader admits it at a
        commit, then build the era's Gloo group with the others; the caller takes the state next
        (:meth:`share_state`). At once :class:`GroupLost` when the run takes no group back."""
        if self._store_call(lambda: self._store.get("started")) != b"1":
            self._beat.stop(wait=False)
            raise GroupLost(
                f"link: group {self.group} came back to a run under way, which takes no group back: this job "
                "ends, the other groups train on"
            )
        self._store_call(lambda: self._store.set(f"join/{self.group}", "1"))
        self._store_call(lambda: self._store.add("joins", 1))
        admit, deadline = f"admit/{self.group}", time.monotonic() + wait_s
        while not self._store_call(lambda: self._store.check([admit])):
            if time.monotonic() >= deadline:
                self._beat.stop(wait=False)
                raise GroupLost(
                    f"link: group {self.group} came back but was not admitted within {wait_s:g} s (the "
                    "others ended, or never reached a sum)"
                )
            time.sleep(LOOK_S)
        said = self._store_call(lambda: self._store.get(admit))
        if said == b"ended":
            self._beat.stop(wait=False)
            raise GroupLost(f"link: group {self.group} came back as the run ended: nothing left to train")
        era, committed = (int(v) for v in said.split(b","))
        self._store_call(lambda: self._store.delete_key(admit))
        members = self._store_call(lambda: self._store.get(f"{era}/members")).split(b",")
        source = int(self._store_call(lambda: self._store.get(f"{era}/source")))
        self.committed = committed
        self.quorum = Quorum(era, tuple(int(g) for g in members), (self.group,), source)
        self._pg = self._connect()
        log.warning(
            "link: group %d back in era %d at sum %d (groups %s); its state comes from group %d",
            self.group, era, committed, list(self.quorum.groups), source,
        )  # fmt: skip

    # ------------------------------------------------------------------ the sum
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> Quorum:
        """Reduce the CPU ``tensor`` in place (``op``: sum, max or min) over the quorum's groups, collective
        over their leaders; after a loss the survivors form a new quorum and reduce again from their inputs.
        The quorum it reduced over; groups admitted back at this sum wait in :attr:`pending`."""
        saved, options = tensor.clone(), dist.AllreduceOptions()
        options.reduceOp = _OPS[op]
        with self._abandoned_if_lost():
            while True:
                try:
                    outcome = self._attempt(tensor, options)
                    if outcome is not None:
                        self.committed += 1
                        self.pending = self.pending or outcome
                        return self.quorum
                except GroupLost:
                    raise
                except (RuntimeError, OSError):  # the Gloo group broke under this leader: a peer died
                    self._say(self._key("outcome"), "fail")
                tensor.copy_(saved)
                self._reform()

    def admit_pending(self) -> Quorum:
        """Where the caller's state is whole (collective over the quorum's leaders, at the same sum: the
        same :attr:`pending` on each): the groups pending join, in a new era, when any. The quorum from here;
        its ``joined`` not empty: every member calls :meth:`share_state` next."""
        joiners, self.pending = self.pending, ()
        if joiners:
            with self._abandoned_if_lost():
                self._grow(joiners)
        return self.quorum

    @contextmanager
    def _abandoned_if_lost(self) -> Iterator[None]:
        """A :class:`GroupLost` leaving the block ends this leader's part: nothing of the link may be torn
        down at exit. The heartbeat thread is joined (at most 4 beats; it ends at once when the rendezvous
        is gone), so it is not inside a store call when the interpreter ends: a thread that returns to
        Python from C++ then is ended by ``pthread_exit``, whose unwinding through torch's C++ aborts the
        process (a survivor ended with SIGABRT, not status 3, once in CI). The Gloo group is retired."""
        try:
            yield
        except GroupLost:
            self._beat.stop(wait=True)
            self._hand_over_group()
            raise

    def _attempt(self, tensor: torch.Tensor, options: dist.AllreduceOptions) -> tuple[int, ...] | None:
        """One try of the current sum in this era: None when it failed; else the groups admitted at its
        commit (empty: a plain commit)."""
        assert self._pg is not None
        if self.group == 0 and self.admit:
            self._offer_joiners()
        work = self._pg.allreduce([tensor], options)
        backoff, looked = Backoff(), time.monotonic()
        while not work.is_completed():
            backoff.pause()
            if time.monotonic() - looked >= LOOK_S:
                looked = time.monotonic()
                if self._failed():
                    return None
        work.wait()
        done = self._store_call(lambda: self._store.add(self._key("done"), 1))
        if done == len(self.quorum.groups):  # group 0 set any grow before its part: it is there by now
            grow = self._store_call(lambda: self._store.check([self._key("grow")]))
            self._say(self._key("outcome"), "grow" if grow else "commit")
        backoff = Backoff()
        while not self._store_call(lambda: self._store.check([self._key("outcome")])):
            backoff.pause()
            if time.monotonic() - looked >= LOOK_S:
                looked = time.monotonic()
                if self._failed():
                    break
        outcome = self._store_call(lambda: self._store.get(self._key("outcome")))
        if outcome == b"commit":
            return ()
        if outcome == b"grow":
            joiners = self._store_call(lambda: self._store.get(self._key("grow")))
            return tuple(int(g) for g in joiners.split(b","))
        return None

    def _offer_joiners(self) -> None:
        """Group 0's leader, before its part of a sum: the groups back and waiting to join (one look at
        ``joins`` a sum while none waits), as this try's ``grow``."""
        joins = self._store_call(lambda: self._store.add("joins", 0))
        if joins == self._joins or self.pending:
            return
        absent = tuple(g for g in range(self.groups) if g not in self.quorum.groups)
        asked = tuple(g for g in absent if self._store_call(lambda g=g: self._store.check([f"join/{g}"])))
        waiting = sorted(set(asked) - set(self._stopped(asked, all_of=True))) if asked else []
        if waiting:
            self._say(self._key("grow"), ",".join(map(str, waiting)))
        else:
            self._joins = joins

    def _grow(self, joiners: tuple[int, ...]) -> None:
        """After a commit that admitted ``joiners``: era ``e+1`` over the quorum and them (group 0's leader
        says so and admits them), its Gloo group built with them; the quorum's lowest group is the source
        of their state."""
        before, era = self.quorum, self.quorum.era + 1
        members, source = tuple(sorted({*before.groups, *joiners})), min(before.groups)
        if self.group == 0:
            self._store_call(lambda: self._store.set(f"{era}/members", ",".join(map(str, members))))
            self._store_call(lambda: self._store.set(f"{era}/source", str(source)))
            for g in joiners:
                self._store_call(lambda g=g: self._store.delete_key(f"join/{g}"))
                self._store_call(lambda g=g: self._store.set(f"admit/{g}", f"{era},{self.committed}"))
            self._joins = self._store_call(lambda: self._store.add("joins", 0))
            log.warning(
                "link: group(s) %s back at sum %d (era %d: groups %s)",
                ", ".join(map(str, joiners)), self.committed, era, list(members),
            )  # fmt: skip
        for g in joiners:
            self._seen.pop(g, None)
        self._pg = None  # the old era's group, healthy and idle: released here
        self.quorum = Quorum(era, members, joiners, source)
        try:
            self._pg = self._connect()
        except (RuntimeError, OSError) as exc:  # a joiner gone again before the era formed: the sum stands
            log.warning("link: era %d with group(s) %s did not form (%s); forming another", era, joiners, exc)
            self._reform()

    def share_state(self, payload: bytes | None) -> bytes:
        """Right after a quorum with joiners formed (collective over its members): the source group's
        leader gives ``payload`` (its state, serialized), every member gets it back; the others pass None.
        Over the era's Gloo group: two broadcasts, the length first."""
        assert self._pg is not None
        options = dist.BroadcastOptions()
        options.rootRank = self.quorum.index(self.quorum.source)
        source = self.group == self.quorum.source
        if source and payload is None:
            raise ValueError("the source group's leader must give the state it hands over")
        length = torch.tensor([len(payload) if source else 0], dtype=torch.int64)
        with self._abandoned_if_lost():
            try:
                self._pg.broadcast([length], options).wait()
                data = (
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    if source
                    else torch.empty(int(length), dtype=torch.uint8)
                )
                self._pg.broadcast([data], options).wait()
            except (RuntimeError, OSError) as exc:
                raise GroupLost(
                    f"link: a group was lost while group {self.quorum.source} handed over its state ({exc})"
                ) from exc
        return data.numpy().tobytes()

    def _failed(self) -> bool:
        """Whether this try failed: a fail said, or a member's heartbeat stopped (then say fail)."""
        if self._store_call(lambda: self._store.check([self._key("outcome")])):
            return self._store_call(lambda: self._store.get(self._key("outcome"))) == b"fail"
        if self._stopped(self.quorum.groups):
            return self._say(self._key("outcome"), "fail") == b"fail"
        return False

    # ------------------------------------------------------------------ a new quorum
    def _reform(self) -> None:
        """Abort the era's Gloo group; eras until one's Gloo group forms (a member lost while it formed
        costs one more). :class:`GroupLost` when left out. Groups pending are offered again (group 0's
        leader looks for them at the next sum)."""
        self._hand_over_group()
        self.pending = ()
        while True:
            self.quorum = self._next_quorum()
            try:
                self._pg = self._connect()
                return
            except GroupLost:
                raise
            except (RuntimeError, OSError) as exc:
                log.warning(
                    "link: era %d's Gloo group did not form (%s); forming another", self.quorum.era, exc
                )

    def _next_quorum(self) -> Quorum:
        """Register for the next era; group 0's leader decides its members and says them in one line; the
        others read them. :class:`GroupLost` when left out."""
        before, era = self.quorum, self.quorum.era + 1
        self._store_call(lambda: self._store.set(f"{era}/alive/{self.group}", str(self.committed)))
        members_key = f"{era}/members"
        if self.group == 0:
            members = self._decide(before, era)
            self._store_call(lambda: self._store.set(members_key, ",".join(map(str, members))))
            lost = sorted(set(before.groups) - set(members))
            keys = [f"host/{g}" for g in lost]
            hosts = self._store_call(lambda: self._store.multi_get(keys)) if lost else []
            named = {g: h.decode() for g, h in zip(lost, hosts, strict=True)}
            log.warning(
                "link: group(s) %s lost at sum %d; %d group(s) go on (era %d: groups %s)",
                ", ".join(f"{g} on {h}" for g, h in named.items()) or "none",
                self.committed, len(members), era, list(members),
            )  # fmt: skip
            if named and self.on_lost is not None:
                self.on_lost(named)
        else:
            self._store_call(lambda: self._store.wait([members_key]))
        members = tuple(int(g) for g in self._store_call(lambda: self._store.get(members_key)).split(b","))
        if self.group not in members:
            raise GroupLost(
                f"link: group {self.group} was left out of era {era} (its heartbeat was seen stopped for "
                f"{self.dead_after_s} s): its run ends; the others go on"
            )
        return Quorum(era, members)

    def _decide(self, before: Quorum, era: int) -> tuple[int, ...]:
        """Group 0's leader: the members of ``era`` — the registered ones whose heartbeat still moves, once
        every such member registered or ``join_s`` passed. A group back already (its restarted job beating
        and asking to join) is not waited for: it joins at a later sum."""
        deadline = time.monotonic() + self.join_s
        while True:
            registered = {
                g
                for g in before.groups
                if self._store_call(lambda g=g: self._store.check([f"{era}/alive/{g}"]))
            }
            back = {
                g
                for g in set(before.groups) - registered
                if self._store_call(lambda g=g: self._store.check([f"join/{g}"]))
            }
            alive = set(before.groups) - set(self._stopped(before.groups, all_of=True)) - back
            if alive <= registered or time.monotonic() > deadline:
                return tuple(sorted(registered & alive))
            time.sleep(LOOK_S)

    def _stopped(self, groups: tuple[int, ...], all_of: bool = False) -> list[int]:
        """The ``groups`` whose heartbeat has not moved for ``dead_after_s`` (the first one only, unless
        ``all_of``); a group's clock starts when this leader first reads its count."""
        counts = self._store_call(lambda: self._store.multi_get([f"beat/{g}" for g in groups]))
        now, out = time.monotonic(), []
        for g, raw in zip(groups, counts, strict=True):
            count = int(raw) if raw else 0
            last, since = self._seen.get(g, (-1, now))
            if count != last:
                self._seen[g] = (count, now)
            elif now - since > self.dead_after_s:
                out.append(g)
                if not all_of:
                    break
        return out

    # ------------------------------------------------------------------ helpers
    def _connect(self) -> dist.ProcessGroupGloo:
        """The Gloo group of the current era (collective over its members)."""
        prefixed = dist.PrefixStore(f"gloo/{self.quorum.era}", self._store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.local_address)]
        rank, size = self.quorum.index(self.group), len(self.quorum.groups)
        return dist.ProcessGroupGloo(prefixed, rank, size, options)

    def _hand_over_group(self) -> None:
        """This era's Gloo group to :func:`_retire`, no reference to it left here."""
        held = [self._pg] if self._pg is not None else []
        self._pg = None
        if held:
            _retire(held)

    def _key(self, name: str) -> str:
        """A key of the current try: era and sum number."""
        return f"{self.quorum.era}/{self.committed}/{name}"

    def _say(self, key: str, word: str) -> bytes:
        """Compare-and-set ``key`` to ``word`` unless already said; the word that stands."""
        return self._store_call(lambda: self._store.compare_set(key, "", word))

    @staticmethod
    def _store_call(call: Callable[[], T]) -> T:
        """``call()``, a store operation; its failure (the rendezvous gone) as :class:`GroupLost`."""
        try:
            return call()
        except (RuntimeError, OSError) as exc:
            raise GroupLost(
                f"link: the rendezvous on group 0's leader is gone ({exc}): the run ends"
            ) from exc

    def close(self) -> None:
        """Leave the link at the end of the run, on every member: group 0's leader, which holds the
        rendezvous, waits until every other member has left (or its heartbeat stopped, at most ``join_s``);
        then stop the heartbeat and release the Gloo group. Once: a second call returns at once (the first
        told group 0's leader this member left, and the rendezvous may be gone since)."""
        if self._closed:
            return
        self._closed = True
        key = f"{self.quorum.era}/closed"
        with self._abandoned_if_lost():
            self._store_call(lambda: self._store.add(key, 1))
            if self.group == 0:  # a group back and still waiting would wait for a run that is over
                for g in range(self.groups):
                    if g not in self.quorum.groups and self._store_call(
                        lambda g=g: self._store.check([f"join/{g}"])
                    ):
                        self._store_call(lambda g=g: self._store.set(f"admit/{g}", "ended"))
            deadline = time.monotonic() + self.join_s
            while self.group == 0 and time.monotonic() < deadline:
                left = self._store_call(lambda: self._store.add(key, 0))
                if left + len(self._stopped(self.quorum.groups, all_of=True)) >= len(self.quorum.groups):
                    break
                time.sleep(LOOK_S)
        self._beat.stop()
        self._pg = None  # nothing in flight in it: its destructor returns at once, here
