"""The embedded API (``import mpicrossbow as xb``) under any number of ranks, including a plain process.

    mpiexec -n N python tests/mpi_scripts/embedded_checks.py DIR        (or python ... DIR: one process)

``EMBEDDED_DEVICES`` (default ``cpu``) is ``xb.init``'s DEVICES list: ``cuda0`` runs the checks on a GPU.

Every rank runs each check (tests/mpi_scripts/verdicts.py prints ``CHECK embedded.<name> OK|SKIP|FAIL``).
The checks use one small network on the digits and each distributes it anew, so they also show that a
finished job can be followed by another in the same process.
"""

from __future__ import annotations

import os
import sys
import unittest
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from verdicts import WORLD, finish, run_checks, run_main

import mpicrossbow as xb
from data.digits import digits_dataset
from mpicrossbow.config.sections import CommSection
from mpicrossbow.embed import api
from mpicrossbow.errors import DataError, UsageError

LR = 0.05
TRAIN = digits_dataset("train")
#: This rank's device (``xb.init``'s choice from ``EMBEDDED_DEVICES``).
DEVICE = torch.device("cpu")


def network(norm: bool = False, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP (with BatchNorm when ``norm``) and its SGD with momentum; rank-dependent initial weights
    unless the rule's broadcast makes them rank 0's."""
    torch.manual_seed(seed + 101 * WORLD.rank)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(64, 32)]
    layers += [nn.BatchNorm1d(32)] if norm else []
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(32, 10)).to(DEVICE)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def flat(model: nn.Module) -> torch.Tensor:
    """The model's parameters, one vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step the way a user's loop takes it."""
    model.train()
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def same_everywhere(t: torch.Tensor, what: str) -> None:
    """Every rank holds bitwise the same ``t``."""
    mine = t.numpy().tobytes()
    for rank, theirs in enumerate(WORLD.allgather(mine)):
        if theirs != mine:
            raise AssertionError(f"{what}: rank {rank} differs from rank {WORLD.rank}")


def batches(count: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of this rank's part (xb.shard's order for epoch 0), loaded once."""
    loader = xb.shard(TRAIN, size, seed=3)
    taken = []
    for x, y in loader:
        taken.append((x.to(DEVICE), y.to(DEVICE)))
        if len(taken) == count:
            break
    return taken


def check_bsp_is_the_global_batch() -> None:
    """BSP over n ranks of batch b is SGD on the n·b samples of all ranks together (1 rank: bitwise)."""
    data = batches(5)
    model, optimizer = network()
    model, optimizer = xb.distribute(model, optimizer, rule="BSP")
    reference, ref_optimizer = network(seed=99)
    reference.load_state_dict(model.state_dict())
    for x, y in data:
        step(model, optimizer, x, y)
        xs, ys = zip(*WORLD.allgather((x, y)), strict=True)
        step(reference, ref_optimizer, torch.cat(xs), torch.cat(ys))
    xb.finish()
    if WORLD.size == 1:
        assert torch.equal(flat(model), flat(reference)), "1 rank: BSP differs from the plain loop"
    else:
        assert torch.allclose(flat(model), flat(reference), atol=1e-5), "BSP is not the global batch"
    same_everywhere(flat(model), "BSP weights")


def check_zero_grad_to_none_changes_nothing() -> None:
    """``module.zero_grad()`` (gradients set to None) trains exactly as ``optimizer.zero_grad()``, also
    with BSP's gradient buckets (a communicator that overlaps)."""
    data = batches(4)
    saved = api._state.comm
    api._state.comm = CommSection(shared_memory="off", backend="mpi")  # MPICommunicator: buckets on
    try:
        results = []
        for to_none in (False, True):
            model, optimizer = xb.distribute(*network(), rule="BSP bucket_mb=0.0005")
            for x, y in data:
                model.train()
                (model.zero_grad if to_none else optimizer.zero_grad)()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            xb.finish()
            results.append(flat(model))
    finally:
        api._state.comm = saved
    assert torch.equal(results[0], results[1]), "gradients set to None changed the training"


def check_consensus_shows_z_then_the_replica() -> None:
    """SMA: inside ``xb.consensus`` the model holds z (the same on every rank), afterwards its replica."""
    model, optimizer = xb.distribute(*network(norm=True), rule="SMA")
    for x, y in batches(3):
        step(model, optimizer, x, y)
    own = flat(model)
    rule = api._state.job.rule
    with xb.consensus(model) as inside:
        assert inside is model
        z = flat(model)
        assert torch.equal(z, rule.z.cpu()), "the block does not show z"
    assert torch.equal(flat(model), own), "the replica did not come back after the block"
    same_everywhere(z, "z")
    xb.finish()
    assert torch.equal(flat(model), z), "after xb.finish() the model does not hold z"


def check_lr_step_down_resets_sma_replicas() -> None:
    """SMA restarts every replica from z when the user's scheduler lowers the rate, before the next forward
    pass (as crossbow-launch does before the step)."""
    model, optimizer = xb.distribute(*network(), rule="SMA")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = batches(4)
    for x, y in data[:3]:
        step(model, optimizer, x, y)
    scheduler.step()
    model.train()
    model(data[3][0])  # the forward pass that sees the new rate
    with xb.consensus(model):
        z = flat(model)
    assert torch.equal(flat(model), z), "the replica was not reset to z after the rate stepped down"
    xb.finish()


def check_checkpoint_then_restore_continues_bitwise(folder: Path) -> None:
    """xb.checkpoint + the user's state_dicts, then a new job restored from them: the same next steps."""
    data = batches(6)
    model, optimizer = xb.distribute(*network(), rule="SMA")
    for x, y in data[:3]:
        step(model, optimizer, x, y)
    xb.checkpoint(folder / "rule")
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, folder / f"own{WORLD.rank}.pt")
    for x, y in data[3:]:
        step(model, optimizer, x, y)
    xb.finish()
    assert api._state.job is not None  # the job's last line names the folder xb.checkpoint wrote
    assert api._state.job.wrote() == f"wrote checkpoint {folder / 'rule'}; the model is yours to save"
    first = flat(model)
    model, optimizer = xb.distribute(*network(seed=7), rule="SMA")
    own = torch.load(folder / f"own{WORLD.rank}.pt", weights_only=True)
    model.load_state_dict(own["model"])
    optimizer.load_state_dict(own["optim"])
    xb.restore(folder / "rule")
    for x, y in data[3:]:
        step(model, optimizer, x, y)
    xb.finish()
    assert torch.equal(flat(model), first), "the restored run took other steps"


def check_usage_errors() -> None:
    """One clear UsageError for each misuse the API can see."""
    xb.distribute(*network(), rule="SMA")
    expect(UsageError, "not the model", lambda: xb.consensus(nn.Linear(2, 2)).__enter__())
    expect(UsageError, "already distributed", lambda: xb.distribute(*network(), rule="BSP"))
    xb.finish()
    expect(UsageError, "after xb.finish", lambda: xb.checkpoint("unused"))
    xb.finish()  # twice: nothing to do


def check_bad_rule_ends_every_rank_with_status_2() -> None:
    """A rule name the registry does not know, or a setting without a value: status 2 on every rank."""
    for spec in ("NOPE", "EASGD tau"):
        try:
            xb.distribute(*network(), rule=spec)
        except SystemExit as exc:
            assert exc.code == 2, exc.code
        else:
            raise AssertionError(f"rule={spec!r} was accepted")


def check_server_rank_serves_and_reads_nothing() -> None:
    """ASGD: rank 0 serves inside xb.distribute and gets no batches; the workers train an epoch; after
    xb.finish() every rank holds the server's final w."""
    if WORLD.size < 2:
        raise unittest.SkipTest("a parameter server needs 2 ranks")
    loader = xb.shard(TRAIN, 32, seed=3)
    model, optimizer = xb.distribute(*network(), rule="ASGD")
    assert xb.trains() == (WORLD.rank != 0)
    assert (len(loader) == 0) == (WORLD.rank == 0), len(loader)
    for x, y in loader:
        step(model, optimizer, x, y)
    xb.finish()
    same_everywhere(flat(model), "the served model")


def check_gossip_with_unequal_steps_ends_in_one_model() -> None:
    """GOSGD: ranks take different numbers of steps (no barrier between them); xb.finish() drains the
    messages in flight and leaves the same weighted mean everywhere."""
    if WORLD.size < 2:
        raise unittest.SkipTest("gossip needs 2 ranks")
    model, optimizer = xb.distribute(*network(), rule="GOSGD p=0.5")
    for x, y in batches(3 + 2 * WORLD.rank):
        step(model, optimizer, x, y)
    xb.finish()
    same_everywhere(flat(model), "the gossip mean")


def check_allreduce_numbers_and_tensors() -> None:
    """xb.allreduce (Horovod's hvd.allreduce): numbers and tensors, mean/sum/max/min, the input's kind and
    dtype kept; over the workers only while a parameter server serves (issue 51)."""
    n, r = WORLD.size, WORLD.rank
    assert xb.allreduce(float(r)) == sum(range(n)) / n
    assert xb.allreduce(r + 1, op="sum") == n * (n + 1) // 2 and isinstance(xb.allreduce(r, op="sum"), int)
    assert xb.allreduce(r, op="max") == n - 1 and xb.allreduce(r, op="min") == 0
    t = torch.tensor([r, 2.0 * r], dtype=torch.bfloat16, device=DEVICE)
    got, total = xb.allreduce(t, op="sum"), sum(range(n))
    assert got.dtype == torch.bfloat16 and got.device == t.device and got.tolist() == [total, 2 * total]
    assert t.tolist() == [r, 2.0 * r], "xb.allreduce changed its input"
    mean = xb.allreduce(torch.tensor([r, r + 1]))  # integers: the mean is a float tensor
    assert mean.dtype == torch.float32 and mean.tolist() == [(n - 1) / 2, (n + 1) / 2]
    expect(UsageError, "op='avg': choose one of", lambda: xb.allreduce(1.0, op="avg"))
    if n >= 2:  # ASGD: rank 0 serves inside distribute; the workers' allreduce is theirs alone
        xb.distribute(*network(), rule="ASGD")
        if xb.trains():
            assert xb.allreduce(1, op="sum") == n - 1
        xb.finish()
        assert xb.allreduce(1, op="sum") == n  # the job is over: every rank again


def check_evaluation_shards_keep_every_sample() -> None:
    """xb.shard(..., evaluation=True): every sample once over the ranks, shares within one sample of each
    other, the last batch short, samples = the rank's own count; training shares are equal on every rank
    (no join needed for uneven inputs) and drop only the last partial batch."""
    val = digits_dataset("val")
    loader = xb.shard(val, 16, evaluation=True)
    seen = torch.cat([y for _, y in loader])
    assert len(seen) == loader.samples
    counts = WORLD.allgather(loader.samples)
    assert sum(counts) == len(val) and max(counts) - min(counts) <= 1, counts
    assert len(loader) == -(-loader.samples // 16)
    mine = torch.cat([x for x, _ in loader]).reshape(-1, 64)
    every = torch.cat([torch.from_numpy(m) for m in WORLD.allgather(mine.numpy())])
    assert torch.equal(every, val.x.reshape(-1, 64)), "the shares, in rank order, are not the set in order"
    train = xb.shard(TRAIN, 32, seed=3)
    steps = WORLD.allgather(len(train))
    assert len(set(steps)) == 1 and train.samples == 32 * steps[0] == 32 * (len(TRAIN) // WORLD.size // 32)
    expect(DataError, "evaluation=True", lambda: xb.shard(val, len(val) // WORLD.size + 1))


def check_distribute_broadcasts_the_optimizer_state_and_scales_lr() -> None:
    """xb.distribute: every rank takes rank 0's optimizer state (Horovod's broadcast_optimizer_state) and
    lr_scaling='linear' multiplies the rate by the training ranks, capped by lr_cap."""
    model, optimizer = network(seed=5)
    x, y = batches(1)[0]
    step(model, optimizer, x, y)  # a momentum buffer that differs by rank
    model, optimizer = xb.distribute(model, optimizer, rule="BSP", lr_scaling="linear", lr_cap=LR * 1.5)
    buffers = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    same_everywhere(buffers.cpu(), "the momentum buffers")
    assert optimizer.param_groups[0]["lr"] == min(LR * WORLD.size, LR * 1.5)
    xb.finish()
    expect(SystemExit, "2", lambda: xb.distribute(*network(), rule="BSP", lr_scaling="cubic"))
    # model averaging: every learner steps on its own batch, so a scaled rate needs its cap (issue 51)
    expect(SystemExit, "2", lambda: xb.distribute(*network(), rule="SMA", lr_scaling="linear"))


def expect(kind: type[BaseException], words: str, call: Callable[[], object]) -> None:
    """``call()`` raises ``kind`` with ``words`` in its message."""
    try:
        call()
    except kind as exc:
        assert words in str(exc), str(exc)
    else:
        raise AssertionError(f"no {kind.__name__} ({words})")


def check_the_compiler_was_never_imported() -> None:
    """Every check above built and stepped torch optimizers; none compiled, so none imported the compiler
    (mpicrossbow.dynamo_on_demand: about a second of every rank's start)."""
    assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"


def main() -> int:
    folder = Path(sys.argv[1])
    global DEVICE
    DEVICE = xb.init(devices=os.environ.get("EMBEDDED_DEVICES", "cpu")).device
    checks = [
        ("bsp_is_the_global_batch", check_bsp_is_the_global_batch),
        ("zero_grad_to_none_changes_nothing", check_zero_grad_to_none_changes_nothing),
        ("consensus_shows_z_then_the_replica", check_consensus_shows_z_then_the_replica),
        ("lr_step_down_resets_sma_replicas", check_lr_step_down_resets_sma_replicas),
        ("checkpoint_restore", lambda: check_checkpoint_then_restore_continues_bitwise(folder)),
        ("usage_errors", check_usage_errors),
        ("bad_rule_status_2", check_bad_rule_ends_every_rank_with_status_2),
        ("server_rank_serves", check_server_rank_serves_and_reads_nothing),
        ("gossip_unequal_steps", check_gossip_with_unequal_steps_ends_in_one_model),
        ("allreduce", check_allreduce_numbers_and_tensors),
        ("evaluation_shards", check_evaluation_shards_keep_every_sample),
        ("optimizer_state_and_lr", check_distribute_broadcasts_the_optimizer_state_and_scales_lr),
        ("compiler_never_imported", check_the_compiler_was_never_imported),
    ]
    return finish(run_checks("embedded", checks))


if __name__ == "__main__":
    run_main(main)
