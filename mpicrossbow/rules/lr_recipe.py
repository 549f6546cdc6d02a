"""The learning-rate trap of k learners: a rate scaled by k with no cap, under a rule whose learners each step
on their own batch.

``lr_scaling = linear`` (or ``sqrt``) multiplies one learner's rate by k (or √k). Under BSP in gradient mode
that is the linear-scaling rule for the global batch the averaged gradient stands for. Under every other rule
— the model-averaging ones (SMA, EASGD, LOCALSGD, DiLoCo, GOSGD, BSP in avg mode) and the asynchronous ones —
each learner still takes its own step on its own small batch, so past the largest rate one learner of that
batch trains at, training diverges however many learners average (MNIST-1D at batch 16, k = 16: 0.025 × 16 =
0.4 ended at 0.59 with no warning; capped at 0.2 it reached 0.92; docs/rules.md). So such a run must say its
cap: ``lr_cap`` at that rate, or a large value to scale without a bound knowingly. ``lr_cap = 0`` (the
default: no cap) is refused there, in one line, before anything starts.
"""

from __future__ import annotations

from .base import Rule


def uncapped_scaling(rule: Rule, scaling: str, cap: float, keys: tuple[str, str]) -> str | None:
    """The one line refusing ``scaling`` without ``cap`` under ``rule`` (see the module doc), or None.

    ``keys`` names the two settings as the user wrote them (``[optim] lr_scaling``/``[optim] lr_cap`` or
    ``xb.distribute(lr_scaling=...)``/``lr_cap=...``)."""
    if scaling == "none" or cap or rule.averages_gradients_throughout:
        return None
    return (
        f"{keys[0]} = {scaling} scales RULE={rule.name}'s rate with its k learners and {keys[1]} = 0 sets no "
        "cap: each learner still steps on its own batch, and past one learner's largest stable rate training "
        "diverges however many average (MNIST-1D, batch 16, k = 16: 0.4 ended at 0.59; capped at 0.2, 0.92). "
        f"Set {keys[1]} to that rate (docs/rules.md, 'Learning rates for k learners'), or to a large value "
        "to scale without a bound knowingly"
    )
