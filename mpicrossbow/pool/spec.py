"""PoolSpec: everything an engine needs besides the model, as one value every engine takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..config import OptimSection


@dataclass(frozen=True)
class PoolSpec:
    """Which part of the data one rank's learners read, and how they train.

    Learner j of a pool with spec ``(rank=r, size=n, learners=m)`` reads shard ``r·m + j`` of ``n·m``, or,
    with a ``span`` (the rank's fraction of the training set), the j-th of m equal parts of that span.
    """

    #: This rank's index among the ranks that train (its training shard).
    rank: int = 0
    #: How many ranks train (shards of the training set).
    size: int = 1
    #: Samples per batch per learner.
    batch_size: int = 32
    #: The optimizer recipe and learning-rate schedule every learner uses.
    optim: OptimSection = field(default_factory=OptimSection)
    #: Where the replicas live.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: Seed of the data shuffling (initial weights come from the caller's torch seed).
    seed: int = 0
    #: Learners (replicas) in the pool.
    learners: int = 1
    #: ``(start, end)`` fraction of the training set this rank reads instead of its equal shard.
    span: tuple[float, float] | None = None
    #: The fused engine's path and step form (:mod:`.chooser`): ``auto`` the first path that runs, timed
    #: against the replicas one after another; ``always`` that path untimed; ``layers``, ``replicated``,
    #: ``vmapped`` that path pinned; ``never`` the replicas one after another on the shared rows.
    fuse: Literal["auto", "always", "never", "layers", "replicated", "vmapped"] = "auto"
    #: Whether the learners' steps run through CUDA graphs (:mod:`.cuda_graphs`): ``auto`` where they can on
    #: a CUDA device (off elsewhere), ``on`` the same with every refusal an error, ``off`` never.
    cuda_graphs: Literal["auto", "on", "off"] = "auto"

    def resized(self, learners: int) -> PoolSpec:
        """The same spec with another learner count (the auto-tuner)."""
        return dataclasses.replace(self, learners=learners)
