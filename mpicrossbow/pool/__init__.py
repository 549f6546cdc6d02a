"""Learner pools: the replicas one rank trains (serial and fused engines; Theano-MPI-form adapter)."""

from .base import LearnerPool
from .fused import FusedLearner, FusedPool
from .learner import Learner
from .serial import SerialPool
from .theano import Recorder, TheanoPool

__all__ = ["FusedLearner", "FusedPool", "Learner", "LearnerPool", "Recorder", "SerialPool", "TheanoPool"]
