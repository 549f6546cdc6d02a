"""Logging set-up: every line carries the rank, and only rank 0 is chatty by default.

MPI launchers forward each rank's output in chunks, so lines from several ranks interleave; keeping
non-zero ranks at WARNING avoids noise while still showing their problems.
"""

from __future__ import annotations

import logging
import sys

#: The package logger; modules use ``logging.getLogger(__name__)`` beneath it.
LOGGER_NAME = "mpicrossbow"
#: What ``crossbow-launch``'s lines carry before the process is a rank (``[launcher]``).
LAUNCHER_TAG = "launcher"


def setup_logging(
    rank: int = 0, size: int = 1, level: str | int | None = None, *, tag: str | None = None
) -> logging.Logger:
    """Configure the ``mpicrossbow`` logger for this process and return it.

    Lines carry ``[rank r/size]``, or ``[tag]`` when a tag is given: ``crossbow-launch`` logs as
    :data:`LAUNCHER_TAG` until it knows its rank (run alone, it never has one: it starts the job).
    ``level`` defaults to INFO on rank 0 and WARNING elsewhere. Calling it again replaces the handler, so a
    process can first log as the launcher and then as rank r once MPI is up.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if level is None:
        level = logging.INFO if rank == 0 else logging.WARNING
    logger.setLevel(level)
    for handler in list(logger.handlers):
        if getattr(handler, "_mpicrossbow", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._mpicrossbow = True  # type: ignore[attr-defined]
    if tag is None:
        width = len(str(max(size - 1, 0)))
        tag = f"rank {rank:>{width}}/{size}"
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
