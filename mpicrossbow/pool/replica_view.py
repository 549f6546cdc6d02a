"""ReplicaView: the view of a rank's model replicas that an exchange rule gets — flat buffers and little else.

A rule reads and writes each learner's flat ``params``, ``grads`` and ``buffers`` and asks a few questions
(steps per epoch, the optimizers, whether gradients exist, where backward writes them). Two kinds of owner
answer them: a :class:`~mpicrossbow.pool.base.LearnerPool`, which ``crossbow-launch``'s loop drives, and the
embedded API's :class:`~mpicrossbow.embed.own_model.OwnModel`, which wraps a user's own model and optimizer
and is driven by the user's own loop. Rules depend on this interface only, so every rule runs under both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch


class ReplicaView(ABC):
    """The m learners of one rank, seen through their flat buffers."""

    #: Each learner's flat ``params``, ``grads`` and ``buffers`` (one tensor each): what a rule reads, writes.
    learners: Sequence[Any]

    #: False when the model updates itself inside its step (Theano-MPI form): no gradients to exchange.
    has_gradients: bool = True

    @property
    @abstractmethod
    def n_batch_train(self) -> int:
        """Steps per epoch; identical on the ranks that train together (progress is counted with it)."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer that steps these replicas (one per learner, or one for all when fused)."""
        return [learner.optimizer for learner in self.learners]

    def nonfinite(self) -> list[int]:
        """Learners whose last training loss was NaN or infinite: :meth:`nonfinite_flags` read on the host
        (one synchronisation for all of them)."""
        flags = self.nonfinite_flags()
        return [] if flags is None else [j for j, bad in enumerate(flags.tolist()) if bad]

    def nonfinite_flags(self) -> torch.Tensor | None:
        """Each learner's last training loss NaN or infinite, as a bool vector on the device, with no host
        synchronisation (the NaN guard on a CUDA device); None where these replicas keep no losses."""
        return None

    def zero_gradients_where(self, flags: torch.Tensor) -> None:
        """Zero the flat gradient of each learner whose flag in ``flags`` (a bool vector on the device) is
        set, on the device, without reading the flags on the host."""
        for j, learner in enumerate(self.learners):
            learner.grads.masked_fill_(flags[j], 0.0)

    def grad_layout(self) -> list[tuple[int, int]] | None:
        """(offset, numel) of every parameter in a learner's flat gradient, in flat order; None when these
        replicas cannot report gradients as backward produces them (:meth:`watch_gradients` is then
        unused)."""
        return None

    def watch_gradients(self, ready: Callable[[int, int], None]) -> Callable[[], None]:
        """Call ``ready(i, n)`` each time backward has finished parameter i's gradient (i indexes
        :meth:`grad_layout`) for n of the learners; returns a function that stops watching.

        Lets a rule start exchanging gradients while backward still runs (BSP's buckets).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot report gradients during backward")
