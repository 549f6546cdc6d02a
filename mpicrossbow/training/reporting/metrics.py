"""Metrics of a run, written by rank 0 to ``metrics.h5`` in the run folder and flushed every epoch.

Layout: group ``train`` with one row per epoch, averaged over every rank (``step``, ``epoch``, ``loss``,
``accuracy``, ``lr``, ``time``, ``learners`` per rank, ``data_wait``: the share of the epoch's training time
rank 0's learners waited for a batch, ``noise_scale``: the smoothed gradient noise scale B_noise in samples at
the epoch's end, NaN where not measured, :mod:`.noise_scale`, ``world_size``: the ranks training at the
epoch's end, fewer after an elastic loss); group ``val`` with one row per validation
(``epoch``, ``step``, ``loss``, ``accuracy``, ``time``, ``exchange_share``); the resolved cfg text is the
file attribute ``config``; ``learners`` (final count per rank) and, with ``[pool] learners = auto``,
``autotune_history`` (per check: learners, samples/s, B_noise, efficiency, goodput) are attributes too.
Appending row by row and flushing means a crash loses at most the current epoch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# h5py is imported where a file is opened: only rank 0 writes metrics, and the other ranks should not pay
# for importing it (about 0.1 s) when their data comes from elsewhere.

log = logging.getLogger(__name__)

TRAIN_COLUMNS = (
    "step",
    "epoch",
    "loss",
    "accuracy",
    "lr",
    "time",
    "learners",
    "data_wait",
    "noise_scale",
    "world_size",
)
VAL_COLUMNS = ("epoch", "step", "loss", "accuracy", "time", "exchange_share")


class MetricsWriter:
    """Append-only HDF5 tables of training and validation metrics."""

    def __init__(
        self,
        path: Path,
        config_text: str,
        attrs: dict[str, Any] | None = None,
        resume_step: int | None = None,
        reopened_at: str = "resumed_at_step",
    ) -> None:
        import h5py

        self.path = path
        if resume_step is not None and path.exists() and self._reopen(resume_step, attrs, reopened_at):
            return
        self.file = h5py.File(path, "w")
        self.file.attrs["config"] = config_text
        for key, value in (attrs or {}).items():
            self.file.attrs[key] = value
        for group, columns in (("train", TRAIN_COLUMNS), ("val", VAL_COLUMNS)):
            g = self.file.create_group(group)
            for col in columns:
                g.create_dataset(col, shape=(0,), maxshape=(None,), dtype="f8", chunks=(1024,))

    def _reopen(self, resume_step: int, attrs: dict[str, Any] | None, reopened_at: str) -> bool:
        """Resuming (or taking over from a lost rank 0, elastic training): append to the file its last writer
        left, recording ``resume_step`` as the attribute ``reopened_at``. False when that file is damaged
        (its writer was killed in the middle of a write): it is kept beside, renamed, and a new one starts."""
        import h5py

        try:
            self.file = h5py.File(self.path, "a")
            self._truncate_after(resume_step)
        except (OSError, KeyError) as exc:
            if getattr(self, "file", None) is not None:
                self.file.close()
            kept = self.path.with_name(f"{self.path.name}.damaged-step-{resume_step}")
            self.path.rename(kept)
            log.warning(
                "%s of the interrupted run cannot be read (%s): kept as %s; the resumed run's metrics "
                "start a new %s",
                self.path.name,
                exc,
                kept.name,
                self.path.name,
            )
            return False
        self.file.attrs[reopened_at] = resume_step
        for key, value in (attrs or {}).items():  # e.g. a requeued Slurm job's new restart count
            self.file.attrs[key] = value
        return True

    def _truncate_after(self, step: int) -> None:
        """Resuming at ``step``: drop rows the interrupted run wrote after its checkpoint, and a row its
        writer was killed in the middle of appending (its columns are then of different lengths)."""
        for group in ("train", "val"):
            g = self.file[group]
            whole = min(ds.shape[0] for ds in g.values())
            keep = int((g["step"][:whole] <= step).sum())
            for ds in g.values():
                ds.resize((keep,))

    def _append(self, group: str, row: dict[str, float]) -> None:
        g = self.file[group]
        for key, value in row.items():
            if key not in g:  # a column newer than the file being resumed: earlier rows are unknown
                rows = g["step"].shape[0] if "step" in g else 0
                unknown = [float("nan")] * rows
                g.create_dataset(key, data=unknown, maxshape=(None,), chunks=(1024,), dtype="f8")
            ds = g[key]
            ds.resize((ds.shape[0] + 1,))
            ds[-1] = value

    def train(self, **row: float) -> None:
        """Append one training row (keys: TRAIN_COLUMNS) and flush to disk (a writer killed later, as
        elastic training's lost rank 0 is, leaves every epoch it wrote readable)."""
        self._append("train", row)
        self.file.flush()

    def steps(self, group: str) -> set[float]:
        """The steps of the rows ``group`` holds (``train`` or ``val``)."""
        return {float(x) for x in self.file[group]["step"][()]}

    def val(self, **row: float) -> None:
        """Append one validation row (keys: VAL_COLUMNS) and flush to disk."""
        self._append("val", row)
        self.file.flush()

    def close(self, **attrs: Any) -> None:
        """Store final attributes (final accuracy, wall time...) and close the file."""
        if self.file.id.valid:
            for key, value in attrs.items():
                self.file.attrs[key] = value
            self.file.close()


def read_metrics(path: Path | str) -> dict[str, dict[str, np.ndarray]]:
    """Load ``metrics.h5`` into {'train': {column: array}, 'val': {...}, 'attrs': {...}}."""
    import h5py

    with h5py.File(path, "r") as f:
        out: dict[str, Any] = {g: {k: f[g][k][()] for k in f[g]} for g in ("train", "val")}
        out["attrs"] = dict(f.attrs)
    return out
