"""The rule plug-in: how replicas exchange parameters. Declare, bind, exchange, finish.

* ``Rule(**hyper)`` only validates and stores hyper-parameters (a nested ``Config`` dataclass): cheap and
  picklable.
* ``bind(comm, pool)`` allocates state and makes every replica start from rank 0's weights.
* ``on_gradients(step)`` runs between backward and the optimizer step; ``exchange(step)`` after the step.
  Either may communicate, or decide not to (period, probability, staleness).
* ``sync_state()`` makes the model that is validated or saved consistent (e.g. averages BatchNorm buffers);
  ``eval_params()`` names the weights to validate (a centre variable, say) or None for learner 0's own.
* ``finish()`` drains everything in flight, so no message is lost and no rank waits forever.
* Asynchronous rules set ``synchronous = False``: the session then runs no collective until ``finish()``
  (ranks progress at their own pace; rank 0 validates locally). A rule may keep a rank out of training
  (``trains``) and give it a ``serve()`` loop instead, e.g. a parameter server. Their checkpoints are
  coordinated snapshots: ``finish()`` drains, every rank saves, ``rearm()`` makes the rule exchange again
  (``agree_pause`` lets ranks that move in lock-step pause at the same step).

A rule sees only the Communicator and the pool's flat buffers — never files, streams or config text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..comm.base import Communicator
from ..config.fields import build
from ..errors import ConfigError
from .patience import Patience

if TYPE_CHECKING:
    from ..pool.replica_view import ReplicaView


def not_forgetting(name: str) -> str:
    """The line refusing elastic training to an asynchronous rule that cannot forget a lost rank."""
    return (
        f"RULE={name} is asynchronous and cannot forget a lost rank; elastic training supports the "
        "synchronous rules, the parameter-server rules with server ranks (ASGD, SSP, PSGD, WEEDOUT, GSP), "
        "async EASGD and GOSGD"
    )


class Rule:
    """Base class of every exchange rule. Subclasses set ``Config`` and override the hooks they need."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        """No hyper-parameters."""

    #: Registry name (set by the ``RULES.register`` decorator's caller convention).
    name: ClassVar[str] = "RULE"

    @property
    def synchronous(self) -> bool:
        """False when ranks run at their own pace between ``bind`` and ``finish`` (no collectives then)."""
        return True

    @property
    def needs_gradients(self) -> bool:
        """True when the rule exchanges gradients, so a model that updates itself (Theano-MPI form) cannot
        run under it; rules that exchange weights leave it False."""
        return False

    @property
    def averages_gradients(self) -> bool:
        """True when ``on_gradients`` leaves every learner's ``grads`` the mean gradient over all k learners
        (BSP's grad mode): the gradient noise scale (:mod:`mpicrossbow.training.tuning.noise_scale`) then
        reads the big batch there instead of paying for a gradient allreduce of its own."""
        return False

    @property
    def heals_from_peer(self) -> bool:
        """True when an exchange that fails (a lost rank, elastic training) leaves this rank's state whole:
        the rule writes what an exchange brings only once it completed, and every rank that completed the same
        steps holds the same shared state (BSP's grad mode: the mean gradient before the optimizer; SMA: z
        moves once its allreduce completed; LOCALSGD and DILOCO: the learners take the mean once its
        allreduce completed, :meth:`average` with ``atomic``). Elastic training then heals such a rule's
        survivors from the one that got furthest instead of copying its state every commit window
        (:mod:`mpicrossbow.training.elastic.fault_tolerance`)."""
        return False

    @property
    def redoes_exchange(self) -> bool:
        """True when ``on_gradients`` can run again over the survivors after it met a lost rank, from the
        same local gradients put back, and write nothing but the learners' ``grads`` (BSP's grad mode when its
        exchange is one allreduce after backward, no buckets started during it): elastic training then
        redoes the step that met the loss instead of dropping it
        (:mod:`mpicrossbow.training.elastic.fault_tolerance`)."""
        return False

    @property
    def unapplied_steps(self) -> int:
        """Steps this rank completed whose exchange has not reached its shared state yet (SMA: the step whose
        allreduce is in flight, completed at the next step's start; every rule whose exchange completes
        inside its step: 0). A healing rank that meets a loss holds the shared state of this many steps fewer
        than it completed: what it tells the others when they heal (a peer whose exchange completed is ahead
        of it, though both completed the same steps)."""
        return 0

    @property
    def averages_gradients_throughout(self) -> bool:
        """Whether every phase of the run averages gradients (a rule that switches rules mid-run asks each):
        what the check of an uncapped learning-rate scaling reads (:mod:`.lr_recipe`)."""
        return self.averages_gradients

    @property
    def needs_mpi_threads(self) -> bool:
        """True when the rule talks MPI from a second thread (``MPI_THREAD_MULTIPLE``), e.g. a parameter
        server shard colocated with training."""
        return False

    def trains(self, rank: int, size: int) -> bool:
        """Whether ``rank`` trains (False: it runs :meth:`serve`). Called before ``bind``."""
        return True

    def train_shard(self, rank: int, size: int) -> tuple[int, int]:
        """(index, count) of the training shard ``rank`` reads, among the ranks that train."""
        return rank, size

    def train_span(self, rank: int, size: int) -> tuple[float, float] | None:
        """The ``(start, end)`` fraction of the training set ``rank`` reads instead of its equal shard, or
        None (the default: equal shards from :meth:`train_shard`)."""
        return None

    def check_run(self, epochs: float) -> None:
        """Refuse hyper-parameters that point past the end of a run of ``epochs`` epochs (a switch that would
        never come) with a ConfigError, before any rank trains; called once the pool is built. The default
        accepts any length."""

    def check_learners(self, k: int) -> None:
        """Refuse hyper-parameters that cannot work with ``k`` learners in all (ranks × learners per rank)
        with a ConfigError, before any rank trains; called once the pool is built (``learners = auto``: with
        its first count). The default accepts any k."""

    def on_lr_scaling(self, scaling: str) -> None:
        """How the run's rate scales with its k learners (``[optim] lr_scaling``, ``xb.distribute``'s
        ``lr_scaling``), told once the pool is built. A rule whose choice depends on it keeps it (AUTO: the
        epochs model averaging needs against BSP follow it); the default ignores it."""

    def on_noise_scale(self, read: Callable[[], float]) -> None:
        """Where the run's gradient noise scale is read: ``read()`` gives B_noise in samples (NaN: not
        measured yet, or not estimable), told once the loop holds its probe. A rule that reports it keeps it
        (AUTO shows it beside each decision); the default ignores it."""

    def serve(self, report: Callable[[torch.Tensor, float], None]) -> None:
        """The loop of a rank that does not train; ``report(params, epoch)`` validates and logs a model."""
        raise NotImplementedError(f"{type(self).__name__} keeps no rank out of training")

    def __init__(self, **hyper: Any) -> None:
        self.hyper = build(self.Config, hyper, "rule")
        self.comm: Communicator | None = None
        self.pool: ReplicaView | None = None
        #: Called by a serving loop between sweeps of its requests (an asynchronous run's snapshots watch
        #: for signals there); None: nothing to call.
        self.tick: Callable[[], None] | None = None
        #: How long an asynchronous rule's waits on peers may stay silent (``[watchdog]`` sets it).
        self.patience = Patience()
        #: Backup ranks per parameter-server rank (``[elastic] server_backups``, set by the session before
        #: it asks :meth:`trains`; only a rule whose :meth:`backups_obstacle` is None has any).
        self.server_backups = 0
        #: :meth:`average`'s own sums, one per attribute, made at its first ``atomic`` use.
        self._sums: dict[str, torch.Tensor] = {}

    # ----------------------------------------------------------------- binding
    def bind(self, comm: Communicator, pool: ReplicaView) -> Rule:
        """Attach to the communicator and pool; every learner starts from rank 0's learner 0, bit for bit
        (the broadcast bypasses ``[comm] compression``)."""
        self.comm, self.pool = comm, pool
        self.share_pool()
        first = pool.learners[0]
        for flat in (first.params, first.buffers):
            if flat.numel():
                comm.exact.broadcast(flat, root=0).wait()
        for learner in pool.learners[1:]:
            learner.params.copy_(first.params)
            learner.buffers.copy_(first.buffers)
        self.on_bind()
        return self

    def share_pool(self) -> None:
        """Let the communicator place learner 0's flat parameters, gradients and buffers (on the fused
        engine: all learners' rows, one storage each) where it sums them without copying; collective.
        :meth:`average` sums into exactly these."""
        assert self.comm is not None and self.pool is not None
        first = self.pool.learners[0]
        for attr in ("params", "grads", "buffers"):
            flat = getattr(first, attr, None)
            if isinstance(flat, torch.Tensor) and flat.numel():
                self.comm.share(flat)

    def on_bind(self) -> None:
        """Allocate rule state once comm and pool are known."""

    # ------------------------------------------------------------------- hooks
    def on_gradients(self, step: int) -> None:
        """Called after every learner's backward, before the optimizer step."""

    def exchange(self, step: int) -> None:
        """Called after every learner's optimizer step."""

    def sync_state(self) -> None:
        """Make the model to validate or save consistent across ranks (collective on every rank)."""

    def averaged_before(self, step: int) -> bool:
        """Whether the exchange of step ``step − 1`` left every learner of every rank the mean parameters and
        buffers of all k: a move to another rule at ``step`` (AUTO's) then needs no average of its own. No,
        by default."""
        return False

    def eval_params(self) -> torch.Tensor | None:
        """Flat weights to validate and save, or None for learner 0's own."""
        return None

    def local_consensus(self) -> torch.Tensor | None:
        """The consensus weights this rank holds without communicating (None: its own replica): what an
        asynchronous rule can show mid-run, e.g. the server's w as last pulled. Defaults to
        :meth:`eval_params`."""
        return self.eval_params()

    def resized(self) -> None:
        """The pool has new learners (collective, every rank alike): share its new buffers, then
        :meth:`on_resize`."""
        self.share_pool()
        self.on_resize()

    def on_resize(self) -> None:
        """The pool's learner count changed (``[pool] learners = auto``); resize per-learner state.

        New learners are copies of learner 0. Rules without per-learner state override this with nothing
        to do; the default refuses, so a user rule is never resized without its consent.
        """
        raise ConfigError(f"RULE={self.name} does not support [pool] learners = auto; set a number")

    def elastic_obstacle(self, snapshots: bool = False) -> str | None:
        """The one question elastic training asks a rule (``[elastic] enabled``, ``xb.init(elastic=True)``):
        why this rule, configured as it is, cannot go on after a rank is lost — one line naming what to
        change — or None when it can. ``snapshots``: the run takes coordinated snapshots (periodic
        checkpoints, the signal stop). Asked before training, so a rule that cannot is refused at start, not
        at its first loss.

        The default: a rule goes on when it overrides :meth:`on_rebind`; an asynchronous rule's snapshots
        go on when each rank decides alone to pause (the default :meth:`agree_pause`: the fault-tolerant
        meeting is then a pause's only collective), not when it agrees to pause inside groups, whose
        agreement would meet the loss outside any recovery."""
        if type(self).on_rebind is Rule.on_rebind:
            if not self.synchronous:
                return not_forgetting(self.name)
            return f"RULE={self.name} does not support elastic training (it cannot rebind to the survivors)"
        if snapshots and not self.synchronous and type(self).agree_pause is not Rule.agree_pause:
            return (
                f"RULE={self.name}'s coordinated snapshots (periodic checkpoints, the signal stop) agree to "
                "pause inside groups that cannot go on without a lost member yet: set "
                "checkpoint.on_signal=false and no checkpoint.every_steps / every_epochs"
            )
        return None

    def backups_obstacle(self) -> str | None:
        """Why this rule's server ranks cannot have backups (``[elastic] server_backups``), or None when
        they can (the parameter-server rules whose servers forget lost workers)."""
        return f"RULE={self.name} keeps no parameter server rank to back up"

    def on_rebind(self, lost: tuple[int, ...]) -> None:
        """Ranks were lost (``lost``: their ranks before the loss) and ``self.comm`` now spans the survivors,
        renumbered (elastic training, :mod:`mpicrossbow.comm.elastic`); collective over the survivors.

        Called after every survivor restored the state of the last step all of them committed. A rule whose
        state follows ``self.comm.size`` at every use has nothing to do; a rule with fixed roles, peers or
        communicators derived from ``self.comm`` (splits, node groups) rebuilds them here. The default
        refuses, so a rule never goes on over a changed world without its consent.
        """
        raise ConfigError(
            f"RULE={self.name} does not support elastic training ([elastic] enabled): a lost rank ends "
            "the job"
        )

    def on_lr_change(self, old: float, new: float) -> None:
        """Called when the learning-rate schedule changes the rate (SMA resets replicas on a step down)."""

    def on_pause(self) -> None:
        """Called before the loop does work between two steps that is not training (an epoch's end, a
        validation, a checkpoint): a rule that times its steps leaves that time out (AUTO)."""

    def finish(self) -> None:
        """Drain messages in flight; after it returns no rank waits on another."""

    def model_survives(self, lost: set[int]) -> bool:
        """Whether the model is still held after losing the serving ranks ``lost`` (start numbering): no, by
        default — a parameter server or EASGD centre holds it alone; a server with a backup says yes while
        one of the two lives."""
        return False

    def rearm(self) -> None:
        """After ``finish()`` and a snapshot every rank took together: exchange again as before it (post
        the receives ``finish`` consumed, forget who said done). Every rank calls it at the same point."""

    def agree_pause(self, wanted: bool) -> bool:
        """After a step of an asynchronous run: whether this rank pauses for a snapshot, given whether it
        ``wanted`` to. Ranks that move in lock-step (a group that averages every step) must agree; the
        default decides alone."""
        return wanted

    @property
    def in_flight(self) -> int:
        """Requests this rank still has outstanding (posted receives, unfinished sends); 0 after finish()."""
        return 0

    @property
    def served(self) -> int:
        """Requests this rank has answered so far when it serves (a parameter server, an EASGD centre); 0 on
        a rank that trains. A serving rank takes no steps: this is its clock (``[inject] step`` counts it)."""
        return 0

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """All rule state needed to resume (tensors and plain values only)."""
        return {"hyper": dataclasses.asdict(self.hyper)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def run_record(self) -> dict[str, Any]:
        """What the rule decided during the run (``RULE=AUTO``'s choice and the figures behind it), as
        attributes for the run's metrics.h5; nothing by default."""
        return {}

    # ---------------------------------------------------------------- helpers
    @property
    def world_learners(self) -> int:
        """k: learners over all ranks."""
        assert self.comm is not None and self.pool is not None, "bind() first"
        return self.comm.size * len(self.pool.learners)

    def average(self, attr: str, comm: Communicator | None = None, atomic: bool = False) -> None:
        """Set ``attr`` (``params``, ``grads`` or ``buffers``) of every learner to the mean over all k.

        Learners of this rank are summed locally first, then one allreduce crosses ranks. ``comm`` (a
        sub-communicator of the rule's, e.g. one node's ranks) narrows the mean to its ranks' learners.
        ``atomic``: the sum goes into a buffer of the rule's own and the learners take the mean only once the
        allreduce completed, so one that fails (a lost rank) leaves every learner as it was, not half summed
        (what :attr:`heals_from_peer` asks), at one copy of ``attr`` more.
        """
        assert self.comm is not None and self.pool is not None, "bind() first"
        comm = comm or self.comm
        flats = [getattr(learner, attr) for learner in self.pool.learners]
        if not flats[0].numel():
            return
        total = flats[0]
        if atomic:
            scratch = self._sums.get(attr)
            if scratch is None or scratch.shape != total.shape:
                scratch = self._sums[attr] = torch.empty_like(total)
            total = scratch.copy_(total)
        for other in flats[1:]:
            total.add_(other)
        comm.allreduce_mean(total, comm.size * len(flats))
        for other in flats if atomic else flats[1:]:
            other.copy_(total)

    def share_trained_buffers(self, trains: bool) -> None:
        """Every learner's buffers (BatchNorm running statistics) become the mean over the learners of the
        ranks that train; collective and exact. A serving rank (parameter server, EASGD centre) never runs a
        forward pass, so without this it would validate the served weights with its initial statistics."""
        assert self.comm is not None and self.pool is not None
        flats = [learner.buffers for learner in self.pool.learners]
        if not flats[0].numel():
            return
        total = torch.zeros_like(flats[0], dtype=torch.float64)
        if trains:
            for flat in flats:
                total.add_(flat)
        self.comm.exact.allreduce(total).wait()
        (count,) = self.comm.allreduce_scalars([float(len(flats)) if trains else 0.0])
        mean = (total / count).to(flats[0].dtype)
        for flat in flats:
            flat.copy_(mean)
