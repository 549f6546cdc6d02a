"""RULE=AUTO on in-process ranks whose link slows down mid-run: the choice made on the fast link (BSP, whose
allreduce is microseconds here) after measuring under LOCALSGD is measured again and changed once the steps
have been slower than predicted for two windows, on every rank at the same step, from replicas made equal;
with ``recheck = false`` it is kept.

The first window is LOCALSGD's: 3 untimed steps and 16 timed ones or more (two of its averages), ending on an
average, so the first decision comes after step 23; BSP's windows are 6 steps. Four learners a rank (k = 8):
there LOCALSGD needs 2.35× BSP's epochs, so BSP on the fast link beats the 0.8× a move away from the running
rule needs. Each learner's forward sleeps 5 ms first (:class:`Pause`), so a step's compute is about 20 ms
whatever the machine's load: the MLP's own step takes a few ms, and on the loaded 2-core CI an in-process
allreduce's thread hand-off came close to it, and AUTO kept LOCALSGD on the fast link. The slow link is a
communicator whose allreduces sleep 150 ms from step 30 on: BSP's step grows sevenfold or more, past the 2×
the check allows, in the windows ending after steps 35 and 41; LOCALSGD pays it once per average, every 8
steps (a move to it needs the delay above about three steps' compute).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import OPTIM, NormedMLP, stacked
from mpicrossbow.comm.base import Communicator, Handle, ReduceOp
from mpicrossbow.comm.forwarding import ForwardingCommunicator
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import BSP, RULES, LocalSGD, rule_choice
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.step import train_step
from mpicrossbow.training.tuning.noise_scale import NoiseScale

pytestmark = pytest.mark.quick

SIZE, WINDOW, FIRST, STEPS, DELAY_S, PAUSE_S = 2, 6, 24, 54, 0.15, 0.005
SLOW_FROM = FIRST + WINDOW


class Pause(nn.Module):
    """A layer that sleeps ``seconds`` and passes its input on: a step's compute the load cannot shrink
    next to the communication."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sleep, then ``x`` unchanged."""
        time.sleep(self.seconds)
        return x


class PausedMLP(NormedMLP):
    """:class:`NormedMLP` behind a :class:`Pause` of ``pause_s``."""

    def __init__(self, hidden: int, pause_s: float = PAUSE_S) -> None:
        super().__init__(hidden=hidden)
        self.pause_s = pause_s

    def module(self) -> nn.Module:
        """A fresh replica: the pause, then the MLP."""
        return nn.Sequential(Pause(self.pause_s), super().module())


class SlowLink(ForwardingCommunicator):
    """``inner`` whose allreduce takes :data:`DELAY_S` more once :attr:`slow` is set, and whose
    allreduce_mean takes :attr:`mean_delay_s` more (set while BSP runs: a step the model's price misread)."""

    slow = False
    delay_s = DELAY_S
    mean_delay_s = 0.0

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Sleep when slow, then the inner allreduce."""
        if self.slow:
            time.sleep(self.delay_s)
        return self.inner.allreduce(tensor, op, async_op)

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """Sleep when slow, then the inner allreduce_mean (BSP's one allreduce after backward)."""
        if self.slow:
            time.sleep(self.delay_s)
        time.sleep(self.mean_delay_s)
        self.inner.allreduce_mean(tensor, count)


def run(
    recheck: bool,
    lr_scaling: str = "linear",
    slow_from: int = SLOW_FROM,
    mean_delay_s: float = 0.0,
    delay_s: float = DELAY_S,
    pause_s: float = PAUSE_S,
) -> list[dict[str, Any]]:
    """AUTO (windows of 6 steps) for 54 steps on 2 in-process ranks reading ``lr_scaling``'s epochs table,
    the link ``delay_s`` slower from step ``slow_from``, BSP's gradient mean ``mean_delay_s`` slower while it
    runs, each learner's forward ``pause_s`` longer; per rank its decisions, the rule running at the end, and
    every learner's weights right after each decision."""
    pools = []
    for rank in range(SIZE):
        torch.manual_seed(rank)
        spec = PoolSpec(rank, SIZE, 8, OPTIM, torch.device("cpu"), seed=1, learners=4)
        pools.append(SerialPool(PausedMLP(hidden=8, pause_s=pause_s), spec))

    def body(comm: Communicator) -> dict[str, Any]:
        link, pool = SlowLink(comm), pools[comm.rank]
        link.delay_s = delay_s
        rule = RULES.get("AUTO")(measure_steps=WINDOW, candidates="BSP,LOCALSGD", recheck=recheck)
        rule.on_lr_scaling(lr_scaling)  # linear: the documented recipe's table, BSP's fewer epochs win
        rule.bind(link, pool)
        after: dict[int, np.ndarray] = {}
        for step in range(STEPS):
            if step % pool.n_batch_train == 0:
                pool.start_epoch(step // pool.n_batch_train)
            link.slow = step >= slow_from
            link.mean_delay_s = mean_delay_s if rule.running == "BSP" else 0.0  # after the probes and prices
            decided = len(rule.decisions)
            train_step(pool, rule, step)
            if len(rule.decisions) > decided or step + 1 == slow_from:
                after[step + 1] = stacked(pool)
        rule.finish()
        return {"decisions": [row[:2] for row in rule.decisions], "active": rule.active, "after": after}

    return InProcessWorld(SIZE, timeout_s=60).run(body)


def test_a_link_that_slows_mid_run_is_measured_again_and_the_rule_changed_on_every_rank() -> None:
    ranks = run(recheck=True)
    first, again, *later = ranks[0]["decisions"]
    assert first == (FIRST, "BSP")  # the fast link: BSP, which needs the fewest epochs
    switch = FIRST + 3 * WINDOW
    assert again == (switch, "LOCALSGD (period 8)")  # drifted in the windows ending at 36 and 42
    # LOCALSGD's averages cross the slow link too (150 ms each, every 8 steps): on a loaded machine its
    # windows may stray from the prediction made on the fast link, and a decision made again on the slow
    # link keeps LOCALSGD
    assert all(rule == "LOCALSGD (period 8)" for _, rule in later), later
    for rank in ranks:
        assert rank["decisions"] == ranks[0]["decisions"] and isinstance(rank["active"], LocalSGD)
        # LOCALSGD to BSP, BSP's steps (from equal optimizer state), back to LOCALSGD: every learner of every
        # rank holds the same model
        for at in (FIRST, SLOW_FROM, switch):
            moved = rank["after"][at]
            np.testing.assert_array_equal(moved, ranks[0]["after"][at])
            assert (moved == moved[0]).all()


def test_with_recheck_off_the_first_choice_stays() -> None:
    ranks = run(recheck=False)
    for rank in ranks:
        assert rank["decisions"] == [(FIRST, "BSP")] and isinstance(rank["active"], BSP)


@pytest.mark.parametrize("mean_delay_s, chosen", [(0.0, "BSP"), (0.06, "LOCALSGD (period 8)")])
def test_a_candidate_the_margin_kept_out_runs_one_window_on_trial_then_the_measured_steps_decide(
    mean_delay_s: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the rate as written (``lr_scaling = none``: LOCALSGD needs 1.21x BSP's epochs at k = 8) BSP's
    price is within the model's error of LOCALSGD's measured time, so BSP runs the next window on trial.
    Its step as fast as LOCALSGD's, BSP's fewer epochs win; its gradient mean 60 ms slower than the price
    (a link the model misread), LOCALSGD is taken back. Every rank alike, every learner equal after each.

    The table offers period 8 alone here: with period 4 (1.15x BSP's epochs) its price came before BSP's
    once an in-process allreduce took 5 ms of a loaded 2-core machine, and it was the one tried (CI,
    2026-12-03); the choice among periods is the next test's. Each forward pauses 10 ms (compute ~40 ms a
    step): BSP's step as fast as LOCALSGD's must stay under 1.21x its time, which an in-process allreduce of
    over 5 ms a step on a 20 ms compute had broken once in 8 runs beside three busy processes on 2 cores."""
    period_8 = "LOCALSGD (period 8)"
    only_period_8 = {period_8: rule_choice.EPOCHS_VS_BSP["none"][period_8]}
    monkeypatch.setitem(rule_choice.EPOCHS_VS_BSP, "none", only_period_8)
    ranks = run(recheck=False, lr_scaling="none", slow_from=STEPS, mean_delay_s=mean_delay_s, pause_s=0.01)
    for rank in ranks:
        assert rank["decisions"] == [(FIRST, "BSP"), (FIRST + WINDOW, chosen)]
        assert isinstance(rank["active"], BSP if chosen == "BSP" else LocalSGD)
        for at in (FIRST, FIRST + WINDOW):
            moved = rank["after"][at]
            np.testing.assert_array_equal(moved, ranks[0]["after"][at])
            assert (moved == moved[0]).all()


def test_a_slow_link_under_the_rate_as_written_moves_local_sgd_to_a_longer_period_with_equal_replicas() -> (
    None
):
    """The rate as written (``none``) offers LOCALSGD's periods 4, 8 and 16. Every allreduce 0.3 s from the
    start: period 8's measured step is about 38 ms of averaging on ~20 ms of compute, and period 16, paying
    half of it for 1.38x BSP's epochs at k = 8 against period 8's 1.21x, is sooner (up to ~110 ms of
    compute a step on a loaded machine), and taken on its price: another period of the running rule needs
    no margin and no trial. The move is made
    at the window's end, on its average: every rank alike, every learner equal, and the rule running is
    LOCALSGD at period 16."""
    ranks = run(recheck=True, lr_scaling="none", slow_from=0, delay_s=0.3)
    for rank in ranks:
        assert rank["decisions"][0] == (FIRST, "LOCALSGD (period 16)")
        assert rank["decisions"] == ranks[0]["decisions"]
        assert isinstance(rank["active"], LocalSGD) and rank["active"].hyper.period == 16
        moved = rank["after"][FIRST]
        np.testing.assert_array_equal(moved, ranks[0]["after"][FIRST])
        assert (moved == moved[0]).all()


class Sizes(ForwardingCommunicator):
    """``inner`` that records the element count of every allreduce (plain or a mean)."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.sizes: list[int] = []

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Handle:
        """Record, then the inner allreduce."""
        self.sizes.append(tensor.numel())
        return self.inner.allreduce(tensor, op, async_op)

    def allreduce_mean(self, tensor: torch.Tensor, count: int) -> None:
        """Record, then the inner mean."""
        self.sizes.append(tensor.numel())
        self.inner.allreduce_mean(tensor, count)


def model_sized_allreduces(rule_name: str, **hyper: Any) -> list[int]:
    """Sizes of the allreduces larger than AUTO's 256-byte probe that rank 0 made in the first
    :data:`FIRST` steps of ``rule_name`` on 2 in-process ranks."""
    pools = []
    for rank in range(SIZE):
        spec = PoolSpec(rank, SIZE, 8, OPTIM, torch.device("cpu"), seed=1, learners=4)
        pools.append(SerialPool(NormedMLP(hidden=8), spec))

    def body(comm: Communicator) -> list[int]:
        link, pool = Sizes(comm), pools[comm.rank]
        rule = RULES.get(rule_name)(**hyper)
        rule.bind(link, pool)
        for step in range(FIRST):
            if step % pool.n_batch_train == 0:
                pool.start_epoch(step // pool.n_batch_train)
            train_step(pool, rule, step)
        if rule_name == "AUTO":
            assert [row[0] for row in rule.decisions] == [FIRST]
        return [n for n in link.sizes if n > 64]

    return InProcessWorld(SIZE, timeout_s=60).run(body)[0]


def test_measuring_under_localsgd_moves_no_more_model_bytes_than_localsgd() -> None:
    """The first decision prices the model's bytes from LOCALSGD's own averages in the window: AUTO's first
    window and its decision (which keeps LOCALSGD, the only candidate here) allreduce exactly what LOCALSGD's
    same steps do (it added two allreduces of the model, a seventh of the digits job's time to target over a
    30 mbit link)."""
    auto = model_sized_allreduces("AUTO", measure_steps=WINDOW, candidates="LOCALSGD")
    assert auto and auto == model_sized_allreduces("LOCALSGD", period=8)


@pytest.mark.parametrize("pause", ["sync_state", "on_pause"], ids=["validation", "checkpoint-or-epoch-end"])
def test_work_between_steps_inside_a_measuring_window_is_not_timed_as_a_step(pause: str) -> None:
    """The loop validates between steps (``sync_state``, then the forward passes), ends epochs and saves
    checkpoints there (``on_pause`` first): AUTO's window leaves that time out, so it does not make the rule
    it measures look slow. A gap of 0.5 s inside BSP's window of 3 timed steps of ~20 ms each would read as
    a step of ~190 ms."""
    pools = []
    for rank in range(SIZE):
        torch.manual_seed(rank)
        spec = PoolSpec(rank, SIZE, 8, OPTIM, torch.device("cpu"), seed=1, learners=4)
        pools.append(SerialPool(PausedMLP(hidden=8), spec))

    def body(comm: Communicator) -> float:
        pool = pools[comm.rank]
        rule = RULES.get("AUTO")(measure_steps=WINDOW, candidates="BSP", recheck=False)
        rule.bind(comm, pool)
        pool.start_epoch(0)
        for step in range(WINDOW):
            train_step(pool, rule, step)
            if step == WINDOW - 2:  # work between the window's last two steps
                getattr(rule, pause)()
                time.sleep(0.5)
        assert [row[:2] for row in rule.decisions] == [(WINDOW, "BSP")]
        return rule.measured["BSP"]

    for step_s in InProcessWorld(SIZE, timeout_s=60).run(body):
        assert 0.015 < step_s < 0.1, step_s


def test_each_decision_shows_the_gradient_noise_scale_the_run_measured() -> None:
    """The loop tells AUTO where the noise scale is read (``on_noise_scale``); the decision holds the value
    measured up to it and its line shows it (``B_noise not measured`` only where no probe estimated it).
    Four learners a rank: the probe estimates it from their own gradients under LOCALSGD, the measuring
    rule."""
    pools = []
    for rank in range(SIZE):
        torch.manual_seed(rank)
        spec = PoolSpec(rank, SIZE, 8, OPTIM, torch.device("cpu"), seed=1, learners=4)
        pools.append(SerialPool(NormedMLP(hidden=8), spec))

    def body(comm: Communicator) -> tuple[float, float, str]:
        pool = pools[comm.rank]
        probe = NoiseScale(every=1, smoothing=0.5)
        rule = RULES.get("AUTO")(measure_steps=WINDOW, candidates="LOCALSGD", recheck=False)
        rule.on_noise_scale(lambda: probe.value(8))
        rule.bind(comm, pool)
        step = 0
        while not rule.decisions:
            if step % pool.n_batch_train == 0:
                pool.start_epoch(step // pool.n_batch_train)
            train_step(pool, rule, step, probe=probe)
            step += 1
        assert rule.decision is not None
        return rule.decision.measured.noise_scale, probe.value(8), rule.decision.line()

    for shown, measured, line in InProcessWorld(SIZE, timeout_s=60).run(body):
        assert math.isfinite(measured) and shown == measured
        assert line.endswith(f", B_noise {measured:.4g}"), line
