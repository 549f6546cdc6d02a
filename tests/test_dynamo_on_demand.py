"""torch's optimizers import the compiler only when the process compiles (mpicrossbow.dynamo_on_demand).

The whole path runs in a fresh interpreter (this test process imported ``torch._dynamo`` long ago): torch's
own optimizers train with the stand-ins without importing it, then train again, from the same seed, after
it is imported (torch's own wrappers), and under ``torch.compile``: every result is the same. The stand-ins'
hand-over is checked in process on an optimizer module made for the test, so torch's classes here stay
as they are.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from conftest import REPO
from mpicrossbow.dynamo_on_demand import CACHE_ATTR, spare_dynamo

#: Trains a linear model with four of torch's optimizers and a schedule; prints what it saw, as JSON.
TRAIN = """
import json, sys, torch
from mpicrossbow.dynamo_on_demand import spare_dynamo

given, again = spare_dynamo(), spare_dynamo()

def train(compiled=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    forward = torch.compile(model, backend="eager") if compiled else model
    sums = []
    for cls, keywords in ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {}),
                          (torch.optim.AdamW, {"foreach": False}), (torch.optim.RMSprop, {})):
        optimizer = cls(model.parameters(), lr=0.1, **keywords)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        step = torch.compile(optimizer.step, backend="eager") if compiled else optimizer.step
        for i in range(3):
            optimizer.zero_grad()
            forward(torch.ones(3, 4) * i).square().sum().backward()
            step()
            schedule.step()
        optimizer.load_state_dict(optimizer.state_dict())
        sums.append(model.weight.sum().item())
    return sums + [torch.is_grad_enabled()]

spared = train()
imported = "torch._dynamo" in sys.modules
import torch._dynamo
print(json.dumps({"given": given, "again": again, "imported": imported, "spared": spared,
                  "torch": train(), "compiled": train(compiled=True)}))
"""


def test_torch_optimizers_train_alike_without_the_compiler_and_with_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["given"] > 4 and seen["again"] == 0  # four steps at least; nothing given twice
    assert seen["imported"] is False, "an optimizer imported torch._dynamo"
    assert seen["spared"] == seen["torch"]  # the very same arithmetic
    assert seen["compiled"] == pytest.approx(seen["torch"], rel=1e-3)  # compiled: its own order of operations
    assert seen["spared"][-1] is True  # grad mode as it was after every step


@pytest.fixture
def optimizers_module() -> Iterator[types.ModuleType]:
    """A module ``fakeoptim`` shaped as torch's optimizer modules: an optimizer whose ``step`` carries torch's
    ``_use_grad_for_differentiable`` and a ``torch._disable_dynamo`` function, in a closure as well."""
    use_grad = sys.modules["torch.optim.optimizer"]._use_grad_for_differentiable
    module = types.ModuleType("fakeoptim")

    class Plain(torch.optim.Optimizer):
        seen: ClassVar[list[bool]] = []

        def __init__(self, params: Any) -> None:
            super().__init__(params, {"differentiable": False})

        @use_grad
        def step(self, closure: Any = None) -> None:
            Plain.seen.append(torch.is_grad_enabled())

    @torch._disable_dynamo
    def decorated(x: int) -> int:
        return x + 1

    def holder(x: int) -> int:
        return inner(x)

    inner = torch._disable_dynamo(lambda x: x * 2)
    module.Plain, module.decorated, module.holder = Plain, decorated, holder
    sys.modules["fakeoptim"] = module
    try:
        yield module
    finally:
        del sys.modules["fakeoptim"]


def test_stand_ins_call_through_until_the_compiler_is_imported_then_hand_over(
    optimizers_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = optimizers_module
    assert spare_dynamo(("fakeoptim",)) == 3  # the step, the decorated function and the one in a closure
    assert spare_dynamo(("fakeoptim",)) == 0
    target = module.decorated.__wrapped__
    stand_in = getattr(target, CACHE_ATTR)
    optimizer = module.Plain([torch.zeros(1, requires_grad=True)])  # torch's own methods: built here
    dynamo = sys.modules.get("torch._dynamo") or __import__("torch._dynamo")
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as a process that never compiled
    optimizer.step()
    assert module.decorated(1) == 2 and module.holder(3) == 6
    assert getattr(target, CACHE_ATTR) is stand_in  # nothing built while the compiler is not there
    assert module.Plain.seen == [False] and torch.is_grad_enabled()
    monkeypatch.setitem(sys.modules, "torch._dynamo", dynamo)  # something compiled: torch's own from now on
    assert module.decorated(1) == 2 and module.holder(3) == 6
    assert getattr(target, CACHE_ATTR) is not stand_in
    optimizer.step()
    assert module.Plain.seen == [False, False]


def test_a_module_without_torchs_decorators_gets_nothing() -> None:
    module = types.ModuleType("plainoptim")
    module.step = lambda: None
    sys.modules["plainoptim"] = module
    try:
        assert spare_dynamo(("plainoptim",)) == 0
    finally:
        del sys.modules["plainoptim"]


def test_a_torch_without_the_decorators_gets_no_stand_ins_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(sys.modules["torch.optim.optimizer"], "_use_grad_for_differentiable")
    assert spare_dynamo() == 0
