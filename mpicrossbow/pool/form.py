"""Which form the fused engine runs a step in: one fused network, or the replicas one after another.

Fusing m replicas pays when their batches are small: m small operators become one large one. With large
batches every replica already fills the device, and the fused network's extra layout work (grouped
convolutions that oneDNN runs slower than plain ones, batched matmuls, the replica dimension carried through
every operator) makes it slower than m plain replicas (measured: 0.77–0.86× at batch 128 on ResNet-20 and
LeNet, benchmarks/results/pool.md). Whether it pays depends on the model, the batch and the device, so it is
measured rather than guessed: with ``[pool] fuse = auto`` the first training steps alternate the two forms —
one untimed warm-up step each, then ``rounds`` timed steps each in the order ABBA… — and the form whose
fastest forward + backward is faster is kept (load from other processes only adds time, so the minimum is
the steadiest estimate; a median of three once kept the slower form of an MLP at batch 128). Both forms
compute every replica's own forward and backward on the same storage (same parameters, gradients and
running statistics), so the trial steps are real training steps: nothing is thrown away, and the choice
changes only speed and float round-off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

FUSED, UNFUSED = "fused", "unfused"


@dataclass
class FormChoice:
    """The fused engine's form for the coming step, measured until chosen.

    ``mode`` is ``always`` (fused network), ``never`` (replicas one after another) or ``auto`` (time both,
    keep the faster). :meth:`form` says which form to run next; :meth:`record` takes its time.
    """

    mode: str = "auto"
    rounds: int = 4
    #: The form every later step runs; None while ``auto`` is still timing.
    chosen: str | None = field(default=None, init=False)
    #: Timed seconds per form (the trial's record, logged with the decision).
    times: dict[str, list[float]] = field(default_factory=lambda: {FUSED: [], UNFUSED: []}, init=False)
    _schedule: list[tuple[str, bool]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "always", "never"):
            raise ValueError(f"fuse must be auto, always or never, got {self.mode!r}")
        if self.mode != "auto":
            self.chosen = FUSED if self.mode == "always" else UNFUSED
            return
        timed = [(FUSED, UNFUSED), (UNFUSED, FUSED)]
        self._schedule = [(FUSED, False), (UNFUSED, False)]
        for r in range(self.rounds):
            self._schedule += [(form, True) for form in timed[r % 2]]

    def form(self) -> str:
        """The form to run the next step in."""
        return self.chosen or self._schedule[0][0]

    @property
    def timing(self) -> bool:
        """Whether the next step's forward + backward should be timed (and :meth:`record` called)."""
        return self.chosen is None and self._schedule[0][1]

    def record(self, seconds: float | None) -> None:
        """The step in :meth:`form` is done (``seconds``: its time when :attr:`timing`); the last decides."""
        if self.chosen is not None:
            return
        form, timed = self._schedule.pop(0)
        if timed and seconds is not None:
            self.times[form].append(seconds)
        if not self._schedule:
            fastest = {f: min(t) for f, t in self.times.items()}
            self.chosen = min(fastest, key=fastest.__getitem__)
            log.info(
                "fused engine: forward + backward %.3f ms a step fused, %.3f ms one replica after another; "
                "runs %s from now on",
                fastest[FUSED] * 1e3,
                fastest[UNFUSED] * 1e3,
                "fused" if self.chosen == FUSED else "the replicas one after another",
            )

    def state_dict(self) -> dict[str, Any]:
        """Where the trial stands (or what it chose), for a checkpoint: a resumed run keeps the same forms."""
        return {"chosen": self.chosen, "times": self.times, "schedule": self._schedule}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a form set by ``always`` / ``never`` stays as configured."""
        if self.mode == "auto":
            self.chosen = state["chosen"]
            self.times = {form: list(times) for form, times in state["times"].items()}
            self._schedule = [(form, bool(timed)) for form, timed in state["schedule"]]

    @property
    def steps_to_decide(self) -> int:
        """Training steps left before the form is chosen (0 once chosen)."""
        return len(self._schedule) if self.chosen is None else 0
