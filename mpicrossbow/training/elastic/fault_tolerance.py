"""FaultTolerance: one rank's fault tolerance, the one owner of elastic training (``[elastic] enabled``,
``xb.init(elastic=True)``) — the membership, the commit, the retry and the restore, as torchft's Manager owns
them.

The session builds it once, when the run is elastic (:class:`~.run_tolerance.RunTolerance`, which adds what a
crossbow-launch run moves on a loss: its reporting, checkpoints and replacements), and hands it to the loop
as the loop's :class:`~mpicrossbow.training.run.window.StepWindow`; nothing else in the run asks whether a
rank can be lost. ``xb.distribute`` builds the same owner around the user's own optimizer step
(:mod:`mpicrossbow.embed.step_hooks`), with the user's state to restore. It holds the
:class:`~mpicrossbow.comm.elastic.ElasticCommunicator` (the rules talk to it as to any communicator; it
swaps the communicator under them on a loss). A synchronous rule's steps are committed on every survivor or
on none, and a lost rank costs the steps since the last commit, not the job; an asynchronous rule's ranks
forget a lost peer as they meet it (its server, :mod:`mpicrossbow.rules`), and the owner only settles who is
left at the end (:meth:`FaultTolerance.settle`).

Steps run in windows of ``[elastic] commit_every`` (a window ends after step s when s + 1 is a multiple of
it, and before every collective between steps: validation, the epoch's statistics, the signal check,
a checkpoint). A window ends as torchft ends a step: a fault-tolerant agreement that every step of it
completed on every rank (:meth:`~mpicrossbow.comm.elastic.ElasticCommunicator.commit`,
``MPI_Comm_agree``). At each commit every rank keeps a copy of what the steps change (every ``state_dict``
it was given: the learners' weights, buffers and optimizer state, the rule's state; two copies alternate,
each one copied into the tensors of the one before the last, so no commit allocates: a clone took 68 ms
where the copy takes 9 ms on a 17M-parameter MLP). A rank that meets a lost rank inside a window (an
operation failed: the communicator is revoked, so every other rank's next operation fails too) trains no
more in it: it goes through the window's remaining steps without computing, and at its end the agreement
says the window did not complete. Then every survivor

1. recovers the communicator (revoke, shrink, rebuild: :meth:`ElasticCommunicator.recover`);
2. restores its copy, so no survivor keeps a partial step — a collective that completed on some ranks
   before the death and failed on others is undone everywhere, and the survivors' replicas are bit for bit
   what they were at the last commit; the window's steps are **dropped** (their batches are not trained;
   the step count, the learning-rate schedule and the epoch go on);
3. tells whoever holds the world that it moved on (:attr:`FaultTolerance.followers`: the run's reporting
   and checkpoints, the embedded API's world), tells the rule (``on_rebind``: it rebuilds splits and peers;
   every mean divides by the new size, read from the communicator at each use) and logs one line naming
   the lost ranks and the step.

So ``commit_every`` trades the agreement and the copy per step (about 9 % of a 3 ms digits step here,
benchmarks/elastic_cost.py) for up to that many steps of the survivors' work lost with a rank.

**Healing from a peer, without windows** (rules whose failed exchange leaves their state whole:
``Rule.heals_from_peer`` — BSP's grad mode, SMA, LOCALSGD and DILOCO). Such a rule writes what an exchange
brings only once the exchange completed (BSP's optimizer applies the mean gradient; SMA moves z; LOCALSGD's
learners take the mean, summed in a buffer of its own), and ranks that completed the same steps hold the same
shared state — where a rank's exchange is still in flight after its step (SMA's allreduce, completed at the
next step's start), that step counts as not held (``Rule.unapplied_steps``) when it meets a loss. A rank lost
in step s therefore leaves each survivor a whole state: after the steps it completed (on ULFM a collective
that returns success is correct where it returned), never a partial exchange. Under BSP and SMA, which
exchange every step, survivors are at most one step apart (no rank can complete a collective that a rank which
failed the one before never entered); under LOCALSGD a survivor whose average completed trains up to a period
on before it meets the loss. So nothing is copied and nothing agreed per step. A rank that meets the loss (in
a step, or in a collective between steps) agrees with the others that it happened, recovers, and then the
survivors

1. find the latest step any of them holds and where each of their loops stands (one allreduce);
2. take the state from the lowest survivor that holds that step, when some survivor lags
   (:func:`~mpicrossbow.comm.state_broadcast.broadcast_state`; each keeps its own running loss sums,
   :data:`OWN_ENTRIES`);
3. skip, on a rank whose loop is behind, the steps up to the furthest survivor's position without training,
   so every loop goes on at the same step.

One step is lost for the survivors' shared model — the one in which they met the loss (BSP: its update; SMA:
z's move, and the step before's when they met it in its overlapped allreduce; LOCALSGD and DILOCO: its
average, each survivor keeping its local step) — and none when the loss was met between steps, or when the
step's exchange can run again (``Rule.redoes_exchange``, BSP's one allreduce after backward, before which
the step keeps a copy of the rank's gradients — crossbow-launch's ``train_step`` and the user's loop's hooks
alike: ``guard``'s ``redo``): when every survivor met
the loss inside that same exchange, the heal's agreement says so, each puts its gradient back and the
exchange runs again over the survivors (:meth:`FaultTolerance.redoes`), as torchft's quorum leaves a dead
replica out of the step's allreduce; a rank's own
batches for at most two (LOCALSGD: up to a period, on a rank that lagged an average); and elastic training
costs no per-step work beyond the elastic communicator's forwarding.

The lowest survivor is rank 0 afterwards: the run folder, ``metrics.h5`` and validation lines are its. The
collectives between steps (the epoch's statistics, validation) are retried over the survivors until they
commit, so an epoch is reported once. The lost rank's data shard is dropped for the rest of the run: each
survivor keeps reading its own shard, so steps per epoch, the schedule and the epoch count stay as they were
(re-partitioning the data among survivors would change all three mid-run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from ...comm.base import ReduceOp
from ...comm.elastic import ElasticCommunicator, until_committed
from ...comm.membership import Membership
from ...comm.state_broadcast import broadcast_state
from ...comm.ulfm import ElasticEnd, PeerLost
from ...rules.base import Rule
from ..run.window import StepWindow

log = logging.getLogger(__name__)

#: Said once, with a job's first loss: Open MPI's libnbc prints its own lines about the same event just
#: before ours, unconditionally, and they read like a crash.
LIBNBC_NOTE = (
    " (Open MPI's 'NBC_Progress: an error 75 was found during schedule ... aborting the schedule' lines just "
    "before this one are its non-blocking collectives giving up on the lost rank: expected after a loss)"
)

#: Entries of a ``state_dict`` that are a rank's own, not its replica's (the running loss sums a pool
#: reports at the epoch's end): a rank that heals from a peer keeps its own.
OWN_ENTRIES = frozenset({"stats", "samples"})

T = TypeVar("T")


class Stateful(Protocol):
    """What a loss restores: anything with ``state_dict`` and ``load_state_dict`` (a pool, a rule, an
    optimizer, an lr scheduler)."""

    def state_dict(self) -> Any:
        """The state, as torch objects give it."""

    def load_state_dict(self, state: Any) -> None:
        """Take ``state`` back."""


def cloned(value: Any, into: Any = None) -> Any:
    """A copy of ``value`` with every tensor copied (dicts, lists and tuples walked; the rest shared): into
    the tensor at the same place of ``into`` — an earlier copy of the same structure — where its shape,
    dtype and device match (no allocation), else into a new clone."""
    if isinstance(value, torch.Tensor):
        same = isinstance(into, torch.Tensor) and (into.shape, into.dtype, into.device) == (
            value.shape,
            value.dtype,
            value.device,
        )
        return into.copy_(value.detach()) if same else value.detach().clone()
    if isinstance(value, dict):
        old = into if isinstance(into, dict) else {}
        return {k: cloned(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(cloned(v, o) for v, o in zip(value, old, strict=True))
    return value


def keeping_own(theirs: Any, mine: Any) -> Any:
    """``theirs`` (a peer's ``state_dict``) with every entry named in :data:`OWN_ENTRIES` taken from ``mine``
    (this rank's own ``state_dict``) where ``mine`` has it: dicts, lists and tuples walked."""
    if isinstance(theirs, dict) and isinstance(mine, dict):
        return {
            k: mine[k] if k in OWN_ENTRIES and k in mine else keeping_own(v, mine.get(k))
            for k, v in theirs.items()
        }
    if isinstance(theirs, (list, tuple)) and isinstance(mine, (list, tuple)) and len(theirs) == len(mine):
        return type(theirs)(keeping_own(t, m) for t, m in zip(theirs, mine, strict=True))
    return theirs


class FaultTolerance(StepWindow):
    """One rank's fault tolerance: commits its steps (synchronous rules), restores ``state`` when a window
    is dropped, recovers with the other survivors, settles the end (see the module doc)."""

    def __init__(
        self,
        comm: ElasticCommunicator,
        rule: Rule,
        state: Sequence[Stateful],
        min_ranks: int = 1,
        every: int = 1,
        steps_done: int = 0,
        refresh: bool = False,
        heals: bool | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"commit every {every} steps: at least 1")
        self.comm, self.rule, self.min_ranks, self.every = comm, rule, min_ranks, every
        #: Refresh the copy to restore as each window's first step starts, so what changed between two
        #: windows (a user's lr scheduler stepping after the last commit) survives a restore: the embedded
        #: API's owner, where the user's code runs between steps.
        self.refresh = refresh
        #: What a dropped window restores, in order (the rule among them: its state is restored after its
        #: ``on_rebind``, which drops what it had in flight on the lost world).
        self.state: list[Stateful] = list(state)
        #: Whether steps commit in windows (a synchronous rule); an asynchronous rule's ranks never meet
        #: between steps, so its steps and collectives run as they are.
        self.windows = rule.synchronous
        #: The state at the last commit (what a dropped window restores), once taken.
        self.saved: tuple[Any, ...] | None = None
        #: The copy before ``saved``: the next capture is copied into its tensors (two alternate).
        self.spare: tuple[Any, ...] | None = None
        #: The ranks (numbered as before it) the last recovery lost, and their start ranks in words.
        self.lost: tuple[int, ...] = ()
        self.lost_names = ""
        #: Called after every recovery, before the rule's ``on_rebind`` (parts with work in flight on the
        #: lost world's communicator drop it here).
        self.after_recovery: list[Callable[[], None]] = []
        #: Called with the membership before and after every change of it (a loss, a replacement): what
        #: holds the world (the run's reporting and checkpoints, the embedded API's world) moves it on.
        self.followers: list[Callable[[Membership, Membership], None]] = []
        #: Seconds from meeting a loss to training again, one entry per recovery (the benchmark's figure).
        self.recoveries: list[float] = []
        #: Steps done (committed or dropped) before the step running now, or all of them between steps.
        self.steps_done = steps_done
        #: ``steps_done`` at the last commit: what the survivors' state holds after a recovery.
        self.committed = self.steps_done
        #: Steps run since the last commit (the open window).
        self.pending = 0
        #: Where and when this rank met a lost rank in the open window, else None.
        self.met: tuple[str, float] | None = None
        #: When the latest recovery's loss was met (``time.perf_counter``): what a replacement is timed from.
        self.lost_at = 0.0
        #: Heal from a peer instead of committing windows (see the module doc); None: the rule says, when
        #: first asked (after its binding resolved its mode).
        self._heals = heals
        #: Healing: the steps before this one are skipped without training (a rank whose loop was behind
        #: the furthest survivor's after a loss).
        self.skip_until = 0
        #: Healing: the step running now does not train (skipped, or it met a loss).
        self.idle = False
        #: Healing: this rank met the loss inside a step's gradient exchange that can run again (``guard``'s
        #: ``redo``), and the last heal decided that every survivor redoes it.
        self.redoable = False
        self.redo = False

    @property
    def heals(self) -> bool:
        """Whether a loss heals the survivors from a peer (no windows): a synchronous rule whose failed
        exchange leaves its state whole (``Rule.heals_from_peer``, asked once, after binding)."""
        if self._heals is None:
            self._heals = self.windows and self.rule.heals_from_peer
        return self._heals

    def trains(self) -> bool:
        """Whether the step running now still trains: False on a healing rank that skips it or met a loss in
        it (the embedded API then keeps the user's optimizer step from applying its gradient)."""
        return not (self.heals and self.idle)

    def add_state(self, part: Stateful) -> None:
        """One more object a dropped window restores (``xb.keep``); its state now counts as committed."""
        self.state.append(part)
        if self.saved is not None:
            self.saved = (*self.saved, cloned(part.state_dict()))
        self.spare = None

    def amend(self) -> None:
        """Between two windows the state changed (the loop's new learning rate, the rule told of it): the
        copy to restore takes it, so a loss in the next window does not bring the old rate back (the
        loop would not set it again before its next change). Inside a window a restore takes the change
        back, and the loop sets the rate again at its next step where the schedule moves every step."""
        if self.saved is not None and not self.pending and self.met is None:
            self.saved = self.capture(self.saved)

    def step(self, run: Callable[[], float], step: int) -> float:
        """Run ``run`` (one train_step; returns its exchange seconds) inside the open window, and commit
        the window after it when it ends here; 0.0 when this rank met a lost rank in the window (it then
        skips ``run`` to the window's end) or the commit dropped the window.

        The copy to restore is taken at each commit (before the first step, at start): taking it completes
        what the step left in flight (SMA's allreduce of its corrections), so the agreement that follows
        covers the whole exchange — at the price of SMA's overlap of that allreduce with the next step's
        backward, once a window."""
        if not self.windows:
            return run()
        self.begin(step)
        seconds = self.guard(run, f"step {step}")
        return (seconds or 0.0) if self.end(step) else 0.0

    def begin(self, step: int) -> None:
        """Step ``step`` starts (the first one takes the copy to restore; with :attr:`refresh`, the first
        of every window copies the state again into the same tensors: nothing is in flight there, the last
        commit's copy completed it)."""
        self.steps_done = step
        if self.heals:
            self.idle = step < self.skip_until
            return
        if self.saved is None:
            self.saved = self.capture()
        elif self.refresh and not self.pending and self.met is None:
            self.saved = self.capture(self.saved)

    def redoes(self) -> bool:
        """Healing under a rule whose gradient exchange can run again (``Rule.redoes_exchange``): a step
        whose exchange met the loss on every survivor is redone over them, not dropped."""
        return self.heals and self.rule.redoes_exchange

    def guard(self, work: Callable[[], T], where: str, redo: Callable[[], None] | None = None) -> T | None:
        """``work()`` inside the open window, unless this rank met a lost rank in it already (then, or when
        ``work`` meets one now, None: the window's end drops it). Healing with ``redo`` (the step's gradient
        exchange, :meth:`redoes`): when every survivor met the loss inside this same exchange, ``redo()``
        puts this rank's gradients back and ``work`` runs again over the survivors."""
        if self.met is not None or (self.heals and self.idle):
            return None
        try:
            return work()
        except PeerLost:
            self.met = (where, time.perf_counter())
            if self.heals:  # recover and heal now: the others meet it within one step (module doc)
                self.idle, self.redoable = True, redo is not None and self.redoes()
                self.comm.commit(False)  # as a committed collective's member that met it: revoke, agree
                self._healed(self.steps_done + 1)
                self.redoable = False
                if self.redo:
                    self.idle = self.redo = False
                    assert redo is not None
                    redo()
                    return self.guard(work, where, redo)
            return None

    def end(self, step: int) -> bool:
        """Step ``step`` ended: commit the window when it ends here; False when the commit dropped it."""
        self.steps_done = step + 1
        if self.heals:
            trained, self.idle = not self.idle, False
            if trained:
                self.committed = self.steps_done
            return trained
        self.pending += 1
        if (step + 1) % self.every:
            return True  # the window goes on (on a rank that met a loss: without training)
        return self.flush(f"step {step}")

    def flush(self, where: str) -> bool:
        """End the open window (if a step ran since the last commit): agree that every rank completed it,
        and keep a copy of the state; or, when some rank did not, recover, restore the last commit's copy
        on every survivor (the window's steps are dropped) and return False. ``where`` names the point in
        the log when this rank met no loss itself."""
        if not self.pending:  # also every asynchronous run's: no windows
            return True
        self.pending, ok, after = 0, self.met is None, None
        if ok:
            try:
                after = self.capture(self.spare)
            except PeerLost:
                ok, self.met = False, (where, time.perf_counter())
        if self.comm.commit(ok):
            self.spare, self.saved, self.committed = self.saved, after, self.steps_done
            return True
        met, started = self.met or (where, time.perf_counter())
        self.met = None
        first, last = self.committed, self.steps_done - 1
        dropped = f"step {first}" if last == first else f"steps {first}-{last}"
        self.recover(met if met == dropped else f"{met}, {dropped} dropped", started)
        self.restore(self.saved)  # after the rule's on_rebind: it dropped what it had in flight
        # torch's Optimizer.load_state_dict keeps the given tensors as its state (no copy when dtype and
        # device match): the copies are live state now, so the next step takes fresh ones.
        self.saved = self.spare = None
        self.committed = self.steps_done  # the step count goes on from the restored state
        return False

    def capture(self, into: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """A copy of everything a step changes (every ``state_dict`` of :attr:`state`: what a dropped step
        restores; benchmarks/elastic_cost.py times it), copied into ``into``'s tensors (an earlier capture
        no longer needed) where they fit."""
        return cloned(tuple(part.state_dict() for part in self.state), into)

    def restore(self, saved: tuple[Any, ...] | None) -> None:
        """Load a :meth:`capture` back into :attr:`state`."""
        assert saved is not None, "a window is only dropped after the first copy was taken"
        for part, state in zip(self.state, saved, strict=True):
            part.load_state_dict(state)

    def members(self, world_mpi: Any) -> Any:
        """The current members' mpi4py communicator (the group a loss revokes), else ``world_mpi``."""
        native = self.comm.group.native
        return native if native is not None else world_mpi

    def collective(self, fn: Callable[..., T], what: str) -> Callable[..., T]:
        """``fn`` as a committed collective: the open window committed first, then ``fn`` retried over the
        survivors until every one completed it (an asynchronous rule's between-step work is local: ``fn``)."""
        if not self.windows:
            return fn

        def recovered(started: float) -> None:
            if self.heals:  # between steps: this rank's loop stands at steps_done, its state holds committed
                self.met = (what, started)
                self._healed(self.steps_done)
                return
            self.recover(what, started)

        def failed(exc: BaseException) -> bool:
            # the group of the try that raised (a recovery replaces it): also the MPI errors of work over
            # the group's own communicator (a checkpoint's barriers)
            return self.comm.group.is_failure(exc)

        def run(*args: Any) -> T:
            self.flush(what)
            return until_committed(
                lambda _redo: fn(*args), self.comm.commit, recovered, failed, clock=time.perf_counter
            )

        return run

    def _healed(self, position: int) -> None:
        """Healing, after the agreement that a rank was lost: recover, rebind the rule and heal every
        survivor from a peer (:meth:`heal`, redone over the survivors should a rank die during it); this
        rank's loop goes on at step ``position`` (behind: it skips up to the furthest survivor's)."""
        where, started = self.met or ("a collective", time.perf_counter())
        self.met = None
        # before the rule's on_rebind drops what it has in flight: the steps whose exchange had not reached
        # the shared state when the loss was met (SMA's allreduce, completed at the next step's start) are
        # not held, though completed
        self.committed -= self.rule.unapplied_steps

        def recovered(began: float) -> None:
            self.recover(where, began, report=False)

        recovered(started)
        healed = until_committed(
            lambda _redo: self.heal(position), self.comm.commit, recovered, clock=time.perf_counter
        )
        self.recoveries[-1] = time.perf_counter() - started
        self.report(f"{where}, {healed}")

    def heal(self, position: int) -> str:
        """Every survivor takes the latest state any survivor holds (``committed`` steps), from the lowest
        one holding it, and its loop skips to the furthest survivor's ``position``; what the survivors lost,
        in words. Collective over the survivors; a rank that dies during it fails it on every rank before any
        state is loaded (every part is received first)."""
        comm, me = self.comm.exact, self.comm.rank
        mine = [float(self.committed), float(position), float(-self.committed), float(-self.redoable)]
        latest, furthest, least, some_cannot = (
            int(v) for v in comm.allreduce_scalars(mine, op=ReduceOp.MAX)
        )  # some_cannot: -1 when every survivor can redo, 0 when one cannot
        # every survivor holds the same steps and met the loss inside the next one's redoable exchange
        self.redo = some_cannot == -1 and -least == latest and furthest == latest + 1
        if self.redo:
            self.skip_until = latest
            return f"step {latest} redone over the survivors (their own gradients)"
        holder = me if self.committed == latest else self.comm.size
        source = int(comm.allreduce_scalars([float(holder)], op=ReduceOp.MIN)[0])
        if -least < latest:  # some survivor lags a step: every part from the source, then loaded
            given = [part.state_dict() if me == source else None for part in self.state]
            theirs = [broadcast_state(comm, state, source) for state in given]
            if self.committed < latest:
                for part, state in zip(self.state, theirs, strict=True):
                    part.load_state_dict(keeping_own(state, part.state_dict()))
        self.committed, self.skip_until = latest, furthest
        lost = f"step {latest}" if furthest == latest + 1 else f"steps {latest}-{furthest - 1}"
        moved = f"; rank {source} healed the survivors behind it" if -least < latest else ""
        return f"{lost if furthest > latest else 'no step'} dropped{moved}"

    def on_recovery(self, hook: Callable[[], None]) -> None:
        """``hook`` runs after every recovery, before the rule's ``on_rebind`` (a part with work in flight on
        the lost world's communicator drops it there)."""
        self.after_recovery.append(hook)

    def settle(self, where: str) -> None:
        """The end of training. Synchronous rules: the open window committed (none is, normally: the epoch's
        statistics committed it). Asynchronous rules: their ranks meet only after ``finish`` (a server forgot
        a lost worker as it met it, :meth:`~mpicrossbow.rules.parameter_server.ParameterServer.forget`).
        Agree whether every rank is still there; if not, shrink to the survivors, move the world on and
        rebind the rule, so the run's last collectives (statistics, the final model, metrics.h5) span the
        survivors."""
        if self.windows:
            self.flush(where)
            return
        started = time.perf_counter()
        if not self.comm.commit(True):
            self.recover(where, started)

    def moved(self, before: Membership, after: Membership) -> None:
        """The one membership change: a loss (:meth:`recover`) and a replacement alike tell every follower
        of the world, in order."""
        for follow in self.followers:
            follow(before, after)

    def recover(self, where: str, started: float, report: bool = True) -> None:
        """Shrink to the survivors, move the world on (:attr:`followers`) and tell the rule (``on_rebind``:
        it rebuilds its splits and peers and drops what it had in flight on the lost world); ElasticEnd below
        ``min_ranks``. ``report``: log the loss now (healing logs it once healed)."""
        before = self.comm.membership
        after = self.comm.recover()
        self.lost = after.lost_since(before)
        self.lost_names = names = ", ".join(str(before.ranks[r]) for r in self.lost)
        if after.size < self.min_ranks:
            raise ElasticEnd(
                f"lost rank(s) {names} at {where}: {after.size} rank(s) left, fewer than "
                f"[elastic] min_ranks = {self.min_ranks}",
                place=after.rank,
            )
        self.lost_at = started
        self.moved(before, after)
        for hook in self.after_recovery:
            hook()
        self.recoveries.append(time.perf_counter() - started)
        if report:
            self.report(where)
        self.rule.on_rebind(self.lost)

    def report(self, where: str) -> None:
        """Rank 0's one line about the latest recovery: the lost ranks, where, who goes on, how long."""
        after = self.comm.membership
        if after.rank == 0:
            log.warning(
                "elastic: lost rank(s) %s (start numbering) at %s; %d rank(s) go on (%s); "
                "recovered in %.3fs%s",
                self.lost_names,
                where,
                after.size,
                after,
                self.recoveries[-1],
                LIBNBC_NOTE if len(self.recoveries) == 1 else "",
            )
