"""The showdown's DDP side: torch ``DistributedDataParallel`` over Gloo, trained to a target accuracy.

Each rank holds the whole training split in memory and trains on its share of a fresh permutation every
epoch (the permutation seeded by seed and epoch, rank r taking every r-th index, ``batch // ranks`` a step),
with the task's SGD recipe and mpicrossbow's own schedule function (:func:`~mpicrossbow.training.schedule.
lr_at`: linear warm-up, ×gamma at the milestones), so both sides follow one schedule family. Every
``validate_every`` of an epoch (and at its end) every rank evaluates half of the held-out split and the hits
are summed; the training clock stops meanwhile. The run ends at the first validation at the target.
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
from mpicrossbow.training.schedule import lr_at


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
    recipe = OptimSection(
        lr=setup.lr,
        momentum=task.momentum,
        weight_decay=task.weight_decay,
        schedule="multistep",
        milestones=task.milestones,
        gamma=task.gamma,
        warmup_epochs=task.warmup_epochs,
    )
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
            for group in opt.param_groups:
                group["lr"] = lr_at(recipe, epoch + i / steps)
            rows = mine[i * per_rank : (i + 1) * per_rank]
            loss = F.cross_entropy(model(x[rows]), y[rows])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
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


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX
