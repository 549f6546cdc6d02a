"""The serial engine: m torch-native replicas trained one after another (the reference engine)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import CheckpointError, DataError
from ..model.contract import check_data
from ..model.shard import Shard
from ..trace import span
from .base import LearnerPool, TimedBatches, close_datas, next_batch, params_loaded, summed
from .cuda_graphs import LEARNER_STEP, OPTIMIZER_STEP, WATCHED, GraphSwitch, optimizer_settings
from .learner import Learner
from .precision import Precision
from .spec import PoolSpec


def learner_data(model: Any, spec: PoolSpec) -> tuple[list[Any], int]:
    """(DataClass per learner, steps per epoch): learner j of rank r reads shard ``r·m + j`` of ``size·m``.

    So no two learners share a batch; the smallest shard sets the steps per epoch. Every engine loads its
    learners' data through this, so engines given the same arguments train on the same batches. With a
    ``span`` (the rank's fraction of the training set, see :class:`~mpicrossbow.shard.Shard`) learner j
    reads the j-th of m equal parts of that span instead.
    """
    owner, learners, span, batch_size = type(model).__name__, spec.learners, spec.span, spec.batch_size
    datas = []
    for j in range(learners):
        part = None
        if span is not None:
            width = (span[1] - span[0]) / learners
            part = (span[0] + j * width, span[1] if j == learners - 1 else span[0] + (j + 1) * width)
        data = model.data(
            Shard(spec.rank * learners + j, spec.size * learners, batch_size, spec.seed, span=part)
        )
        check_data(data, owner, torch_form=True)
        datas.append(data)
    steps = min(d.n_batch_train for d in datas)
    if steps == 0:
        raise DataError(
            f"{owner}: a learner's training shard holds less than one batch of {batch_size} "
            f"({spec.size} rank(s) × {learners} learner(s) share the data)"
        )
    return datas, steps


class ShardedPool(LearnerPool):
    """A pool whose learners read the model's data shards (:func:`learner_data`): their loaders, the
    epoch's batches and the time spent waiting for them, the same for every engine that reads them."""

    model: Any
    spec: PoolSpec
    datas: list[Any]
    _n_batch_train: int
    _iters: list[TimedBatches]
    _waited: list[float]

    def _load_data(self) -> None:
        """Every learner's shard for :attr:`spec` (:func:`learner_data`); earlier shards' loaders closed."""
        close_datas(getattr(self, "datas", []))
        self.datas, self._n_batch_train = learner_data(self.model, self.spec)
        self._iters = []
        if not hasattr(self, "_waited"):  # one clock through resizes: the epoch's iterators hold it
            self._waited = [0.0]

    @property
    def n_batch_train(self) -> int:
        """Steps per epoch (the smallest learner shard decides)."""
        return self._n_batch_train

    def skip(self, count: int) -> None:
        """Pass over each learner's first ``count`` batches of this epoch (resuming mid-epoch)."""
        for batches in self._iters:
            batches.skip(count)

    def take_data_wait(self) -> float:
        """Seconds the learners waited for batches since the last call."""
        waited, self._waited[0] = self._waited[0], 0.0
        return waited

    def close(self) -> None:
        """Stop the learners' data loaders."""
        close_datas(self.datas)


class SerialPool(ShardedPool):
    """Learners of a torch-native model; learner j of rank r reads shard ``r * m + j`` of ``size * m``.

    On a CUDA device each learner's step and the optimizer steps run through CUDA graphs where they can
    (``[pool] cuda_graphs``, :mod:`.cuda_graphs`): one graph per learner, one for every optimizer step.
    """

    def __init__(self, model: Any, spec: PoolSpec) -> None:
        self.model, self.spec = model, spec
        #: Which of the pool's steps run through CUDA graphs, and why not (one switch through resizes).
        self.graphs = GraphSwitch(spec.cuda_graphs, spec.device)
        self.precision = Precision.of(spec.optim, spec.device)
        self.learners = [
            Learner(model.module(), model, spec.optim, spec.device, self.precision)
            for _ in range(spec.learners)
        ]
        self._load_data()
        self._wire_graphs()

    def _wire_graphs(self) -> None:
        """A fresh CUDA graph for every learner's step and one for the optimizer steps, where the pool
        captures (at construction, and after a resize or a checkpoint load replaced what graphs point at)."""
        self.graphs.check_optimizers(self.optimizers)
        for j, learner in enumerate(self.learners):
            learner.graph = self.graphs.step(LEARNER_STEP, learner.train_batch, self._learner_stream(j))
        self._apply_graph = self.graphs.step(OPTIMIZER_STEP, self._step_all)

    def _learner_stream(self, j: int) -> torch.cuda.Stream | None:
        """The stream learner j's graph is captured on (None: a side stream of its own)."""
        return None

    def run_record(self) -> dict[str, Any]:
        """What ran through CUDA graphs and why not (:meth:`.GraphSwitch.record`)."""
        return self.graphs.record()

    def resize(self, learners: int) -> None:
        """Keep the first ``learners`` replicas, or add copies of learner 0; reshard the data.

        Called between epochs (the auto-tuner); a new learner is a copy of learner 0: weights, buffers and
        optimizer state (momentum), so BSP's identical replicas stay identical. The next
        :meth:`start_epoch` reads the new shards.
        """
        if learners < 1:
            raise ValueError(f"a pool needs at least one learner, got {learners}")
        first = self.learners[0]
        while len(self.learners) > learners:
            self.learners.pop()
        while len(self.learners) < learners:
            learner = Learner(
                self.model.module(), self.model, self.spec.optim, self.spec.device, self.precision
            )
            learner.params.copy_(first.params)
            learner.buffers.copy_(first.buffers)
            # A deep copy: load_state_dict keeps the very tensors it is given, and a momentum buffer
            # shared with learner 0 would be stepped twice per step.
            learner.optimizer.load_state_dict(copy.deepcopy(first.optimizer.state_dict()))
            self.learners.append(learner)
        self.spec = self.spec.resized(learners)
        self._load_data()
        self._wire_graphs()

    def start_epoch(self, epoch: int) -> None:
        """Start every learner's reshuffled pass over its shard."""
        self._iters = [TimedBatches(d.train_batches(epoch), self._waited) for d in self.datas]

    def compute(self, count: int) -> None:
        """Forward and backward of each learner on its next batch."""
        for j, (learner, batches) in enumerate(zip(self.learners, self._iters, strict=True)):
            batch = next_batch(batches, count, self.n_batch_train)
            with span(f"learner {j}", "compute", learner=j):  # nested in the step's forward+backward
                learner.forward_backward(*batch)

    def nonfinite_flags(self) -> torch.Tensor:
        """Each learner's last loss not finite, on the device (no host synchronisation)."""
        return ~torch.isfinite(torch.stack([learner.last_loss for learner in self.learners]))

    def grad_layout(self) -> list[tuple[int, int]] | None:
        """Each trainable parameter's (offset, numel) in a learner's flat gradient (``param_list`` order);
        None under a loss scale (:meth:`~.base.LearnerPool.scaled_gradients`) and under ``cuda_graphs = on``
        (a replayed backward runs no hook: BSP then allreduces once after it)."""
        if self.scaled_gradients or self.graphs.strict:
            return None
        layout, offset = [], 0
        for p in self.learners[0].param_list:
            layout.append((offset, p.numel()))
            offset += p.numel()
        return layout

    def watch_gradients(self, ready: Callable[[int, int], None]) -> Callable[[], None]:
        """A post-accumulate-grad hook on every parameter of every learner: ``ready(i, 1)``; the learners'
        steps run eagerly while watched (a replayed backward runs no hook)."""
        self.graphs.hold(LEARNER_STEP, WATCHED)
        handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i, 1))
            for learner in self.learners
            for i, p in enumerate(learner.param_list)
        ]

        def unwatch() -> None:
            for handle in handles:
                handle.remove()
            self.graphs.release(LEARNER_STEP)

        return unwatch

    def state_dict(self) -> dict[str, Any]:
        """Every learner's state, in learner order."""
        return {"learners": [learner.state_dict() for learner in self.learners], **self.precision_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore every learner; the checkpoint must hold as many learners as this pool."""
        saved = state["learners"]
        if len(saved) != len(self.learners):
            raise CheckpointError(
                f"checkpoint holds {len(saved)} learner(s) per rank, this pool has {len(self.learners)}"
            )
        for learner, learner_state in zip(self.learners, saved, strict=True):
            learner.load_state_dict(learner_state)
        self.load_precision_state(state)
        self._wire_graphs()  # the optimizers' state tensors are new: graphs are captured anew

    def apply(self) -> None:
        """Every learner's optimizer step (through one CUDA graph where the pool captures it)."""
        if self._apply_graph is None:
            self._step_all()
        else:
            self._apply_graph(setting=optimizer_settings(self.optimizers))

    def _step_all(self) -> None:
        """Every learner's optimizer step, eagerly (what the optimizer step's graph captures)."""
        for learner in self.learners:
            learner.step()

    def set_lr(self, lr: float, epoch: int) -> None:
        """Same learning rate for every learner."""
        for learner in self.learners:
            learner.set_lr(lr)

    def take_stats(self) -> tuple[float, float, float]:
        """Training stats summed over learners."""
        return summed([learner.take_stats() for learner in self.learners])

    def validate(self, params: torch.Tensor | None = None, data: Any = None) -> tuple[float, float, float]:
        """Evaluate learner 0 (or ``params`` loaded into it) on every learner's val shard, or on ``data``."""
        with params_loaded(self.learners[0], params) as learner:
            return summed(
                [learner.evaluate(d.val_batches()) for d in ([data] if data is not None else self.datas)]
            )
