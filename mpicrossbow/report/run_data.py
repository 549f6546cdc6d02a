"""RunData: what ``crossbow-report`` reads from one run folder — ``metrics.h5`` and the resolved cfg.

A run folder is what ``crossbow-launch`` writes (docs/outputs.md): ``metrics.h5`` holds one train row per
epoch, one val row per validation and the run's attributes, among them every rank's steps/s, exchange share
and start rank, the world's changes of size under elastic training (``world_changes``) and the resolved
``session.cfg`` text, from which the batch size and engine come. The figure and the summary both take their
figures from here, so the summary's numbers are the panels' by construction.
"""

from __future__ import annotations

import configparser
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from ..training.reporting.metrics import read_metrics


@dataclass(frozen=True)
class WorldChange:
    """One change of an elastic run's world: ranks lost, or replacements joined (metrics.h5's
    ``world_changes``), placed on both time axes of the report."""

    #: Steps done when the survivors went on (a loss met inside a commit window is placed at its end).
    step: int
    before: int
    after: int
    #: Seconds of training at the change (the clock of the ``time`` columns).
    seconds: float
    #: The epoch axis' position of ``step`` (fractional, from the train rows' steps).
    epoch: float

    @property
    def text(self) -> str:
        """``lost 1 rank: 4 → 3`` or ``replaced: 3 → 4`` — the marker's label and the summary's words."""
        if self.after < self.before:
            n = self.before - self.after
            return f"lost {n} rank{'s' if n > 1 else ''}: {self.before} \u2192 {self.after}"
        return f"replaced: {self.before} \u2192 {self.after}"


@dataclass(frozen=True)
class RunData:
    """One run's tables and attributes, and the figures derived from them."""

    folder: Path
    train: dict[str, np.ndarray]
    val: dict[str, np.ndarray]
    attrs: dict[str, Any]
    batch_size: int
    engine: str

    @property
    def label(self) -> str:
        """``rule, N learner(s)/rank, engine`` — the legend entry when runs are compared."""
        learners = self.attrs.get("learners", "?")
        return (
            f"{self.attrs.get('rule', '?')}, {learners} learner(s)/rank, {self.engine} ({self.folder.name})"
        )

    @property
    def rank_samples_per_second(self) -> list[float]:
        """Every rank's training samples/s: its steps/s × learners × batch size (NaN for a serving rank)."""
        learners = float(self.attrs.get("learners", 1) or 1)
        steps = [float(v) for v in self.attrs.get("rank_steps_per_second", [])]
        return [v * learners * self.batch_size for v in steps]

    @property
    def rank_exchange_shares(self) -> list[float]:
        """Every rank's share of its training time spent in the exchange (NaN for a serving rank)."""
        return [float(v) for v in self.attrs.get("rank_exchange_share", [])]

    @property
    def exchange_share(self) -> float:
        """The mean over the training ranks of :attr:`rank_exchange_shares` (NaN if unknown): the summary's
        ``exchange`` figure and the dashed line of the per-rank exchange panel."""
        shares = [v for v in self.rank_exchange_shares if not math.isnan(v)]
        return sum(shares) / len(shares) if shares else math.nan

    @property
    def start_size(self) -> int:
        """The ranks the job started with."""
        return int(self.attrs.get("world_size", 1))

    @property
    def start_ranks(self) -> list[int]:
        """Each rank's start rank, in the order of the per-rank attributes (after an elastic loss the
        survivors are renumbered 0..n-1; this names them as they started). Files from before the
        ``rank_start_rank`` attribute: the ranks themselves."""
        ranks = self.attrs.get("rank_start_rank")
        if ranks is None:
            return list(range(len(self.attrs.get("rank_steps_per_second", []))))
        return [int(r) for r in ranks]

    @property
    def lost_ranks(self) -> list[int]:
        """Start ranks that were not there at the end (lost and not replaced)."""
        if not len(self.attrs.get("rank_steps_per_second", [])):
            return []
        return sorted(set(range(self.start_size)) - set(self.start_ranks))

    @property
    def world_sizes(self) -> np.ndarray:
        """The ranks training at each train row's end (the ``world_size`` column; the start size where the
        file predates it)."""
        rows = len(self.train.get("epoch", ()))
        sizes = np.asarray(self.train.get("world_size", np.full(rows, np.nan)), float)
        return np.where(np.isfinite(sizes), sizes, float(self.start_size))

    @property
    def learners(self) -> np.ndarray:
        """Learners per rank during each train row's epoch (1 where not recorded)."""
        rows = len(self.train.get("epoch", ()))
        learners = np.asarray(self.train.get("learners", np.ones(rows)), float)
        return np.where(np.isfinite(learners), learners, 1.0)

    @property
    def global_batches(self) -> np.ndarray:
        """The batch one step trains over every rank at each train row's end: learners per rank × batch
        size × ranks training then (so it follows the world after an elastic loss)."""
        return self.learners * self.batch_size * self.world_sizes

    def global_batch_at(self, epoch: float, ranks: int) -> float:
        """The global batch of ``ranks`` ranks just after the epoch axis' position ``epoch``."""
        epochs = np.asarray(self.train.get("epoch", ()), float)
        row = min(int(np.searchsorted(epochs, epoch, side="right")), len(epochs) - 1)
        return float(self.learners[row] * self.batch_size * ranks)

    def global_batch_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """The global batch against the epoch axis as a step function, ``(x, y)`` for ``steps-post``: it
        changes where the world changed (each of :attr:`world_changes` at its own position, so a loss
        replaced at the same step shows as a momentary dip) and where the learners changed (at an epoch's
        end). Starts at the first row's epoch (or an earlier change), ends at the last row, as the curves."""
        epochs = np.asarray(self.train.get("epoch", ()), float)
        if not len(epochs):
            return np.zeros(0), np.zeros(0)
        # (position, 0 = an epoch's end | 1 = a change of world, ranks after): ends first at a tie.
        events = sorted(
            [(float(e), 0, 0) for e in epochs[:-1]] + [(c.epoch, 1, c.after) for c in self.world_changes],
            key=lambda event: event[:2],
        )
        ranks, start = self.start_size, min([float(epochs[0]), *(c.epoch for c in self.world_changes)])
        xs, ys = [start], [self.global_batch_at(start, ranks)]
        for x, kind, after in events:
            ranks = after if kind else ranks
            xs.append(x)
            ys.append(self.global_batch_at(x, ranks))
        return np.asarray([*xs, epochs[-1]]), np.asarray([*ys, ys[-1]])

    @property
    def world_changes(self) -> list[WorldChange]:
        """Every change of the world's size (elastic training), in order; empty for a run that kept its
        ranks."""
        rows = np.asarray(self.attrs.get("world_changes", np.zeros((0, 4))), float).reshape(-1, 4)
        return [
            WorldChange(int(step), int(before), int(after), float(seconds), self.epoch_at(step))
            for step, before, after, seconds in rows
        ]

    def epoch_at(self, step: float) -> float:
        """The epoch axis' position of ``step`` steps done, between the train rows' (step, epoch) pairs."""
        steps = np.asarray(self.train.get("step", ()), float)
        epochs = np.asarray(self.train.get("epoch", ()), float)
        if not len(steps):
            return math.nan
        return float(np.interp(step, np.concatenate([[0.0], steps]), np.concatenate([[0.0], epochs])))

    def best(self) -> tuple[float, float, float]:
        """(best validation accuracy, the epoch and the seconds it was first reached at); NaNs without one."""
        accuracy = self.val.get("accuracy", np.zeros(0))
        if not len(accuracy) or np.isnan(accuracy).all():
            return math.nan, math.nan, math.nan
        i = int(np.nanargmax(accuracy))
        return float(accuracy[i]), float(self.val["epoch"][i]), float(self.val["time"][i])


def load_run(folder: Path) -> RunData:
    """The run in ``folder``; a UsageError naming it when it holds no readable ``metrics.h5``."""
    path = folder / "metrics.h5"
    if not path.is_file():
        raise UsageError(f"{folder}: no metrics.h5 here; give the folder of a run (runs/<name>)")
    try:
        metrics = read_metrics(path)
    except (OSError, KeyError) as exc:
        raise UsageError(f"{path}: not a readable metrics file ({exc})") from None
    cfg = configparser.ConfigParser(interpolation=None)
    try:
        cfg.read_string("[__top__]\n" + str(metrics["attrs"].get("config", "")))
    except configparser.Error:
        cfg = configparser.ConfigParser(interpolation=None)
    return RunData(
        folder=folder,
        train=metrics["train"],
        val=metrics["val"],
        attrs=metrics["attrs"],
        batch_size=int(cfg.get("data", "batch_size", fallback="1")),
        engine=cfg.get("pool", "engine", fallback="serial"),
    )
