"""SMA's stability bound and default α (mpicrossbow/rules/sma_stability.py), the ConfigError past the bound,
and the learners' momentum kept through the reset to z at a learning-rate drop.

The bound α < 2(1+μ)/(k+1+μ) is derived in the module's docstring; here a numpy simulation of the
gradient-free consensus loop (w_j ← w_j − α(w_j − z), z ← z + α Σ_j (w_j − z) + μ(z − z_prev)) decides
what is stable, and the rule's own gradient-free step is checked to be that loop.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import launcher, run_mpi, train_steps
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import FusedPool, SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import SMA
from mpicrossbow.rules.sma_stability import ALPHA_CAP, alpha_bound, default_alpha
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.run.step import rule_exchange, rule_gradients


def consensus_step(w: np.ndarray, z: np.ndarray, z_prev: np.ndarray, alpha: float, mu: float) -> tuple:
    """One gradient-free SMA step: learners ``w`` (k × P), centre ``z`` and its last value ``z_prev``."""
    c = alpha * (w - z)
    return w - c, z + c.sum(axis=0) + mu * (z - z_prev), z


def spread(k: int, alpha: float, mu: float, steps: int = 4000) -> float:
    """How far the learners and the centre are apart after ``steps`` gradient-free steps, relative to the
    start: below 1 the loop contracts, far above 1 it diverges."""
    rng = np.random.default_rng(k)
    w, z = rng.normal(size=(k, 3)), rng.normal(size=3)
    z_prev = z + rng.normal(size=3)
    start = np.abs(w - z).max() + np.abs(z - z_prev).max()
    now = start
    for _ in range(steps):
        w, z, z_prev = consensus_step(w, z, z_prev, alpha, mu)
        now = np.abs(w - z).max() + np.abs(z - z_prev).max()
        if now > 1e9 * start:  # diverged: stop before the floats overflow
            break
    return float(now / start)


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("k", [1, 2, 8, 16, 37, 128])
def test_the_bound_separates_stable_from_diverging(k: int, mu: float) -> None:
    bound = alpha_bound(k, mu)
    assert spread(k, 0.98 * bound, mu) < 1e-3
    assert spread(k, 1.02 * bound, mu) > 1e3


def test_the_bound_at_crossbows_settings() -> None:
    """μ = 0.9: α = 0.1 is stable to k = 36, α = 0.2 to k = 17."""
    assert max(k for k in range(1, 100) if 0.1 < alpha_bound(k, 0.9)) == 36
    assert max(k for k in range(1, 100) if 0.2 < alpha_bound(k, 0.9)) == 17


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9, 0.99])
def test_the_default_is_never_past_the_bound(mu: float) -> None:
    for k in range(1, 1025):
        alpha = default_alpha(k, mu)
        assert 0 < alpha <= ALPHA_CAP
        assert alpha <= 0.9 * alpha_bound(k, mu)
    for k in (1, 2, 3, 8, 15, 16, 17, 32, 100, 1024):
        assert spread(k, default_alpha(k, mu), mu, steps=5000) < 1e-3  # the simulated loop contracts


def test_a_constant_alpha_while_it_is_well_inside_the_bound_then_a_fixed_fraction_of_it() -> None:
    assert default_alpha(1, 0.9) == default_alpha(2, 0.9) == default_alpha(15, 0.9) == 0.2
    assert default_alpha(32, 0.9) == pytest.approx(0.9 * 3.8 / 33.9)  # ≈ 0.1, measured best at k = 32


def pool_of(learners: int, engine: type[LearnerPool] = SerialPool) -> LearnerPool:
    """``learners`` small MLP replicas on the digits, one rank."""
    torch.manual_seed(0)
    return engine(
        MLP(hidden=8), PoolSpec(0, 1, 8, OptimSection(lr=0.1), torch.device("cpu"), learners=learners)
    )


def test_the_rules_gradient_free_step_is_the_simulated_loop() -> None:
    """SMA's own on_gradients/exchange (the step's rule side) without an optimizer step moves w and z as
    consensus_step does."""

    def body(comm: Communicator) -> None:
        pool = pool_of(4)
        rule = SMA(alpha=0.3, momentum=0.9).bind(comm, pool)
        generator = torch.Generator().manual_seed(1)
        for learner in pool.learners:
            learner.params.add_(torch.randn(learner.params.shape, generator=generator))
        w = np.stack([learner.params.numpy().astype(np.float64) for learner in pool.learners])
        z, z_prev = rule.z.numpy().astype(np.float64), rule.z_prev.numpy().astype(np.float64)
        for step in range(5):
            rule_gradients(rule, step, pool)
            rule_exchange(rule, step)
            w, z, z_prev = consensus_step(w, z, z_prev, 0.3, 0.9)
        for learner, want in zip(pool.learners, w, strict=True):
            np.testing.assert_allclose(learner.params.numpy(), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rule.eval_params().numpy(), z, rtol=1e-4, atol=1e-5)

    InProcessWorld(1).run(body)


def test_an_explicit_alpha_past_the_bound_is_one_config_error_naming_it() -> None:
    def body(comm: Communicator) -> None:
        bound = alpha_bound(8, 0.9)
        with pytest.raises(ConfigError, match=rf"stability bound .* = {bound:.4g} for k = 8 learners"):
            SMA(alpha=0.5).bind(comm, pool_of(8))
        rule = SMA(alpha=0.3).bind(comm, pool_of(4))  # below the bound at k = 4 (0.64) ...
        assert rule.alpha == 0.3
        rule.pool.resize(16)  # ... past it at k = 16 (0.21): the auto-tuner's growth is refused
        with pytest.raises(ConfigError, match="for k = 16 learners"):
            rule.on_resize()

    InProcessWorld(1).run(body)


@pytest.mark.mpi
def test_the_launcher_reports_alpha_past_the_bound_in_one_line_with_status_2(
    mpiexec: str, tmp_path: Path
) -> None:
    args = ["-cfg", "launch/digits.cfg", "RULE=SMA", "pool.learners=8", "rule.alpha=0.5"]
    proc = run_mpi(mpiexec, 2, [*launcher(), *args, f"session.output={tmp_path}"], timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "stability bound" in errors[0] and "k = 16 learners" in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before any rank made a run folder


def momentum_buffers(pool: LearnerPool) -> list[torch.Tensor]:
    """Copies of every momentum buffer of the pool's optimizers."""
    optimizers = [pool.optimizer] if hasattr(pool, "optimizer") else [lr.optimizer for lr in pool.learners]
    return [
        state["momentum_buffer"].clone()
        for optimizer in optimizers
        for state in optimizer.state.values()
        if "momentum_buffer" in state
    ]


@pytest.mark.parametrize("engine", [SerialPool, FusedPool])
def test_the_reset_to_z_at_an_lr_drop_keeps_the_learners_momentum(engine: type[LearnerPool]) -> None:
    """Crossbow resets the replicas to z when the rate drops and keeps their momentum; so does SMA."""

    def body(comm: Communicator) -> None:
        pool = pool_of(3, engine)
        rule = SMA().bind(comm, pool)
        train_steps(pool, rule, 4)
        before = momentum_buffers(pool)
        assert before and any(b.abs().sum() > 0 for b in before)
        rule.on_lr_change(0.1, 0.01)  # the loop's order: the rule, then the pool's new rate
        pool.set_lr(0.01, 0)
        for learner in pool.learners:
            assert torch.equal(learner.params, rule.z)
        after = momentum_buffers(pool)
        assert len(after) == len(before)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))

    InProcessWorld(1).run(body)
