"""The ReplicaView contract — what a rule may rely on — bound to every pool engine and to the embedded API's
OwnModel (a user's own model and optimizer under ``xb.distribute``).

Every learner's flat ``params``, ``grads`` and ``buffers`` are its replica's live state; backward writes
the gradients into the flat ``grads``; the gradient layout, where one is reported, tiles the flat
gradient, and a watcher hears of every parameter of every learner once per backward until it stops
watching; there is at least one step per epoch and an optimizer per replica set.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_pool_contract import assert_flat_state_is_live, engine_params, make_pool

from conftest import NormedMLP
from mpicrossbow.embed.own_model import OwnModel
from mpicrossbow.pool.replica_view import ReplicaView

SUBJECTS = [*engine_params(), pytest.param("OWN", id="own-model")]


def subject(name: str) -> tuple[ReplicaView, Callable[[], None]]:
    """``name``'s replicas and a function that runs one forward and backward of every learner."""
    if name != "OWN":
        pool = make_pool(name)
        pool.start_epoch(0)
        return pool, lambda: pool.compute(0)
    torch.manual_seed(0)
    module = NormedMLP(hidden=8).module()
    own = OwnModel(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), lambda: 12)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))

    def backward() -> None:
        module.train()
        own.learner.optimizer.zero_grad()
        F.cross_entropy(module(x), y).backward()

    return own, backward


@pytest.mark.parametrize("name", SUBJECTS)
def test_flat_buffers_are_the_replicas_live_state(name: str) -> None:
    replicas, _ = subject(name)
    assert_flat_state_is_live(replicas)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", SUBJECTS)
def test_backward_writes_into_the_flat_gradients(name: str) -> None:
    replicas, backward = subject(name)
    for learner in replicas.learners:
        learner.grads.zero_()
    backward()
    for learner in replicas.learners:
        assert learner.grads.abs().sum() > 0
    assert replicas.n_batch_train >= 1 and replicas.optimizers


@pytest.mark.parametrize("name", SUBJECTS)
def test_a_watcher_hears_every_gradient_once_per_backward(name: str) -> None:
    replicas, backward = subject(name)
    layout = replicas.grad_layout()
    if layout is None:
        pytest.skip(f"{name} reports no gradients during backward")
    offsets = [offset for offset, _ in layout]
    ends = [offset + numel for offset, numel in layout]
    assert offsets[0] == 0 and offsets[1:] == ends[:-1] and ends[-1] == replicas.learners[0].grads.numel()
    heard: Counter[int] = Counter()
    unwatch = replicas.watch_gradients(lambda i, n: heard.update({i: n}))
    backward()
    assert heard == dict.fromkeys(range(len(layout)), len(replicas.learners))
    unwatch()
    backward()
    assert sum(heard.values()) == len(layout) * len(replicas.learners), "heard after unwatch()"


@pytest.mark.parametrize("name", SUBJECTS)
def test_nonfinite_flags_agree_with_nonfinite_and_zeroing_touches_only_the_flagged(name: str) -> None:
    """The NaN guard's device-side view: the flags (where the replicas keep losses) say what ``nonfinite``
    says, and ``zero_gradients_where`` zeroes exactly the flagged learners' gradients."""
    replicas, backward = subject(name)
    backward()
    flags = replicas.nonfinite_flags()
    if flags is not None:
        assert flags.dtype == torch.bool and flags.tolist() == [
            j in replicas.nonfinite() for j in range(len(replicas.learners))
        ]
    only_last = torch.zeros(len(replicas.learners), dtype=torch.bool)
    only_last[-1] = True
    kept = [learner.grads.clone() for learner in replicas.learners[:-1]]
    replicas.zero_gradients_where(only_last.to(replicas.learners[0].grads.device))
    assert not replicas.learners[-1].grads.any()
    for learner, before in zip(replicas.learners[:-1], kept, strict=True):
        assert torch.equal(learner.grads, before)
