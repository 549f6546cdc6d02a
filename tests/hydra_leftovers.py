"""MPICH's launcher writes the machine's hwloc topology to ``/tmp/hydra_hwloc_xmlfile_<random>`` (the path is
built in: TMPDIR does not move it) for its proxies to read as they start, and unlinks it when it exits. A
``mpiexec`` or proxy that is SIGKILLed, which the suite's crash drills do on purpose, leaves it: about 35
files of 5 KB a full run. At the end of the session, once no MPICH launcher is left running, the files
created during it are removed, and their count said.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

#: The files' folder and the start of their names (MPICH's hydra, ``HYDT_topo_hwloc_init``).
FOLDER = Path("/tmp")
PREFIX = "hydra_hwloc_xmlfile_"
#: The names of MPICH's launcher processes, one of which may still need a file.
LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy")
_started = time.time()


def launchers_running(proc: Path = Path("/proc")) -> bool:
    """Whether a process of MPICH's launcher (:data:`LAUNCHERS`) is alive."""
    for entry in proc.iterdir():
        try:
            name = (entry / "comm").read_text().strip() if entry.name.isdigit() else ""
        except OSError:
            continue
        if name in LAUNCHERS:
            return True
    return False


def remove_leftovers(since: float, folder: Path = FOLDER, uid: int | None = None) -> list[str]:
    """Unlink the hydra topology files of user ``uid`` (default: this one) in ``folder`` modified at ``since``
    (a time) or later; their names."""
    uid = os.getuid() if uid is None else uid
    removed = []
    for path in candidates(folder):
        try:
            info = path.stat()
            if info.st_uid == uid and info.st_mtime >= since:
                path.unlink()
                removed.append(path.name)
        except OSError:
            continue
    return removed


def candidates(folder: Path) -> Iterable[Path]:
    """The hydra topology files in ``folder``."""
    return sorted(folder.glob(PREFIX + "*"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In the controller (or a run without workers): remove what the session's killed launchers left."""
    if hasattr(session.config, "workerinput") or launchers_running():
        return
    removed = remove_leftovers(_started)
    if removed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"removed {len(removed)} file(s) {FOLDER}/{PREFIX}* that killed MPICH jobs left"
            )
