"""The engine registry: ``[pool] engine = serial | fused | streams`` → the LearnerPool class that runs it.

Every engine takes the same constructor arguments ``(model, rank, size, batch_size, optim, device, seed,
learners)`` and gives the rules the same per-learner flat buffers, so a rule never knows which engine runs.
"""

from __future__ import annotations

from ..registry import Registry
from .base import LearnerPool
from .fused.fused_pool import FusedPool
from .serial import SerialPool
from .streams import StreamsPool

#: Engine name → LearnerPool class; unknown names get an error listing these.
ENGINES: Registry[LearnerPool] = Registry("engine", LearnerPool)
ENGINES.register("serial")(SerialPool)
ENGINES.register("fused")(FusedPool)
ENGINES.register("streams")(StreamsPool)
