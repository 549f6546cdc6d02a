"""Where SMA's consensus loop is stable, and the elastic rate α it uses when the cfg sets none.

Without gradients SMA is a linear map of the learners w_j and the centre z: ``w_j ← w_j − α (w_j − z)`` and
``z ← z + α Σ_j (w_j − z) + μ (z − z_prev)``. The differences between learners shrink by (1 − α) a step.
The mean's distance to the centre ``d = w̄ − z`` and the centre's step ``Δ = z − z_prev`` follow

    d' = (1 − (k+1) α) d − μ Δ,      Δ' = k α d + μ Δ,

a 2×2 map with trace ``1 + μ − (k+1) α`` and determinant ``μ (1 − α)``. Both eigenvalues lie inside the unit
circle (Jury: |det| < 1 and |trace| < 1 + det) exactly while 1 + trace + det = 2(1 + μ) − (k + 1 + μ) α > 0:

    α < 2 (1 + μ) / (k + 1 + μ).

Past it, d and Δ oscillate with growing amplitude: the learners and the centre fly apart whatever the
gradients do. tests/test_sma_stability.py checks the formula against a numpy simulation of the loop.
"""

from __future__ import annotations

#: The default α never exceeds this (Crossbow's scripts use 0.1–0.2; benchmarks/results/sma_recipe.md: 0.2
#: trained as well as 0.1 at k ≤ 4 and better at k = 8 and 16).
ALPHA_CAP = 0.2
#: ... nor this fraction of the stability bound (at k = 32 and μ = 0.9, 0.1 ≈ 0.9 × the bound trained best).
BOUND_FRACTION = 0.9


def alpha_bound(k: int, momentum: float) -> float:
    """The largest stable α for ``k`` learners in all and centre momentum μ = ``momentum`` (exclusive):
    ``2 (1 + μ) / (k + 1 + μ)``."""
    if k < 1:
        raise ValueError(f"k = {k}: need at least one learner")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum = {momentum}: need 0 <= μ < 1")
    return 2 * (1 + momentum) / (k + 1 + momentum)


def default_alpha(k: int, momentum: float) -> float:
    """α when ``[rule] alpha`` is unset: ``min(ALPHA_CAP, BOUND_FRACTION × bound)``.

    That is a constant pull of each learner towards z up to k ≈ 15, then just inside the stable region.
    Not 1/k: its pull weakens as k grows, and it trained worst at k = 16 and 32. Near the bound the
    consensus still contracts fast: its eigenvalues have modulus √(μ (1 − α)) until they turn real close
    to the bound.
    """
    return min(ALPHA_CAP, BOUND_FRACTION * alpha_bound(k, momentum))
