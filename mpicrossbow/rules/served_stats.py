"""The workers' BatchNorm statistics at a serving rank, so the served model is validated as it would run.

A parameter server or an asynchronous-EASGD centre never runs a forward pass, so its own BatchNorm running
statistics stay at their initial values (mean 0, variance 1). Validating the served weights with them gives
chance accuracy on any model with BatchNorm until ``sync_state`` shares the workers' mean statistics at the
end. To make the once-per-epoch report of the served model meaningful, every worker appends the mean of its
learners' float buffers to each message it sends the reporting server (a few thousand values for a
ResNet: nothing next to the weights), the server keeps the latest from each worker, and before each report
the serving rank's learners adopt their mean. Under ``[comm] compression`` the statistics travel in 16 bits
with the rest of the message (about three significant digits: enough to validate with); the exact mean is
shared by ``sync_state`` at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..pool.replica_view import ReplicaView


def learners_mean_buffers(pool: ReplicaView) -> torch.Tensor:
    """The mean of this rank's learners' flat float buffers (empty for a model without buffers)."""
    flats = [learner.buffers for learner in pool.learners]
    if len(flats) == 1:
        return flats[0]
    return torch.stack(flats).mean(dim=0)


class ServedStats:
    """The latest buffers heard from each worker; their mean is what the served model is validated with."""

    def __init__(self, size: int) -> None:
        #: Values per worker (0: the model has no float buffers, nothing is kept).
        self.size = size
        self._latest: dict[int, torch.Tensor] = {}

    def record(self, worker: int, values: torch.Tensor) -> None:
        """Keep worker ``worker``'s buffers from the message just received (copied: the inbox is reused)."""
        if not self.size:
            return
        if worker in self._latest:
            self._latest[worker].copy_(values)
        else:
            self._latest[worker] = values.clone()

    def adopt(self, pool: ReplicaView) -> None:
        """Every learner of the serving rank takes the mean of the workers' latest buffers (no-op before any
        worker was heard from)."""
        if not self._latest:
            return
        mean = torch.stack(list(self._latest.values())).mean(dim=0)
        for learner in pool.learners:
            learner.buffers.copy_(mean)

    def reporting(
        self, pool: ReplicaView, report: Callable[[torch.Tensor, float], None]
    ) -> Callable[[torch.Tensor, float], None]:
        """``report`` preceded by :meth:`adopt`: the serving rank's callback for its once-per-epoch report."""

        def report_with_stats(served: torch.Tensor, epoch: float) -> None:
            self.adopt(pool)
            report(served, epoch)

        return report_with_stats
