"""The embedded API's parts without MPI: the example's diff, xb.shard's batches, the hooks around a user's
optimizer and the checks on a user's model (the API under mpiexec: tests/test_embedded_mpi.py)."""

from __future__ import annotations

import difflib
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpicrossbow as xb
from conftest import REPO
from data.digits import digits_dataset
from mpicrossbow.data.loader import LoaderData, LoaderOptions
from mpicrossbow.embed import api
from mpicrossbow.embed.loop_position import LoopPosition
from mpicrossbow.embed.own_model import OwnModel
from mpicrossbow.embed.sharded_loader import Part, ShardedLoader
from mpicrossbow.embed.step_hooks import StepHooks
from mpicrossbow.errors import ContractError, DataError, UsageError
from mpicrossbow.launch.world import World
from mpicrossbow.model.shard import Shard
from mpicrossbow.rules.base import Rule
from mpicrossbow.training.run.window import Unguarded


def test_the_example_adds_at_most_nine_lines_to_the_plain_script() -> None:
    """examples/train_digits.py is examples/train_digits_plain.py plus at most 9 lines (and fewer removed):
    the eight of a distributed job and the epoch loop as ``xb.epochs``, where an elastic job's replacement
    rank goes on."""
    plain = (REPO / "examples" / "train_digits_plain.py").read_text().splitlines()
    mpi = (REPO / "examples" / "train_digits.py").read_text().splitlines()
    diff = [
        line for line in difflib.unified_diff(plain, mpi, lineterm="", n=0) if line[:3] not in ("---", "+++")
    ]
    added = [line for line in diff if line.startswith("+")]
    removed = [line for line in diff if line.startswith("-")]
    assert 0 < len(added) <= 9 and len(removed) <= len(added), "\n".join(diff)
    moved = {line.strip() for line in plain}  # a plain line indented into a ``with xb.consensus`` block
    new = [line for line in added if line[1:].strip() not in moved]
    assert all("xb" in line or "--rule" in line for line in new), new


def test_the_docs_show_the_examples_real_diff() -> None:
    """docs/embedded.md's diff block is the diff between the two example scripts, line for line."""
    plain = (REPO / "examples" / "train_digits_plain.py").read_text().splitlines()
    mpi = (REPO / "examples" / "train_digits.py").read_text().splitlines()
    diff = [line for line in difflib.unified_diff(plain, mpi, lineterm="", n=0) if line[:1] in "+-"]
    docs = (REPO / "docs" / "embedded.md").read_text()
    block = docs.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    assert block == [line for line in diff if line[:3] not in ("---", "+++")]


@pytest.fixture(scope="module")
def digits() -> tuple[object, object]:
    return digits_dataset("train"), digits_dataset("val")


def test_shard_gives_crossbow_launchs_batches(digits: tuple[object, object]) -> None:
    """Rank 1 of 2: the same batches, epoch after epoch, as crossbow-launch's pipeline; a new order each
    epoch without set_epoch; set_epoch goes back."""
    train, val = digits
    loader = ShardedLoader(train, 16, 5, lambda: Part(1, 2), LoaderOptions())
    reference = LoaderData(train, val, Shard(1, 2, 16, 5), LoaderOptions())
    assert len(loader) == reference.n_batch_train == len(train) // 2 // 16
    epochs = []
    for epoch in range(2):
        mine = list(loader)
        theirs = list(reference.train_batches(epoch))
        assert len(mine) == len(theirs)
        assert all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(mine, theirs, strict=True)
        )
        epochs.append(mine)
    assert not torch.equal(epochs[0][0][1], epochs[1][0][1]), "the second epoch repeated the first's order"
    loader.set_epoch(0)
    assert torch.equal(next(iter(loader))[1], epochs[0][0][1])


def test_a_replacement_goes_on_at_the_survivors_epoch_and_batch(digits: tuple[object, object]) -> None:
    """A survivor's loop position after a step mid-epoch (``xb.epochs`` index, the loader's epoch and next
    batch) makes a replacement's ``xb.epochs`` start at the same epoch and its loader yield the same batches
    the survivor reads next (its own part's, as the lost rank would have: here the same part); outside an
    ``xb.epochs`` loop and at an epoch's last batch no replacement can join (None); a second loop starts at
    its first epoch."""
    train, _ = digits
    survivor, joined = LoopPosition(), LoopPosition()
    loader = ShardedLoader(train, 16, 5, lambda: Part(1, 2), LoaderOptions())
    survivor.add(loader)
    survivor.parts = 2
    assert survivor.where(3) is None  # no xb.epochs loop
    rest: list[Any] = []
    for epoch in survivor.epochs((1, 4)):
        batches = iter(loader)
        if epoch == 2:
            for _ in range(5):
                next(batches)
            position = survivor.where(7)
            rest = list(batches)
            assert survivor.where(8) is None  # the epoch's last batch: its end follows
            break
        list(batches)
    assert survivor.epoch_index is None  # the loop is over
    assert position == {"step": 7, "epoch_index": 1, "loaders": [(1, 5)], "parts": 2}
    joined.joining = position
    theirs = ShardedLoader(train, 16, 5, lambda: Part(1, 2), LoaderOptions())
    joined.add(theirs)
    assert list(joined.epochs((1, 4))) == [2, 3]
    mine = list(theirs)
    assert len(mine) == len(rest) and all(torch.equal(a[1], b[1]) for a, b in zip(mine, rest, strict=True))
    assert list(joined.epochs((0, 2))) == [0, 1]


def test_shard_parts_cover_distinct_samples_and_a_server_reads_none(digits: tuple[object, object]) -> None:
    train, _ = digits
    firsts = [ShardedLoader(train, 8, 0, lambda r=r: Part(r, 3), LoaderOptions()) for r in range(3)]
    seen = [set(i for batch in loader._cut() for i, _ in batch) for loader in firsts]
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])
    server = ShardedLoader(train, 8, 0, lambda: Part(0, 3, trains=False), LoaderOptions())
    assert len(server) == 0 and list(server) == []


def test_shard_refuses_what_it_cannot_serve(digits: tuple[object, object]) -> None:
    train, _ = digits
    with pytest.raises(UsageError, match="batch_size must be at least 1"):
        ShardedLoader(train, 0, 0, lambda: Part(0, 1), LoaderOptions())
    with pytest.raises(UsageError, match="map-style"):
        ShardedLoader(iter(range(3)), 4, 0, lambda: Part(0, 1), LoaderOptions())
    with pytest.raises(DataError, match="fewer than one batch"):
        len(ShardedLoader(train, 4000, 0, lambda: Part(0, 1), LoaderOptions()))
    used = ShardedLoader(train, 8, 0, lambda: Part(0, 2), LoaderOptions())
    len(used)
    used.check_part(Part(0, 2))
    with pytest.raises(UsageError, match=r"call xb\.distribute first"):
        used.check_part(Part(0, 1))


class Recorder(Rule):
    """A rule that records when its hooks run, with the first weight as the optimizer left it."""

    def __init__(self, own: OwnModel) -> None:
        super().__init__()
        self.own, self.calls = own, []

    def on_gradients(self, step: int) -> None:
        self.calls.append(("on_gradients", step, float(self.own.learner.params[0])))

    def exchange(self, step: int) -> None:
        self.calls.append(("exchange", step, float(self.own.learner.params[0])))

    def on_lr_change(self, old: float, new: float) -> None:
        self.calls.append(("lr", old, new))

    def on_pause(self) -> None:
        self.calls.append(("pause", 0, 0.0))


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_hooks_run_the_rule_around_the_users_step_in_crossbow_launchs_order() -> None:
    """on_gradients before the update, exchange after it, the step counted; an evaluation pass is a pause
    between steps; a lowered rate is reported at the next training forward pass; remove() gives the
    optimizer back."""
    model, optimizer = model_and_optimizer()
    own = OwnModel(model, optimizer, lambda: None)
    rule = Recorder(own)
    hooks = StepHooks(own, rule)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    before = float(own.learner.params[0])
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert [c[:2] for c in rule.calls] == [
        ("on_gradients", 0),
        ("exchange", 0),
        ("on_gradients", 1),
        ("exchange", 1),
    ]
    assert rule.calls[0][2] == before != rule.calls[1][2], (
        "on_gradients must see the weights before the update"
    )
    scheduler.step()
    model.eval()
    model(x)
    assert rule.calls[-1][0] == "pause", "an evaluation pass reported the rate, or was not a pause"
    model.train()
    model(x)
    assert rule.calls[-1] == ("lr", 0.1, 0.05)
    assert hooks.step == 2 and own.n_batch_train == 1
    hooks.remove()
    optimizer.step()
    assert len(rule.calls) == 6, "a hook outlived remove()"
    own.learner.release()
    assert "zero_grad" not in vars(optimizer)


class SkipsStep(Unguarded):
    """A window whose step ``idle`` does not train (elastic healing: it met the loss, or a rank behind
    skips it)."""

    def __init__(self, idle: int) -> None:
        self.idle, self.now = idle, -1

    def begin(self, step: int) -> None:
        self.now = step

    def trains(self) -> bool:
        return self.now != self.idle


def test_a_step_the_window_does_not_train_leaves_the_users_model_and_optimizer_as_they_were() -> None:
    """The user's own ``optimizer.step()`` in a step that does not train (SGD with momentum and weight
    decay, which would move every weight even at a zero gradient) changes neither the weights nor the
    momentum, and hands the gradients back as they were (the same tensors, views of the flat buffer); the
    next step trains as usual."""
    model, _ = model_and_optimizer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    own = OwnModel(model, optimizer, lambda: None)
    hooks = StepHooks(own, Recorder(own), window=SkipsStep(idle=1))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    seen = []
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        optimizer.step()
        assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
        momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        seen.append((own.learner.params.clone(), momentum))
    (w0, m0), (w1, m1), (w2, _) = seen
    assert torch.equal(w1, w0) and all(torch.equal(a, b) for a, b in zip(m1, m0, strict=True))
    assert not torch.equal(w2, w1)
    hooks.remove()
    own.learner.release()


def test_the_users_tensors_live_in_the_flat_buffers() -> None:
    """Parameters, gradients and BatchNorm statistics are views of the flat buffers the rule exchanges;
    gradients autograd put elsewhere (module.zero_grad()) come back into them."""
    model, optimizer = model_and_optimizer()
    own = OwnModel(model, optimizer, lambda: 7)
    learner = own.learner
    learner.params.fill_(0.5)
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    model.train()
    model(torch.randn(8, 4))
    assert learner.buffers.abs().sum() > 0 and learner.buffers.numel() == 6  # running mean and variance
    model.zero_grad()  # sets every .grad to None
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    fresh = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert not torch.equal(learner.grads, fresh)
    learner.gather_grads()
    assert torch.equal(learner.grads, fresh)
    assert [(o, n) for o, n in own.grad_layout()][-1][
        0
    ] + 2 == learner.params.numel() and own.n_batch_train == 7


def test_models_the_rule_cannot_exchange_are_refused() -> None:
    model, optimizer = model_and_optimizer()
    with pytest.raises(ContractError, match="not trainable parameters"):
        OwnModel(model, torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), lambda: None)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ContractError, match="no trainable parameters"):
        OwnModel(frozen, optimizer, lambda: None)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ContractError, match="one dtype and device"):
        OwnModel(mixed, torch.optim.SGD(mixed.parameters(), lr=0.1), lambda: None)
    with pytest.raises(ContractError, match=r"torch\.optim\.Optimizer"):
        OwnModel(model, "sgd", lambda: None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ xb.init: first, once, its arguments named
def fake_world(rank: int = 0, size: int = 1) -> World:
    """A World as xb.init leaves it, without starting MPI."""
    return World(rank, size, rank, size, 0, 1, "node1", None, device=torch.device("cpu"))


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> api._Process:
    """The embedded API's process state as a script finds it before xb.init (put back afterwards)."""
    state = api._Process()
    monkeypatch.setattr(api, "_state", state)
    return state


def test_the_api_before_xb_init_is_an_error_that_says_to_call_it(fresh_process: api._Process) -> None:
    """No implicit start (it used to fix the device behind the user's back, and a later
    ``xb.init(devices=...)`` was ignored): every call that needs the world says to call xb.init first."""
    model, optimizer = model_and_optimizer()
    data = torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8))
    calls = {
        "xb.shard": lambda: xb.shard(data, 4),
        "xb.distribute": lambda: xb.distribute(model, optimizer, rule="SMA"),
        "xb.finish": xb.finish,
        "xb.consensus": lambda: xb.consensus(model).__enter__(),
        "xb.checkpoint": lambda: xb.checkpoint("folder"),
        "xb.restore": lambda: xb.restore("folder"),
        "xb.noise_scale": xb.noise_scale,
    }
    for what, call in calls.items():
        with pytest.raises(UsageError) as caught:
            call()
        assert str(caught.value) == (
            f"{what} before xb.init(): call xb.init(...) first, on every rank (it joins the MPI world and "
            "picks this rank's device)"
        )
    assert fresh_process.world is None and fresh_process.job is None, "a call started the world after all"
    assert "zero_grad" not in vars(optimizer), "xb.distribute hooked the optimizer before refusing"


def test_a_second_xb_init_returns_the_world_or_refuses_to_change_it(
    fresh_process: api._Process, capsys: pytest.CaptureFixture[str]
) -> None:
    """Asking for nothing new (the same arguments, or defaults) returns the same World; an argument that
    differs from the first call's is one line naming both values and status 2, never silently ignored (one
    rank here; under mpiexec: tests/test_embedded_mpi.py)."""
    world = fresh_process.world = fake_world()
    fresh_process.init_args = {
        "devices": "cpu",
        "bind": "none",
        "comm": {},
        "log_level": "info",
        "threads": False,
    }
    assert xb.init() is world
    assert xb.init("cpu") is world and xb.init(devices="cpu", bind="none", comm={}) is world

    def refused(**kwargs: object) -> str:
        with pytest.raises(SystemExit) as caught:
            xb.init(**kwargs)
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(api.PREFIX), err
        fresh_process.failed = False
        return err[len(api.PREFIX) :].rstrip("\n")

    assert refused(devices="cuda1") == (
        "xb.init(devices='cuda1'): xb.init already ran in this process with devices='cpu', and MPI, the "
        "device and the binding are chosen once: pass every argument to the first xb.init call (xb.init() "
        "without arguments returns the same world)"
    )
    said = refused(bind="core", threads=True)
    assert re.match(r"^xb\.init\(bind='core', threads=True\): .* with bind='none', ", said)
    said = refused(comm={"backend": "gloo"})
    assert re.match(r"^xb\.init\(comm=\{'backend': 'gloo'\}\): .* with comm=\{\}, ", said)
    fresh_process.init_args = {**fresh_process.init_args, "devices": None}  # the first call chose nothing
    assert re.match(r"^xb\.init\(devices='cpu'\): .* with devices=None, ", refused(devices="cpu"))


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        ("gpu0", "xb.init(devices='gpu0'): unknown device 'gpu0'; valid forms: cudaN, cpu, cpuN"),
        (
            "cpu0,cpu1,cpu2",
            "xb.init(devices='cpu0,cpu1,cpu2') lists 3 device(s) (cpu0,cpu1,cpu2) but the job",
        ),
        ("far:cpu0,cpu1", "xb.init(devices='far:cpu0,cpu1'): rank 1 is on host "),
        (" ", "xb.init(devices=' '): the list is empty; give one device per rank, e.g. devices=cpu0,cpu1"),
        ("cuda9,cuda9", "xb.init(devices='cuda9,cuda9')"),  # no CUDA here, or no 10 GPUs
    ],
)
def test_a_bad_devices_argument_names_the_argument_not_the_cfg_key(devices: str, words: str) -> None:
    """xb.init reads no cfg: its device checks (crossbow-launch's DEVICES checks) name ``devices=``."""
    with pytest.raises(UsageError) as caught:
        api.choose_device(devices, fake_world(rank=1, size=2))
    assert str(caught.value).startswith(words) and "DEVICES" not in str(caught.value), str(caught.value)
    assert api.choose_device("cpu0,cpu1", fake_world(rank=1, size=2)) == torch.device("cpu")
