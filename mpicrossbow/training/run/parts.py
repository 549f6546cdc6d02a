"""RankParts: what the Session assembled for one rank, handed to the run mode and its loop as one value."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...comm.base import Communicator
from ...config import Config
from ...launch.world import FollowsWorld, WorldView
from ...pool.base import LearnerPool
from ...rules.base import Rule
from ..checkpoints.checkpoint_manager import CheckpointManager
from ..health.faults import FaultInjector, Straggler
from ..health.watchdog import Watchdog
from ..reporting.reporting import Reporter
from ..reporting.timeline import Timeline
from ..tuning.autotune import AutoTuner
from .evaluation import Evaluator
from .window import StepWindow, Unguarded


@dataclass
class RankParts(FollowsWorld):
    """One rank's assembled job: the plug-ins (pool, rule, communicator) and the loop's components. Its
    ``world`` is the run's shared view's (:class:`~mpicrossbow.launch.world.WorldView`), as the reporter's,
    the evaluator's and the checkpoints' are."""

    config: Config
    view: WorldView
    pool: LearnerPool
    rule: Rule
    comm: Communicator
    reporter: Reporter
    evaluator: Evaluator
    checkpoints: CheckpointManager
    faults: FaultInjector
    straggler: Straggler
    #: Heartbeats, dead peers and stalls (``[watchdog]`` on), else None.
    watchdog: Watchdog | None
    #: Crossbow's learner auto-tuner (``[pool] learners = auto``), else None.
    tuner: AutoTuner | None
    #: Whether this rank trains (False: it serves, e.g. a parameter server).
    trains: bool
    #: The Chrome-trace timeline (``[session] timeline``), else None.
    timeline: Timeline | None = None
    #: How steps and the collectives between them run: the run's fault tolerance when it is elastic
    #: (:class:`~mpicrossbow.training.elastic.fault_tolerance.FaultTolerance`), with this rank's drill
    #: around it when it has one.
    window: StepWindow = field(default_factory=Unguarded)
