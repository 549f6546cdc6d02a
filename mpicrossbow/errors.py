"""The exceptions mpicrossbow raises for bad input, so the launcher can tell them from bugs.

Every :class:`UsageError` carries one line that names the problem (the cfg key, the file, the missing method)
and is reported without a traceback; the job exits with :data:`USAGE_EXIT_CODE` before any rank trains.
"""

from __future__ import annotations

#: Exit status for bad input (config, CLI, model file, data file), as argparse uses.
USAGE_EXIT_CODE = 2

#: Exit status of a run that a signal (SIGTERM, SIGUSR1) stopped after every rank saved a checkpoint: not
#: finished, run it again (or let Slurm requeue it) to continue. EX_TEMPFAIL of sysexits.h.
STOPPED_EXIT_CODE = 75


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2, no traceback."""


class ConfigError(UsageError):
    """A session.cfg key, section, value or command-line override is wrong."""


class ContractError(UsageError):
    """A model file or model class does not follow the model contract."""


class DataError(UsageError):
    """A data file is missing, truncated or not in the expected format."""


class CheckpointError(UsageError):
    """A checkpoint is missing, truncated, corrupt, or from another job shape (world size, rule, learners)."""


class StorageError(RuntimeError):
    """A disk refused a write (full, over quota, read-only) while training: one line naming the folder and
    the bytes needed and free; the job aborts with status 1, the previous checkpoint intact."""
