"""The job of :mod:`benchmarks.vs_torchft`, run by either system: the same network (``Net`` of
examples/train_digits_plain.py, the example without mpicrossbow), the same digits tensors (written by the
harness), batch 16 per worker, SGD at 0.05 with momentum 0.9, a gradient average every step — and one worker
SIGKILLing itself after its step ``KILL_STEP``. ``SLEEP`` seconds after every step stand for a heavier model's
compute (the runs with a kill use it, so that a restarted or replacement process has a run left to join).

    python -m benchmarks.ft_job torchft DATA OUT REPLICA STEPS KILL_STEP STORE_PORT SLEEP   (torchft's venv)
    mpiexec --with-ft ulfm -n 3 python -m benchmarks.ft_job mpicrossbow DATA OUT -1 STEPS KILL_STEP 0 SLEEP R

**torchft** (0.2.0), one process per replica group, structured as its README's loop: a ``Manager`` over a
``ProcessGroupGloo`` (its lighthouse at ``TORCHFT_LIGHTHOUSE``, ``min_replica_size=1``, its default timeouts),
the optimizer in its ``OptimizerWrapper`` (``zero_grad`` starts the quorum, ``step`` commits when
``should_commit``), each gradient averaged by ``manager.allreduce(grad).wait()`` — not torchft's
``DistributedDataParallel``, whose communication hook crashed the survivors after a peer's loss (issue 52).
Worker ``REPLICA`` reads the ``REPLICA``-th third of the batches; it stops when the quorum's step reaches
``STEPS``. A restarted replica heals from a peer (torchft's HTTP checkpoint transport) and goes on from the
quorum's step.

**mpicrossbow**, your own loop: ``xb.init(elastic=...)`` under ``mpiexec --with-ft ulfm``, ``xb.shard``,
``xb.distribute(rule="BSP")``, ``xb.epochs``; ``R`` (``true``) adds ``replace=True``: the survivors
start a replacement that heals from a peer. It runs whole epochs, as many as ``STEPS`` steps fill
(:mod:`benchmarks.vs_torchft` picks a ``STEPS`` of whole epochs).

Every worker writes ``OUT.<id>.json``: each optimizer step's end (``time.time()``), whether it committed, the
world it saw (participants), and the test accuracy at the end (a restarted or replacement worker writes its
own file, ``<id>`` suffixed). torchft's environment needs no MPI: torch, torchft, and the plain example's
numpy and h5py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.train_digits_plain import Net  # noqa: E402  (the plain script's network: no mpicrossbow)

#: Per-worker batch size, learning rate and momentum (the example's defaults at batch 16).
BATCH, LR, MOMENTUM = 16, 0.05, 0.9


@torch.no_grad()
def accuracy(model: nn.Module, data: dict[str, torch.Tensor]) -> float:
    """Test accuracy on the held-out digits."""
    model.eval()
    right = (model(data["val_x"]).argmax(1) == data["val_y"]).sum().item()
    model.train()
    return right / len(data["val_y"])


def batches(
    data: dict[str, torch.Tensor], part: int, parts: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``part``'s batch of global step ``step``: its ``parts``-th of the training set, reshuffled
    every pass (seeded by the pass), so that a restarted worker reads what the lost one would have."""
    n = len(data["train_y"]) // parts
    per_pass = n // BATCH
    generator = torch.Generator().manual_seed(step // per_pass)
    order = torch.randperm(n, generator=generator) + part * n
    rows = order[(step % per_pass) * BATCH : (step % per_pass + 1) * BATCH]
    return data["train_x"][rows], data["train_y"][rows]


def killed(out: Path) -> bool:
    """Whether a worker of this run has killed itself already (a marker beside ``out``, made now if not): a
    restarted or replacement worker, which reaches the same step again, never kills itself."""
    marker = out.with_name("killed")
    if marker.exists():
        return True
    marker.write_text(str(os.getpid()), encoding="utf-8")
    return False


def write(out: Path, record: dict[str, Any]) -> None:
    """The worker's record, written whole (a rename), so the harness never reads half a file."""
    part = out.with_suffix(".part")
    part.write_text(json.dumps(record), encoding="utf-8")
    part.replace(out)


def torchft_worker(
    data: dict[str, torch.Tensor], out: Path, replica: int, steps: int, kill: int, port: int, sleep: float
) -> None:
    """One replica group of one process under torchft's Manager (module docstring)."""
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the group's own store
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        replica_id=f"replica{replica}",
    )
    optimizer = Optimizer(manager, inner)
    ends: list[tuple[float, bool, int]] = []
    while manager.current_step() < steps:
        optimizer.zero_grad()
        x, y = batches(data, replica, 3, manager.current_step())
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()
        committed = manager.should_commit()
        if committed:
            inner.step()
        time.sleep(sleep)
        ends.append((time.time(), committed, manager.num_participants()))
        if kill and manager.current_step() == kill and not killed(out):
            os.kill(os.getpid(), signal.SIGKILL)
    write(out, {"ends": ends, "accuracy": accuracy(model, data), "step": manager.current_step()})
    manager.shutdown()
    del store


def mpicrossbow_worker(
    data: dict[str, torch.Tensor], out: Path, steps: int, kill: int, sleep: float, replace: bool
) -> None:
    """One rank of your own loop under ``xb.init(elastic=...)`` (module docstring)."""
    import mpicrossbow as xb

    world = xb.init(elastic={"replace": True} if replace else True)
    torch.manual_seed(0)
    train = torch.utils.data.TensorDataset(data["train_x"], data["train_y"])
    loader = xb.shard(train, BATCH, 0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer = xb.distribute(model, optimizer, rule="BSP")
    me, done, ends = world.rank, 0, []
    epochs = -(-steps // len(loader))
    for _ in xb.epochs(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            time.sleep(sleep)
            done += 1
            ends.append((time.time(), True, xb.init().size))
            if me == 2 and done == kill and not killed(out):
                os.kill(os.getpid(), signal.SIGKILL)
    size = xb.allreduce(1, op="sum")
    xb.finish()
    name = out.with_name(f"{out.name}.{xb.init().rank}.{os.getpid()}.json")
    write(name, {"ends": ends, "accuracy": accuracy(model, data), "size": size})


def main() -> None:
    system, data_file, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    replica, steps, kill, port = (int(a) for a in sys.argv[4:8])
    sleep = float(sys.argv[8])
    data = torch.load(data_file, weights_only=True)
    if system == "torchft":
        mine = out.with_name(f"{out.name}.{replica}.{os.getpid()}.json")
        torchft_worker(data, mine, replica, steps, kill, port, sleep)
    else:
        mpicrossbow_worker(data, out, steps, kill, sleep, len(sys.argv) > 9 and sys.argv[9] == "true")


if __name__ == "__main__":
    main()
