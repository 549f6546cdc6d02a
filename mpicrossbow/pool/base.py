"""The LearnerPool interface: the m replicas a rank trains, as the session and the rules see them."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import DataError
from ..trace import complete
from .learner import Learner
from .precision import FP32, Precision
from .replica_view import ReplicaView


class LearnerPool(ReplicaView):
    """m learners inside one rank, each with its own replica, optimizer state and batches.

    The session drives a step as ``compute()`` (forward and backward of every learner), the rule's
    ``on_gradients``, ``apply()`` (every optimizer step) and the rule's ``exchange``. Rules see only the
    :class:`~.replica_view.ReplicaView` part: the learners' flat ``params``, ``grads`` and ``buffers``.
    """

    learners: list[Learner]
    #: How the learners' forward computes and their loss is scaled (``[optim] precision``).
    precision: Precision = FP32

    @property
    def scaled_gradients(self) -> bool:
        """Whether backward leaves the gradients multiplied by a loss scale (fp16) until the step divides it
        out: then no rule may read them during backward, and :meth:`grad_layout` says None (BSP keeps its
        one allreduce after the agreed unscale instead of buckets during backward)."""
        return self.precision.loss_scale is not None

    def precision_state(self) -> dict[str, Any]:
        """The loss scale's part of :meth:`state_dict` (nothing without one)."""
        state = self.precision.state_dict()
        return {"loss_scale": state} if state else {}

    def load_precision_state(self, state: Mapping[str, Any]) -> None:
        """Restore the loss scale from a checkpoint's pool state (one saved without it leaves it as is)."""
        self.precision.load_state_dict(state.get("loss_scale", {}))

    @abstractmethod
    def start_epoch(self, epoch: int) -> None:
        """Prepare every learner's batches for ``epoch`` (deterministic reshuffle)."""

    @abstractmethod
    def compute(self, count: int) -> None:
        """Forward and backward (or the model's own step) of every learner on its next batch."""

    @abstractmethod
    def apply(self) -> None:
        """Apply every learner's optimizer step."""

    @abstractmethod
    def set_lr(self, lr: float, epoch: int) -> None:
        """Set the learning rate for the coming steps of ``epoch``."""

    @abstractmethod
    def validate(self, params: torch.Tensor | None = None, data: Any = None) -> tuple[float, float, float]:
        """(loss sum, hits, samples) over this rank's validation shard with learner 0's weights or ``params``.

        ``params`` (a flat buffer such as a centre variable) is swapped in for the evaluation only; ``data``
        (a DataClass) replaces the pool's own validation shards.
        """

    @abstractmethod
    def take_stats(self) -> tuple[float, float, float]:
        """(loss sum, hits, samples) of training since the last call, summed over learners."""

    def take_data_wait(self) -> float:
        """Seconds the learners waited for their next batch since the last call (the loop's data wait)."""
        return 0.0

    @property
    def warming_up(self) -> bool:
        """Whether the coming step still settles how the pool runs (the fused engine's timed trial of its
        forms): such a step is not the pool's steady speed, and the auto-tuner leaves it out."""
        return False

    def run_record(self) -> dict[str, Any]:
        """What the pool settled on to run (the fused engine's path and forms, and the measurements behind
        them), as attributes for the run's metrics.h5; nothing by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Every learner's replica, buffers, optimizer state and running stats, for a checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} cannot be checkpointed")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same learner count and model size, else an error)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be checkpointed")

    def skip(self, count: int) -> None:
        """After :meth:`start_epoch`, pass over the first ``count`` batches without training (resume)."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume inside an epoch")

    def resize(self, learners: int) -> None:
        """Change the number of learners between epochs (the auto-tuner); engines that can override this."""
        raise NotImplementedError(f"{type(self).__name__} cannot change its number of learners")

    def close(self) -> None:
        """Release data files and model resources."""


class TimedBatches:
    """A learner's batches for one epoch that add the time each ``next()`` waited to ``clock[0]``.

    A pipeline that keeps up hands over a prefetched batch at once; the sum is what the GPU (or CPU) sat
    idle for data. ``skip(count)`` passes the first batches over, without loading them when the batches
    know how (:class:`~mpicrossbow.data.loader.Batches`).
    """

    def __init__(self, batches: Any, clock: list[float]) -> None:
        self.batches, self.clock = iter(batches), clock

    def __iter__(self) -> TimedBatches:
        """Itself: one pass."""
        return self

    def __next__(self) -> Any:
        """The next batch, timed."""
        started = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            ended = time.perf_counter()
            self.clock[0] += ended - started
            complete("data wait", "data", started, ended, track="data")

    def skip(self, count: int) -> None:
        """Pass over the next ``count`` batches (resuming mid-epoch)."""
        skip = getattr(self.batches, "skip", None)
        if callable(skip):
            skip(count)
            return
        for _ in range(count):
            next(self.batches)


def close_datas(datas: Sequence[Any]) -> None:
    """Close the DataClasses that hold resources (a DataLoader's worker processes, open files)."""
    for data in datas:
        close = getattr(data, "close", None)
        if callable(close):
            close()


def next_batch(batches: Iterator[Any], count: int, expected: int) -> Any:
    """A learner's next ``(inputs, targets)``; a DataError when ``train_batches()`` ends early."""
    try:
        return next(batches)
    except StopIteration:
        raise DataError(
            f"train_batches() ended after {count} batches but n_batch_train says {expected}"
        ) from None


@contextmanager
def params_loaded(learner: Any, params: torch.Tensor | None) -> Iterator[Any]:
    """``learner`` with ``params`` copied into its weights for the block (None: its own), restored after."""
    saved = None
    if params is not None:
        saved = learner.params.clone()
        learner.params.copy_(params)
    try:
        yield learner
    finally:
        if saved is not None:
            learner.params.copy_(saved)


def summed(rows: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """Column sums of ``(loss sum, hits, samples)`` rows."""
    return tuple(sum(col) for col in zip(*rows, strict=True))  # type: ignore[return-value]
