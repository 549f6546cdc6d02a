"""A training session on one rank: assemble (device, pool, communicator, rule and the loop's components)
from a Config, then hand them to the run mode the rule calls for.

Assembly is split in two so bad input can never hang a job: :meth:`Session.prepare_local` does everything
that needs no other rank (device, model file, data, replicas, the checkpoint to resume) and may fail with a
one-line UsageError; the ranks agree on success (:func:`~mpicrossbow.launch.failure.agree`) before
:meth:`Session.prepare_collective` starts talking (communicator, run folder, initial broadcast). The loop
itself lives in :mod:`.loop` and :mod:`.modes`; the Session only assembles and closes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...comm import make_communicator
from ...comm.base import Communicator
from ...comm.elastic import ElasticCommunicator, elastic_over_mpi
from ...config import Config
from ...errors import CheckpointError, ConfigError
from ...launch.binding import Binding, requested_threads
from ...launch.devices import device_for_rank
from ...launch.world import World, WorldView
from ...model.consistency import check_same_shapes
from ...pool.base import LearnerPool
from ...rules.base import Rule
from ...rules.patience import Patience
from ...rules.registry import resolve
from ..checkpoints.checkpoint_manager import CheckpointManager
from ..checkpoints.storage import check_writable
from ..elastic.replacement import Handover, Offer
from ..elastic.run_tolerance import RunTolerance, resolve_elastic, server_backups
from ..health.drill import drilled, trapped
from ..health.faults import FaultInjector, Straggler
from ..health.watchdog import Watchdog, start_watchdog
from ..replica_groups import join_groups, resolve_link, shard_world
from ..reporting.reporting import Reporter, make_run_dir
from ..reporting.result import RunResult
from ..reporting.timeline import Timeline
from ..returning_group import returning, take_group_state
from ..tuning.autotune import AutoTuner, start_count
from .combinations import check_combinations
from .evaluation import Evaluator
from .modes import choose_mode
from .parts import RankParts
from .pool_builder import build_pool

log = logging.getLogger(__name__)


class Session:
    """One rank's part of a training job: assembles the parts, runs the mode, closes what it opened."""

    def __init__(self, config: Config, world: World, rule: Rule | None = None) -> None:
        self.config, self.world, self.rule = config, world, rule
        #: The run's world as it is now, shared by the parts that gather or report (elastic training moves
        #: it on in one place).
        self.view = WorldView(world)
        self.pool: LearnerPool | None = None
        #: The whole validation set, for ranks that validate alone (asynchronous rules); else None.
        self.full_val: Any = None
        self.comm: Communicator | None = None
        self.run_dir: Path | None = None
        self.parts: RankParts | None = None
        self.checkpoints: CheckpointManager | None = None
        self.watchdog: Watchdog | None = None
        self.reporter: Reporter | None = None
        self.tuner: AutoTuner | None = None
        self.binding: Binding | None = None  # set by the runner before prepare_local
        self.device = torch.device("cpu")
        #: The run's fault tolerance, when it goes on after losing a rank (``[elastic] enabled``, resolved to
        #: true or false in prepare_local), else None: built once, in ``prepare_collective``.
        self.fault_tolerance: RunTolerance | None = None
        #: The communicator that can lose a rank, when the run is elastic (the fault tolerance's).
        self.elastic_comm: ElasticCommunicator | None = None
        #: This rank's ``[inject]`` drill (every rank has one; it does nothing on the others).
        self.faults: FaultInjector | None = None

    # --------------------------------------------------------------- local
    def prepare_local(self, joining: bool = False) -> None:
        """Everything that involves no other rank: device, threads, seeds, rule, model, data and replicas.
        ``joining``: a replacement (:mod:`.replacement`), whose world is the start rank it stands for; the
        checkpoint folder stays the survivors' rank 0's."""
        cfg, world = self.config, self.world
        if cfg.size is not None and cfg.size != world.size:
            raise ConfigError(
                f"SIZE={cfg.size} but the job has {world.size} rank(s); start it with -n {cfg.size}"
            )
        self.device = device_for_rank(cfg.devices, world.rank, world.size).torch_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        threads = cfg.session.threads or (
            self.binding.threads
            if self.binding is not None
            else requested_threads() or max(1, len(os.sched_getaffinity(0)) // max(1, world.local_size))
        )
        torch.set_num_threads(threads)
        rule, cfg = resolve(resolve_link(cfg), self.rule)  # session.cfg records the resolved hyper-parameters
        elastic = resolve_elastic(cfg, rule, world)
        rule.server_backups = server_backups(cfg, rule, elastic)
        check_combinations(cfg, rule, world)
        cfg = dataclasses.replace(cfg, elastic=dataclasses.replace(cfg.elastic, enabled=elastic))
        self.rule, self.config = rule, cfg
        auto = cfg.pool.learners == "auto"
        learners = self._tuner_start() if auto else int(cfg.pool.learners)
        torch.manual_seed(cfg.session.seed)  # the same initial replicas everywhere (bind broadcasts anyway)
        shards = shard_world(world, cfg)  # every replica group's ranks, end to end
        self.pool, self.full_val = build_pool(cfg, shards, rule, self.device, learners)
        torch.manual_seed(cfg.session.seed * 1_000_003 + shards.rank)  # per-rank dropout and augmentation
        check_writable(Path(cfg.session.output), "[session] output")
        self.checkpoints = CheckpointManager(cfg, self.view, self.pool, self.device)
        if auto:
            self.tuner = self._resumed_tuner(self.checkpoints)
        steps = cfg.session.steps
        rule.check_run(steps / self.pool.n_batch_train if steps else cfg.session.epochs)
        rule.check_learners(world.size * len(self.pool.learners))
        rule.on_lr_scaling(cfg.optim.lr_scaling)
        if not joining:
            self.checkpoints.claim(rule.synchronous and (cfg.checkpoint.enabled or cfg.checkpoint.on_signal))
        log.info(
            "%s model %s from %s on %s, %d thread(s), %s learner(s) per rank (%s engine), %d step(s)/epoch",
            "torch" if self.pool.has_gradients else "theano",
            cfg.modelclass,
            cfg.modelfile,
            self.device,
            threads,
            f"auto: {learners}" if auto else learners,
            cfg.pool.engine,
            self.pool.n_batch_train,
        )

    def _trainers(self) -> int:
        """How many ranks train (a parameter server's serving ranks do not)."""
        assert self.rule is not None
        return sum(self.rule.trains(rank, self.world.size) for rank in range(self.world.size))

    def _tuner_start(self) -> int:
        """The learners per rank ``learners = auto`` starts with (:func:`~.autotune.start_count`)."""
        cfg, rule = self.config, self.rule
        assert rule is not None
        return start_count(cfg.pool.tune, rule.averages_gradients, self._trainers(), cfg.pool.max_learners)

    def _resumed_tuner(self, checkpoints: CheckpointManager) -> AutoTuner:
        """The auto-tuner (``[pool] learners = auto``), continued from a resumed checkpoint's state; the pool
        is resized to its learner count before the checkpoint's state is loaded into it."""
        cfg, pool = self.config, self.pool
        assert pool is not None and self.rule is not None
        tuner = AutoTuner(
            cfg.pool.tune_threshold,
            cfg.pool.max_learners,
            start=self._tuner_start(),
            tune=cfg.pool.tune,
            unit_batch=max(1, self._trainers()) * cfg.data.batch_size,
        )
        if checkpoints.resume is None:
            return tuner
        path, meta, _ = checkpoints.resume
        state = checkpoints.tuner_state()
        if not state and meta.get("learners") != len(pool.learners):
            raise CheckpointError(
                f"checkpoint {path} was written with [pool] learners = {meta.get('learners')}, not auto: "
                f"resume with pool.learners={meta.get('learners')}"
            )
        try:
            tuner.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: auto-tuner state: {exc}") from None
        if tuner.learners != len(pool.learners):
            pool.resize(tuner.learners)
            if self.world.rank == 0:
                log.info("auto-tune: resumed with the tuner's %d learner(s) per rank", tuner.learners)
        return tuner

    def check_consistency(self) -> None:
        """Collective: every rank built the same model (parameter shapes), or a ContractError on all ranks."""
        assert self.pool is not None
        learner = self.pool.learners[0]
        mine = [tuple(p.shape) for p in getattr(learner, "param_list", [learner.params])]
        check_same_shapes(self.world, mine)

    # ---------------------------------------------------------- collective
    def prepare_collective(self) -> None:
        """Communicator, run folder, rule binding (broadcast of rank 0's weights), checkpoints, watchdog,
        reporting: the parts the run mode gets."""
        assert self.pool is not None and self.rule is not None and self.checkpoints is not None
        cfg, world, mpi = self.config, self.world, self.world.mpi
        if cfg.elastic.enabled is True:  # a parameter server forgets a lost worker and goes on
            self.elastic_comm = elastic_over_mpi(cfg.comm, self.device, mpi, not self.rule.synchronous)
        self.comm = self.elastic_comm or join_groups(make_communicator(cfg.comm, self.device, mpi), cfg)
        self.faults = FaultInjector(cfg.inject, world.rank)
        run_dir = (self.checkpoints.resumed_run_dir() or make_run_dir(cfg)) if world.rank == 0 else None
        self.run_dir = Path(world.bcast(str(run_dir.absolute()) if run_dir is not None else ""))
        self.rule.patience = Patience.of(cfg.watchdog)
        self.rule.bind(trapped(self.comm, self.faults), self.pool)
        self.checkpoints.restore(self.rule)
        take_group_state(self.comm, world, self.pool, self.rule, self.checkpoints)  # a replica group back
        # Asynchronous rules checkpoint by coordinated snapshots (.snapshots); no step watchdog for them.
        synchronous = self.rule.synchronous
        if cfg.checkpoint.enabled or cfg.checkpoint.on_signal:  # elastic: over the group a loss revokes
            native = self.elastic_comm.group.native if self.elastic_comm is not None else None
            self.checkpoints.start(self.run_dir, native)
        wd = cfg.watchdog
        if wd.peer_timeout or (synchronous and (wd.warn_after or wd.abort_after)):
            elastic = self.elastic_comm is not None
            self.watchdog = start_watchdog(wd, world, self.run_dir, synchronous, elastic)
        self.reporter = Reporter(cfg, self.view, self.run_dir, self.checkpoints.resume_step)
        self._assemble()

    def prepare_joined(
        self, comm: ElasticCommunicator, world: World, offer: Offer, receive: Callable[[], Handover]
    ) -> None:
        """A replacement's collective part (:mod:`.replacement`, steps 3-4), after ``prepare_local``: the
        communicator ``comm`` over the grown ``world`` (built already, as the survivors built theirs), the
        rule bound over it with the survivors, then the ``receive``d handover installed and the loop set to
        go on from the offer's position. No step watchdog (its heartbeats are the start world's ranks'), no
        timeline, no pid gather (rank 0 logged those at start)."""
        assert self.pool is not None and self.rule is not None and self.checkpoints is not None
        cfg, start_rank = self.config, self.world.rank
        self.comm, self.world, self.run_dir, self.view.now = comm, world, Path(offer.run_dir), world
        self.elastic_comm = comm
        self.faults = FaultInjector(dataclasses.replace(cfg.inject, rank=-1), world.rank)  # start ranks only
        self.checkpoints.adopt(offer.position)
        if cfg.checkpoint.enabled or cfg.checkpoint.on_signal:  # collective, as the survivors' new saver
            self.checkpoints.start(self.run_dir)
        self.rule.patience = Patience.of(cfg.watchdog)
        self.rule.bind(comm, self.pool)
        receive().install([self.pool, self.rule], self.pool.learners)
        self.reporter = Reporter(cfg, dataclasses.replace(world, mpi=None), self.run_dir, None, start_rank)
        self.reporter.view = self.view
        self._assemble(joined=True)

    def _assemble(self, joined: bool = False) -> None:
        """The reporting line, the evaluator and the run's parts (``joined``: a replacement's)."""
        assert self.pool is not None and self.rule is not None and self.checkpoints is not None
        assert self.comm is not None and self.run_dir is not None and self.reporter is not None
        cfg, world = self.config, self.world
        if world.rank == 0:
            log.info(
                "run folder %s; %d rank(s), rule %s, comm %s",
                self.run_dir,
                world.size,
                cfg.rule,
                self.comm.name,
            )
        trains = self.rule.trains(world.rank, world.size)
        assert self.faults is not None
        evaluator = Evaluator(self.pool, self.rule, self.comm, self.view, self.reporter, self.full_val)
        self.parts = RankParts(
            config=cfg,
            view=self.view,
            pool=self.pool,
            rule=self.rule,
            comm=self.comm,
            reporter=self.reporter,
            evaluator=evaluator,
            checkpoints=self.checkpoints,
            faults=self.faults,
            straggler=Straggler.of(cfg.session, world.rank, self.comm.size),  # the linked groups too
            watchdog=self.watchdog,
            tuner=self.tuner,
            trains=trains,
            timeline=(
                Timeline(world, cfg.session.timeline, self.run_dir / "timeline.json")
                if cfg.session.timeline and not joined
                else None
            ),
        )
        if self.elastic_comm is not None:
            self.fault_tolerance = RunTolerance.configured(self.parts, self.elastic_comm, cfg.elastic)
            self.parts.window = self.fault_tolerance
        window = drilled(self.parts.window, self.faults, self.rule.comm)
        self.parts.window = returning(window, self.comm, self.pool, self.rule)

    # ----------------------------------------------------------------- run
    def run(self) -> RunResult:
        """Train to the step or epoch budget (or serve); every rank returns the same RunResult."""
        assert self.parts is not None, "prepare_collective() first"
        return choose_mode(self.parts).run()

    def close(self) -> None:
        """Stop the watchdog; close the metrics file, the pool and the communicator."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.reporter is not None:
            self.reporter.close()
        if self.pool is not None:
            self.pool.close()
        if self.comm is not None:
            self.comm.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
