"""The live processes a test started, found by their command lines (a /proc scan): what a test asserts is
gone after a job ended, and kills by pid so it never leaves them to the next test."""

from __future__ import annotations

import os
from pathlib import Path


def processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process but this one whose command line contains ``marker``
    (zombies left out: they run nothing)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = "State:\tZ" in (entry / "status").read_text()
        except OSError:
            continue
        if marker in cmdline and not zombie:
            found.append((int(entry.name), cmdline))
    return found
