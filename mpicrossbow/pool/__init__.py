"""Learner pools: the replicas one rank trains, built by an engine (serial, fused, streams) from a spec."""

from .base import LearnerPool
from .fused.fused_pool import FusedLearner, FusedPool
from .learner import Learner
from .serial import SerialPool
from .spec import PoolSpec

__all__ = ["FusedLearner", "FusedPool", "Learner", "LearnerPool", "PoolSpec", "SerialPool"]
