"""RunData: what ``crossbow-report`` reads from one run folder — ``metrics.h5`` and the resolved cfg.

A run folder is what ``crossbow-launch`` writes (docs/outputs.md): ``metrics.h5`` holds one train row per
epoch, one val row per validation and the run's attributes, among them every rank's steps/s and exchange
share and the resolved ``session.cfg`` text, from which the batch size and engine come.
"""

from __future__ import annotations

import configparser
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from ..training.metrics import read_metrics


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
    def exchange_share(self) -> float:
        """The mean share of training time the training ranks spent in the exchange (NaN if unknown)."""
        shares = [float(v) for v in self.attrs.get("rank_exchange_share", []) if not math.isnan(float(v))]
        return sum(shares) / len(shares) if shares else math.nan

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
