"""``[session] tensorboard = true``: rank 0 mirrors metrics.h5 into TensorBoard event files in ``<run>/tb/``.

Every train row becomes scalars ``train/<column>`` at its step (``train/noise_scale`` too), every validation
row ``val/<column>`` at its step (a parameter server's rows, which have none, at their index), the per-rank
figures gathered at the end ``rank<r>/<figure>``, and the resolved cfg a text entry ``config``. Written
through ``torch.utils.tensorboard``, which needs the ``tensorboard`` package (the ``mpicrossbow[tensorboard]``
extra); without it the session refuses to start with one line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError

#: Train and validation columns that are not scalars of their own (they are the x axis).
AXES = ("step",)


def check_available() -> None:
    """A ConfigError when ``[session] tensorboard = true`` cannot write (found before any rank talks)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "[session] tensorboard = true needs the tensorboard package: "
            "pip install 'mpicrossbow[tensorboard]'"
        )


class TensorBoardLog:
    """An event-file writer in ``run_dir/tb`` fed the same rows as metrics.h5."""

    def __init__(self, run_dir: Path, config_text: str) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        self.writer.add_text("config", "    " + config_text.replace("\n", "\n    "))  # markdown: code block
        self._val_rows = 0

    def row(self, table: str, row: Mapping[str, float]) -> None:
        """One train or val row of metrics.h5 as scalars ``<table>/<column>`` at the row's step."""
        step = int(row.get("step", 0))
        if table == "val":
            step = step if step > 0 else self._val_rows  # a served model's row has no step of its own
            self._val_rows += 1
        for column, value in row.items():
            if column not in AXES:
                self.writer.add_scalar(f"{table}/{column}", float(value), step)
        self.writer.flush()

    def ranks(self, figures: Mapping[str, Sequence[Any]], step: int) -> None:
        """Per-rank figures gathered at the end (``{name: [rank 0's, rank 1's, ...]}``) as
        ``rank<r>/<name>``."""
        for name, values in figures.items():
            for rank, value in enumerate(values):
                self.writer.add_scalar(f"rank{rank}/{name}", float(value), step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
