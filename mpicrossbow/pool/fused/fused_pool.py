"""The fused engine: m replicas trained as one wider network (grouped convolutions, batched matmuls).

Same contract and data as :class:`~mpicrossbow.pool.serial.SerialPool` (learner j of rank r reads shard
``r·m + j`` of ``size·m``; the replicas are m calls of ``model.module()``, so one torch seed gives both
engines the same weights and batches), but a step is one forward and one backward of the fused network.

**State the rules see.** Three 2-D buffers, ``params2d (m, P)``, ``grads2d (m, P)``, ``buffers2d (m, B)``:
row j is learner j's flat replica in the serial Learner's order, so state moves between engines by copying
rows, and ``learners[j].params`` / ``.grads`` / ``.buffers`` are those rows. The fused network's parameters
are strided views of the same storage (their ``.grad`` views of ``grads2d``), so nothing is copied around the
rule hooks; measured (benchmarks/pool.py, "layout costs"), the one copy views force is about 0.1 % of a
step. ``learners[j].module`` is replica j's own module on row j (validation, inspection).

**Loss and gradients.** The loss is the sum of each replica's own ``model.loss(out_j, y_j)`` (the default
cross-entropy in one call), so replica j's gradient is its serial one; it reaches the rows under one contract
(:mod:`.step_gradients`), by autograd and the chains or, for an MLP under the default loss, by the step by
hand (:mod:`.chain_step`).

**Optimizer.** ``model.optimizer(fused_params, optim)``; the default recipe (:func:`default_recipe`) steps
the m rows of ``params2d`` instead, as PyTorch's fused SGD kernel (:func:`rows_sgd`). Only elementwise
optimizers (SGD, Adam, RMSprop…) update each replica as its own would; frozen parameters are rejected.
The path (layers, replicated, vmapped, unfused) and step form are the chooser's (:mod:`.chooser`).

**CUDA graphs** (``[pool] cuda_graphs``, :mod:`.cuda_graphs`): on a CUDA device, once the chooser has settled
the path and the form (and the first fused step has run), the step of all m replicas is captured as one graph
and the optimizer step as another; the stacked batches are copied from their page-locked buffers straight
into the graph's static inputs.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...config import OptimSection
from ...data.joint_arrays import JointArrays
from ...data.joint_batches import JointBatches
from ...errors import CheckpointError, ContractError
from ...model.contract import TorchModel, sgd_settings
from ..base import TimedBatches, next_batch, params_loaded, summed
from ..cuda_graphs import LEARNER_STEP, OPTIMIZER_STEP, WATCHED, GraphSwitch, optimizer_settings
from ..flat import empty_flat, point_grads_into, point_into
from ..learner import evaluate
from ..precision import Precision
from ..serial import ShardedPool
from ..spec import PoolSpec
from ..step_gradients import StepGradients
from .chain_step import ChainStep
from .chooser import FUSED, Chooser, synchronize
from .fused_chain import FusedChain, chain_runs
from .fused_network import FlatSlots, FusedNetwork
from .replicated_network import ReplicatedNetwork
from .staging import PinnedStaging
from .vmapped import VmappedNetwork

log = logging.getLogger(__name__)

#: A step's result: each replica's loss and its hits, ``(m,)`` each.
_Step = tuple[torch.Tensor, torch.Tensor]
#: Where a stacked batch may be copied to: ``(index, shape, dtype)`` → a device tensor, or None.
Placement = Callable[[int, Sequence[int], torch.dtype], torch.Tensor | None]

#: Autograd warns when a .grad's strides differ from a dense parameter's; ours are strided views by design.
_LAYOUT_WARNING = "grad and param do not obey the gradient layout contract"


class FusedLearner:
    """Learner j of a fused pool as a rule sees it: row j of the pool's params, grads and buffers.

    ``module`` is replica j's own network whose tensors are views of those rows (for validation and for
    looking at one replica); training goes through the pool's fused network, which shares the storage.
    """

    def __init__(
        self, module: nn.Module, params: torch.Tensor, grads: torch.Tensor, buffers: torch.Tensor
    ) -> None:
        self.module = module
        self.params = params
        self.grads = grads
        self.buffers = buffers
        #: This learner's loss of the last training batch (a view into the pool's loss vector).
        self.last_loss = torch.zeros((), device=params.device)


def _empty_rows(m: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    """An ``(m, numel)`` buffer (numpy-backed on the CPU, as the serial flat buffers)."""
    return empty_flat(m * numel, like.device, like.dtype).view(m, numel)


def _replica_tensors(
    replicas: list[nn.Module], owner: str
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each replica's parameters and float buffers, checked fusable: all trainable, one dtype, same shapes."""
    param_lists, buffer_lists = [], []
    for replica in replicas:
        frozen = [n for n, p in replica.named_parameters() if not p.requires_grad]
        if frozen:
            raise ContractError(f"{owner}: the fused engine does not support frozen parameters: {frozen}")
        param_lists.append(list(replica.parameters()))
        buffer_lists.append([b for b in replica.buffers() if b.is_floating_point()])
    first_params, first_buffers = param_lists[0], buffer_lists[0]
    if not first_params:
        raise ContractError(f"{owner}.module() returned a network with no trainable parameters")
    if len({p.dtype for p in first_params} | {b.dtype for b in first_buffers}) > 1:
        raise ContractError(f"{owner}: all parameters and float buffers must share one dtype")
    pairs = zip(param_lists, buffer_lists, strict=True)
    shapes = [([p.shape for p in ps], [b.shape for b in bs]) for ps, bs in pairs]
    if any(s != shapes[0] for s in shapes):
        raise ContractError(f"{owner}.module() returned replicas of different shapes")
    return param_lists, buffer_lists


class FusedPool(ShardedPool):
    """Learners of a torch-native model fused into one network; learner j of rank r reads shard r·m + j."""

    learners: list[FusedLearner]  # type: ignore[assignment]

    def __init__(self, model: Any, spec: PoolSpec) -> None:
        self.model = model
        #: One precision, and so one loss scale, through the run (a resize keeps it).
        self.precision = Precision.of(spec.optim, spec.device)
        self._default_loss = getattr(type(model), "loss", None) is TorchModel.loss
        self._default_correct = getattr(type(model), "correct", None) is TorchModel.correct
        #: Which of the pool's steps run through CUDA graphs, and why not (one switch through resizes).
        self.graphs = GraphSwitch(spec.cuda_graphs, spec.device)
        self._build(spec)

    def _build(self, spec: PoolSpec) -> None:
        """Everything that depends on the learner count, built for ``spec``: at construction, and again by
        :meth:`resize` (which then copies the rows it keeps)."""
        learners, device = spec.learners, spec.device
        if learners < 1:
            raise ValueError(f"learners must be >= 1, got {learners}")
        self.spec, self.device, self.m = spec, device, learners
        replicas = [self.model.module().to(device) for _ in range(learners)]
        self._load_data()
        #: In-memory shards of one layout are held stacked and drawn in one index (None: apart).
        self._joint_arrays = (
            JointArrays(self.datas) if learners > 1 and JointArrays.serves(self.datas) else None
        )
        #: Whether ``_iters`` is one joint iterator of ``(m, b, …)`` batches (else one per learner).
        self._joint = False
        #: Pinned, asynchronous host → device copies of the stacked batches (CUDA only).
        self._staging = PinnedStaging(device) if device.type == "cuda" else None
        slots, root = self._make_rows(replicas), replicas[0]
        owner = type(self.model).__name__
        builders = {
            "layers": lambda: layers_network(root, slots),
            "replicated": lambda: ReplicatedNetwork(root, slots),
            "vmapped": lambda: VmappedNetwork(root, slots),
        }
        self.choice = Chooser(spec.fuse, builders, learners)
        #: The network of the chooser's path (under ``never`` too: its parameters are the optimizer's).
        self.fused = self.choice.network()
        self.fused_params = slots.ordered_params()
        #: Column offset of each fused parameter in a row, in the order of ``fused_params``.
        self.fused_offsets = sorted(slots.fused_params)
        if len(self.fused_params) != len(slots.param_offsets):
            raise ContractError(f"{owner}: some parameters are not used by any fusable layer")
        self.optimizer = self._make_optimizer(spec.optim)
        self._wire_chains(owner)
        #: Each learner's loss sum (row 0) and hits (row 1) since the last take_stats: one add a step.
        self._stats = torch.zeros(2, learners, dtype=torch.float64, device=device)
        self._loss_sums, self._hit_counts = self._stats.unbind()
        self._samples = 0  # per learner: every learner takes a full batch each step
        self._last_losses = torch.zeros(learners, device=device)
        for j, learner in enumerate(self.learners):  # a view: a fault injected into it is seen by nonfinite()
            learner.last_loss = self._last_losses[j]
        self._fused_ran = False
        self._wire_graphs()

    def _wire_graphs(self) -> None:
        """A fresh CUDA graph for the replicas' step and one for the optimizer step, where the pool captures
        (after :meth:`_build`, and after a checkpoint load replaced the optimizer's state tensors)."""
        self.graphs.check_optimizers([self.optimizer])
        self._step_graph = self.graphs.step(LEARNER_STEP, self._recorded_step)
        self._apply_graph = self.graphs.step(OPTIMIZER_STEP, self._optimizer_step)

    def _make_rows(self, replicas: list[nn.Module]) -> FlatSlots:
        """The ``(m, P)`` params and grads and ``(m, B)`` buffers, every replica's tensors pointed into its
        row, the learners over those rows; where replica 0's tensors sit in them (for the fused network)."""
        param_lists, buffer_lists = _replica_tensors(replicas, type(self.model).__name__)
        first_params, first_buffers = param_lists[0], buffer_lists[0]
        m, n_params = len(replicas), sum(p.numel() for p in first_params)
        self.params2d = _empty_rows(m, n_params, first_params[0])
        self.grads2d = _empty_rows(m, n_params, first_params[0]).zero_()
        self.buffers2d = _empty_rows(m, sum(b.numel() for b in first_buffers), first_params[0])
        self.learners = []
        for j, replica in enumerate(replicas):
            point_into(param_lists[j], self.params2d[j])
            point_grads_into(param_lists[j], self.grads2d[j])
            if buffer_lists[j]:
                point_into(buffer_lists[j], self.buffers2d[j])
            self.learners.append(FusedLearner(replica, self.params2d[j], self.grads2d[j], self.buffers2d[j]))
        offsets = (_offsets(first_params), _offsets(first_buffers))
        return FlatSlots(self.params2d, self.grads2d, self.buffers2d, *offsets)

    def _make_optimizer(self, optim: OptimSection) -> torch.optim.Optimizer:
        """The model's optimizer over the fused parameters; where it is the default recipe (one group of SGD
        with ``[optim]``'s settings over all of them, :func:`default_recipe`), that recipe over the m
        contiguous rows instead, so a step is a few ops on m flat tensors (see the module docstring)."""
        optimizer = self.model.optimizer(self.fused_params, optim)
        if not default_recipe(optimizer, optim, len(self.fused_params)):
            return optimizer
        rows = [nn.Parameter(row) for row in self.params2d]
        for row, grad in zip(rows, self.grads2d, strict=True):
            row.grad = grad
        return rows_sgd(rows, optim) or self.model.optimizer(rows, optim)

    def _wire_chains(self, owner: str) -> None:
        """The step by hand (:mod:`.chain_step`) where the network is one chain under the default loss, and
        the step's gradient contract every chain puts its gradients through (:mod:`.step_gradients`)."""
        #: The fused step without autograd, where the network is one chain under the default loss.
        self._chain_step = ChainStep.of(self.fused) if self._default_loss else None
        if self._chain_step is not None:
            log.info(
                "fused engine: %s is one chain of Linear layers and activations under cross-entropy; its "
                "fused steps are differentiated by hand, without the autograd engine",
                owner,
            )
        #: How a step's gradients reach the rows (zeroed and added, or written), and who is told.
        index = {id(p): i for i, p in enumerate(self.fused_params)}
        self._gradients = StepGradients(self.grads2d, self.precision, index, self.m)
        chains = [chain for chain in self.fused.modules() if isinstance(chain, FusedChain)]
        for chain in chains:
            chain.sink = self._gradients
        weights = [w for chain in chains for w in chain.weights if w is not None]
        #: The parameters whose watchers the step tells (no autograd hook: their gradients are put by hand).
        self._sunk = {id(w) for w in weights}
        #: The column blocks of the rows a fused step through autograd zeroes, outside the chains' weights
        #: (:meth:`.StepGradients.start`); None: all, without chains or where a chain's weight is shared.
        uses = Counter(id(p) for _, p in self.fused.named_parameters(remove_duplicate=False))
        self._added: list[torch.Tensor] | None = None
        if weights and all(uses[id(w)] == 1 for w in weights):
            spans = sorted((self.fused_offsets[index[id(w)]], w.numel() // self.m) for w in weights)
            edges = [0, *(e for offset, n in spans for e in (offset, offset + n)), self.grads2d.shape[1]]
            pairs = zip(edges[::2], edges[1::2], strict=True)
            self._added = [self.grads2d[:, a:z] for a, z in pairs if z > a]

    @property
    def warming_up(self) -> bool:
        """While the form trial runs (``fuse = auto``: the fused network and the replicas alternate)."""
        return self.choice.chosen is None

    def run_record(self) -> dict[str, Any]:
        """The chooser's path, forms and their measurements (:meth:`.Chooser.record`), and what ran through
        CUDA graphs (:meth:`.GraphSwitch.record`)."""
        return {**self.choice.record(), **self.graphs.record()}

    def start_epoch(self, epoch: int) -> None:
        """Start every learner's reshuffled pass over its shard (one joint pass where the data allows); a
        replayed forward is recorded anew (:mod:`.replay`)."""
        if isinstance(self.fused, ReplicatedNetwork):
            self.fused.forget_replays()
        self._joint = True
        if self._joint_arrays is not None:
            self._iters = [TimedBatches(self._joint_arrays.train_batches(epoch), self._waited)]
        elif JointBatches.serves(self.datas):
            self._iters = [TimedBatches(JointBatches(self.datas, epoch), self._waited)]
        else:
            self._joint = False
            self._iters = [TimedBatches(d.train_batches(epoch), self._waited) for d in self.datas]

    def _next_batches(self, count: int, into: Placement | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every learner's next batch, stacked to ``(m, N, …)`` inputs and ``(m, N)`` targets; ``into(i,
        shape, dtype)`` names a device tensor the i-th (inputs 0, targets 1) may be copied into from its
        page-locked buffer (a CUDA graph's static input, :meth:`.GraphedStep.buffer`), or None."""

        def place(i: int, like: torch.Tensor, m: int | None = None) -> torch.Tensor | None:
            shape = like.shape if m is None else (m, *like.shape)
            return None if into is None else into(i, shape, like.dtype)

        if self._joint:
            x, y = next_batch(self._iters[0], count, self.n_batch_train)
            if self._staging is not None:
                staged = self._staging.stacked
                return staged("inputs", x.unbind(), place(0, x)), staged("targets", y.unbind(), place(1, y))
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        inputs, targets = [], []
        for batches in self._iters:
            x, y = next_batch(batches, count, self.n_batch_train)
            inputs.append(x)
            targets.append(y)
        if self._staging is not None and inputs[0].device.type == "cpu":
            m = len(inputs)
            return (
                self._staging.stacked("inputs", inputs, place(0, inputs[0], m)),
                self._staging.stacked("targets", targets, place(1, targets[0], m)),
            )
        x, y = torch.stack(inputs), torch.stack(targets)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _losses(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each replica's mean loss on its own batch, shape ``(m,)``."""
        if self._default_loss and output.ndim == 3 and targets.dtype == torch.long:
            # Autograd's own nodes: a Python node doing the same (.replica_loss) measured slower.
            flat = F.cross_entropy(
                output.reshape(-1, output.shape[-1]), targets.reshape(-1), reduction="none"
            )
            return flat.view(self.m, -1).mean(dim=1)
        return torch.stack([self.model.loss(output[j], targets[j]) for j in range(self.m)])

    def _hits(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each replica's number of correct predictions, shape ``(m,)``."""
        if self._default_correct and output.ndim == 3:
            return (output.argmax(dim=-1) == targets).sum(dim=1)
        hits = [self.model.correct(output[j], targets[j]) for j in range(self.m)]
        return torch.stack([torch.as_tensor(h, dtype=torch.float64, device=self.device) for h in hits])

    def compute(self, count: int) -> None:
        """Every learner's forward and backward on its next batch, in the step :meth:`_step_for` picks (the
        form :attr:`choice` says, see :mod:`.chooser`); each step starts the gradients' contract itself.
        Through the step's CUDA graph once the form is settled (:meth:`_graph_ready`)."""
        graph = self._step_graph if self._graph_ready() else None
        inputs, targets = self._next_batches(count, graph.buffer if graph is not None else None)
        if graph is not None:
            key = (self.choice.form(), id(self.fused), self.precision.scale)
            graph(inputs, targets, setting=key)
            self.choice.record_step(None)
            self._samples += targets.shape[1]
            return
        step = self._step_for()
        timing = self.choice.timing
        if timing:
            synchronize(self.device)
            started = time.perf_counter()
        losses, hits = step(inputs, targets)
        if timing:
            synchronize(self.device)
        self.choice.record_step(time.perf_counter() - started if timing else None)
        self._record(losses, hits, targets.shape[1])
        self._samples += targets.shape[1]

    def _graph_ready(self) -> bool:
        """Whether the step may go through its CUDA graph: the pool captures, the form trial is over and the
        fused path's guarded first step has run (graphs capture neither a trial nor a refusal)."""
        if self._step_graph is None or self.choice.chosen is None:
            return False
        return self.choice.chosen != FUSED or self._fused_ran

    def _recorded_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The step of the settled form and its statistics, device work only (what the step's graph
        captures)."""
        self._record(*self._step_for()(inputs, targets), targets.shape[1])

    def _record(self, losses: torch.Tensor, hits: torch.Tensor, n: int) -> None:
        """Each learner's loss and hits of this step on ``n`` samples each into the running statistics (on
        the device; the sample count, a Python number, is the caller's)."""
        with torch.no_grad():
            self._last_losses.copy_(losses)
            row = torch.stack((losses.double() * n, hits.double()))  # exact whatever the model's dtype
            self._stats.add_(torch.where(torch.isfinite(losses), row, 0.0))

    def _step_for(self) -> Callable[[torch.Tensor, torch.Tensor], _Step]:
        """The step this batch takes: the replicas one after another (the unfused form), the fused network's
        first step (guarded), or a fused step (by hand or through autograd, :meth:`_fused_step`)."""
        if self.choice.form() != FUSED:
            return self._unfused_step
        if not self._fused_ran:
            return self._first_fused_step
        return self._fused_step

    def _first_fused_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> _Step:
        """The first fused step, on the chooser's path: a path that refuses it (:meth:`.Chooser.refuses`)
        hands over to the next, the running statistics it moved restored, down to the replicas one after
        another; any other exception is raised."""
        saved = self.buffers2d.clone()
        while True:
            try:
                result = self._fused_step(inputs, targets)
            except (ContractError, RuntimeError) as exc:  # a path's refusal, see .chooser
                if not self.choice.refuses(exc):
                    raise
                self.buffers2d.copy_(saved)
                network = self.choice.next_network(exc)
                if network is None:
                    return self._unfused_step(inputs, targets)
                self.fused, self._added = network, None
                continue
            self._fused_ran = True
            self.choice.ran(self.fused)
            return result

    def _fused_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> _Step:
        """One forward and backward of the fused network: by hand (:mod:`.chain_step`) where it serves the
        targets, else through autograd."""
        if not self.fused.training:
            self.fused.train()
        if self._chain_step is not None and self._chain_step.serves(targets):
            self._gradients.start(written=True)
            losses, output = self._chain_step(inputs, targets, self._gradients)
            with torch.no_grad():
                return losses, self._hits(output, targets)
        self._gradients.start(blocks=self._added)
        with self.precision.autocast():
            output = self.fused(inputs)
            losses = self._losses(output, targets)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LAYOUT_WARNING)
            self._gradients.backward(losses.sum())
        with torch.no_grad():
            return losses.detach(), self._hits(output, targets)

    def _unfused_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each replica's own forward and backward, one after another, on the pool's shared rows."""
        self._gradients.start()
        losses, hits = [], []
        for learner, x, y in zip(self.learners, inputs, targets, strict=True):
            module = learner.module
            if not module.training:
                module.train()
            with self.precision.autocast():
                output = module(x)
                loss = self.model.loss(output, y)
            self._gradients.backward(loss)
            with torch.no_grad():
                losses.append(loss.detach().float())
                hit = self.model.correct(output, y)
                hits.append(torch.as_tensor(hit, dtype=torch.float64, device=x.device))
        return torch.stack(losses), torch.stack(hits)

    def grad_layout(self) -> list[tuple[int, int]] | None:
        """Each fused parameter's (column offset, numel of one replica's slice) in a row of ``grads2d``; None
        under a loss scale (:meth:`~.base.LearnerPool.scaled_gradients`) and under ``cuda_graphs = on`` (a
        replayed backward tells no watcher: BSP then allreduces once after it)."""
        if self.scaled_gradients or self.graphs.strict:
            return None
        return [(o, p.numel() // self.m) for o, p in zip(self.fused_offsets, self.fused_params, strict=True)]

    def watch_gradients(self, ready: Callable[[int, int], None]) -> Callable[[], None]:
        """A post-accumulate-grad hook on every fused parameter, ``ready(i, m)`` (the fused form: all replicas
        at once), and on every replica's parameter, ``ready(i, 1)`` (the replicas one after another). A
        gradient put straight into its row (:mod:`.step_gradients`) fires no hook; the step calls
        ``ready(i, m)`` itself. The step runs eagerly while watched (a replay calls no Python)."""
        self.graphs.hold(LEARNER_STEP, WATCHED)
        watchers = self._gradients.watchers
        watchers.append(ready)
        handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i, self.m))
            for i, p in enumerate(self.fused_params)
            if id(p) not in self._sunk
        ] + [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i, 1))
            for learner in self.learners
            for i, p in enumerate(learner.module.parameters())
        ]

        def unwatch() -> None:
            for handle in handles:
                handle.remove()
            if ready in watchers:
                watchers.remove(ready)
            self.graphs.release(LEARNER_STEP)

        return unwatch

    def apply(self) -> None:
        """One optimizer step over the fused parameters (every replica's step), through its CUDA graph where
        the pool captures it."""
        if self._apply_graph is None:
            self._optimizer_step()
        else:
            self._apply_graph(setting=optimizer_settings([self.optimizer]))

    def _optimizer_step(self) -> None:
        """The optimizer's step, eagerly (what the optimizer step's graph captures)."""
        self.optimizer.step()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The one optimizer that steps every replica."""
        return [self.optimizer]

    def nonfinite_flags(self) -> torch.Tensor:
        """Each learner's last loss not finite, on the device (no host synchronisation)."""
        return ~torch.isfinite(self._last_losses)

    def zero_gradients_where(self, flags: torch.Tensor) -> None:
        """Zero the gradient rows of the flagged learners: one operation on the device for all of them."""
        self.grads2d.masked_fill_(flags[:, None], 0.0)

    def state_dict(self) -> dict[str, Any]:
        """All replicas (rows), the fused optimizer's state and the running stats."""
        return {
            "params2d": self.params2d,
            "buffers2d": self.buffers2d,
            "optimizer": self.optimizer.state_dict(),
            "stats": self._stats.clone(),
            "samples": self._samples,
            "form": self.choice.state_dict(),
            **self.precision_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values in place (same learner count and model, else an error)."""
        for name in ("params2d", "buffers2d"):
            mine, theirs = getattr(self, name), state[name]
            if theirs.shape != mine.shape:
                raise CheckpointError(
                    f"checkpoint {name} has shape {tuple(theirs.shape)}, this fused pool "
                    f"{tuple(mine.shape)}: another model or learner count"
                )
            mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
        self._stats.copy_(state["stats"])
        self._samples = int(state["samples"])
        if "form" in state:
            self.choice.load_state_dict(state["form"])
        self.load_precision_state(state)
        self._wire_graphs()  # the optimizer's state tensors are new: graphs are captured anew

    def resize(self, learners: int) -> None:
        """Rebuild for ``learners`` replicas between epochs (auto-tuner, :meth:`_build`); rows kept, new rows
        copy row 0.

        With the default optimizer recipe the momentum rows move along (a new learner copies learner 0's,
        as the serial engine does); a custom optimizer restarts with fresh state, with a warning.
        """
        old_m, old_params, old_buffers = self.m, self.params2d.clone(), self.buffers2d.clone()
        old_state = self.optimizer.state_dict()["state"]
        lr = self.optimizer.param_groups[0]["lr"]
        self._build(self.spec.resized(learners))
        rows = [j if j < old_m else 0 for j in range(learners)]
        self.params2d.copy_(old_params[rows])
        self.buffers2d.copy_(old_buffers[rows])
        new_params = self.optimizer.param_groups[0]["params"]
        by_row = len(new_params) == learners and len(old_state) == old_m
        if by_row and all(isinstance(s.get("momentum_buffer"), torch.Tensor) for s in old_state.values()):
            for param, src in zip(new_params, rows, strict=True):
                self.optimizer.state[param] = {
                    **old_state[src],
                    "momentum_buffer": old_state[src]["momentum_buffer"].clone(),
                }
        elif old_state:
            log.warning("fused pool resized to %d learners: optimizer state restarts", learners)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_lr(self, lr: float, epoch: int) -> None:
        """Same learning rate for every learner."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def take_stats(self) -> tuple[float, float, float]:
        """Training stats summed over learners since the last call."""
        loss, hits = float(self._loss_sums.sum()), float(self._hit_counts.sum())
        n = float(self._samples * self.m)
        self._stats.zero_()
        self._samples = 0
        return loss, hits, n

    def learner_stats(self) -> list[tuple[float, float, float]]:
        """Per-learner (loss sum, hits, samples) since the last :meth:`take_stats`, without resetting."""
        n = float(self._samples)
        return [(loss, hits, n) for loss, hits in zip(*self._stats.tolist(), strict=True)]

    def validate(self, params: torch.Tensor | None = None, data: Any = None) -> tuple[float, float, float]:
        """Evaluate learner 0 (or ``params`` loaded into it) on every learner's val shard, or on ``data``."""
        with params_loaded(self.learners[0], params) as learner:
            sets = [data] if data is not None else self.datas
            return summed(
                [
                    evaluate(learner.module, self.model, self.device, d.val_batches(), self.precision)
                    for d in sets
                ]
            )


def layers_network(root: nn.Module, slots: FlatSlots) -> nn.Module:
    """The layer-by-layer fused network (its runs of Linear layers and activations as one node each,
    :mod:`.fused_chain`); a ContractError where a layer is not one the fuser widens."""
    network = FusedNetwork(root, slots)
    chains = chain_runs(network)
    if chains:
        log.debug(
            "fused engine: %d run(s) of Linear layers and activations differentiated as one node", chains
        )
    return network


def default_recipe(optimizer: torch.optim.Optimizer, optim: OptimSection, params: int) -> bool:
    """Whether ``optimizer`` declares the default recipe: plain ``torch.optim.SGD``, one parameter group over
    all ``params`` fused parameters, its settings those ``[optim]`` gives (:func:`sgd_settings`). Such an
    optimizer is elementwise and blind to the parameters' shapes, so it may step the m rows instead; any other
    (another class, several groups, other settings) keeps the fused parameters it was given."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    group = dict(optimizer.param_groups[0])
    count = len(group.pop("params"))
    expected = torch.optim.SGD([torch.zeros(1)], **sgd_settings(optim)).defaults
    return count == params and group == expected


def rows_sgd(rows: list[nn.Parameter], optim: OptimSection) -> torch.optim.Optimizer | None:
    """The default recipe's SGD over the m flat rows as PyTorch's fused single-pass kernel.

    Weight decay, momentum and the update in one pass instead of three or four: measured 1.7–2.7× faster
    than the default (for-each) SGD on 8 rows of 26 k and 107 k float32 values, one thread, with the same
    state (``momentum_buffer``) and the same arithmetic to float32 round-off. One parameter per row, not
    one ``(m, P)`` parameter: the kernel rounds an element by its position in the tensor (vector body or
    scalar tail), so only rows that each start a tensor are updated bitwise alike, as BSP's identical
    replicas must be. Only float32 and float64, where the kernel's results match the default's; None
    otherwise (the caller then builds the default).
    """
    if rows[0].dtype not in (torch.float32, torch.float64):
        return None
    return torch.optim.SGD(rows, **sgd_settings(optim), fused=True)


def _offsets(tensors: list[torch.Tensor]) -> dict[int, int]:
    """``id(tensor)`` → its offset in a flat buffer that holds ``tensors`` one after another."""
    offsets, offset = {}, 0
    for t in tensors:
        offsets[id(t)] = offset
        offset += t.numel()
    return offsets
