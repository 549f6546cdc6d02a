"""The showdown's DDP side: torch ``DistributedDataParallel`` over Gloo, trained to a target accuracy.

Each rank holds the whole training split in memory and trains on its share of a fresh permutation every
epoch (the permutation seeded by seed and epoch, rank r taking every r-th index, ``batch // ranks`` a step),
with the task's SGD recipe and mpicrossbow's own schedule function (:func:`~mpicrossbow.training.run.schedule.
lr_at`: linear warm-up, ×gamma at the milestones), so both sides follow one schedule family. Every
``validate_every`` of an epoch (and at its end) every rank evaluates half of the held-out split and the hits
are summed; the training clock stops meanwhile. The run ends at the first validation at the target.

On one device (``python -m benchmarks.tta --device cuda``) the baseline is :func:`one_replica_run`: plain
PyTorch, one replica in one process, no DDP (a world of one would add DDP's gradient hooks and a process
group and change nothing else: the faster honest baseline), the same schedule, order of samples and
validation cadence, the whole split resident on the device so no step waits for a copy.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from benchmarks.tta_grid import Run, Setup, Task
from mpicrossbow.config import DataSection, OptimSection
from mpicrossbow.data.registry import build_dataset
from mpicrossbow.training.run.schedule import lr_at


def sgd_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, lr: float, x: torch.Tensor, y: torch.Tensor, rows: Any
) -> None:
    """One plain PyTorch step at rate ``lr`` on the samples ``rows`` of ``(x, y)``: both baselines' step."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = F.cross_entropy(model(x[rows]), y[rows])
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()


def module_of(task: Task) -> torch.nn.Module:
    """The task's network: MODELCLASS of MODELFILE, an ``nn.Module`` class or a function returning one."""
    return getattr(importlib.import_module(task.modelfile), task.modelclass)()


def tensors(task: Task, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole ``split`` of the task's data set as two tensors, through the framework's registry."""
    dataset = build_dataset(task.dataset, split, {}, DataSection())
    x, y = default_collate([dataset[i] for i in range(len(dataset))])
    return x.float(), y.long()


def _accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, world: Any) -> float:
    """Accuracy on the whole held-out split: each rank scores its half, the hits are summed."""
    part = torch.arange(world.rank, len(y), world.size)
    module.eval()
    with torch.no_grad():
        hits = float((module(x[part]).argmax(1) == y[part]).sum())
    module.train()
    return world.mpi.allreduce(hits) / len(y)


def recipe_of(task: Task, lr: float) -> OptimSection:
    """The task's SGD recipe and schedule at peak rate ``lr``, as the framework's ``[optim]`` holds it (for
    :func:`~mpicrossbow.training.run.schedule.lr_at`)."""
    return OptimSection(
        lr=lr,
        momentum=task.momentum,
        weight_decay=task.weight_decay,
        schedule="multistep",
        milestones=task.milestones,
        gamma=task.gamma,
        warmup_epochs=task.warmup_epochs,
    )


def ddp_run(world: Any, task: Task, setup: Setup, seed: int, every: float, data: Any) -> Run:
    """One DDP run of ``setup`` at ``seed``; ``data`` = ``(x_train, y_train, x_val, y_val)``."""
    from torch.nn.parallel import DistributedDataParallel

    x, y, xv, yv = data
    torch.manual_seed(seed)
    net = module_of(task)
    model = DistributedDataParallel(net)  # broadcasts rank 0's initial weights
    opt = torch.optim.SGD(
        model.parameters(), lr=setup.lr, momentum=task.momentum, weight_decay=task.weight_decay
    )
    recipe = recipe_of(task, setup.lr)
    per_rank = setup.global_batch // world.size
    shard = len(y) // world.size
    steps = shard // per_rank
    interval = max(1, round(every * steps)) if 0 < every < 1 else steps
    clock, samples, curve, reached = 0.0, 0, [], (float("nan"), float("nan"))
    for epoch in range(task.max_epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        mine = order[world.rank :: world.size][:shard]
        for i in range(steps):
            started = time.perf_counter()
            sgd_step(
                model, opt, lr_at(recipe, epoch + i / steps), x, y, mine[i * per_rank : (i + 1) * per_rank]
            )
            clock += time.perf_counter() - started
            samples += per_rank * world.size
            if (i + 1) % interval and i + 1 != steps:
                continue
            accuracy = _accuracy(net, xv, yv, world)
            at = world.mpi.allreduce(clock, op=_max())
            curve.append((at, epoch + (i + 1) / steps, accuracy))
            if accuracy >= task.target:
                reached = (at, epoch + (i + 1) / steps)
                return Run(setup, seed, *reached, samples / at, accuracy, curve)
    at = world.mpi.allreduce(clock, op=_max())
    return Run(setup, seed, *reached, samples / at, curve[-1][2] if curve else float("nan"), curve)


def one_replica_run(
    task: Task, setup: Setup, seed: int, every: float, data: Any, device: torch.device
) -> Run:
    """One run of the one-device baseline: ``setup.global_batch`` a step, one replica on ``device``.

    ``data`` = ``(x_train, y_train, x_val, y_val)`` (moved to the device here, before the clock starts). The
    epoch's order is :func:`ddp_run`'s at one rank; validations fall at the same steps. The training clock
    runs from the first step and stops at each validation after waiting for the device
    (``torch.cuda.synchronize``), so no queued step is counted as validation; on CUDA, TF32 is as the
    framework's ``[optim] tf32`` default, on. A throwaway replica's step first (:func:`_warm_up`) keeps
    the libraries' first-call set-up off the clock."""
    if device.type == "cuda":
        tf32 = OptimSection().tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    x, y, xv, yv = (t.to(device) for t in data)
    batch = setup.global_batch
    _warm_up(task, x[:batch], y[:batch], xv, device)
    torch.manual_seed(seed)
    net = module_of(task).to(device)
    opt = torch.optim.SGD(
        net.parameters(), lr=setup.lr, momentum=task.momentum, weight_decay=task.weight_decay
    )
    recipe = recipe_of(task, setup.lr)
    steps = len(y) // batch
    if steps < 1:
        raise ValueError(f"batch {batch} is larger than the training split ({len(y)} samples)")
    interval = max(1, round(every * steps)) if 0 < every < 1 else steps

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    clock, samples, curve = 0.0, 0, []
    wait()
    started = time.perf_counter()
    for epoch in range(task.max_epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        order = order.to(device)
        for i in range(steps):
            sgd_step(net, opt, lr_at(recipe, epoch + i / steps), x, y, order[i * batch : (i + 1) * batch])
            samples += batch
            if (i + 1) % interval and i + 1 != steps:
                continue
            wait()
            clock += time.perf_counter() - started
            net.eval()
            with torch.no_grad():
                accuracy = float((net(xv).argmax(1) == yv).sum()) / len(yv)
            net.train()
            done = epoch + (i + 1) / steps
            curve.append((clock, done, accuracy))
            if accuracy >= task.target:
                return Run(setup, seed, clock, done, samples / clock, accuracy, curve)
            started = time.perf_counter()
    nan = float("nan")
    return Run(
        setup, seed, nan, nan, samples / clock if clock else nan, curve[-1][2] if curve else nan, curve
    )


def _warm_up(task: Task, x: torch.Tensor, y: torch.Tensor, xv: torch.Tensor, device: torch.device) -> None:
    """One training step and one validation forward of a throwaway replica, untimed and before the run's
    seed is set: cuDNN's and cuBLAS's handles and first-call kernel choices, and the optimizer's kernels,
    are then not charged to the baseline's first configuration."""
    spare = module_of(task).to(device)
    opt = torch.optim.SGD(spare.parameters(), lr=0.0, momentum=task.momentum, weight_decay=task.weight_decay)
    F.cross_entropy(spare(x), y).backward()
    opt.step()
    with torch.no_grad():
        spare(xv)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX
