"""Learner pools: the replicas one rank trains (serial engine; Theano-MPI-form adapter)."""

from .base import LearnerPool
from .learner import Learner
from .serial import SerialPool
from .theano import Recorder, TheanoPool

__all__ = ["Learner", "LearnerPool", "Recorder", "SerialPool", "TheanoPool"]
