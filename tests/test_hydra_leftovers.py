"""The session's removal of MPICH's topology files (tests/hydra_leftovers.py): only this user's, only those
written since the session started, and only once no MPICH launcher runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hydra_leftovers import PREFIX, launchers_running, remove_leftovers


def test_only_the_files_written_since_the_start_are_removed(tmp_path: Path) -> None:
    """A file from before the session and one of another name stay; the new ones go, and are named."""
    old, new, other = tmp_path / f"{PREFIX}old", tmp_path / f"{PREFIX}new", tmp_path / "hydra_other"
    for path in (old, new, other):
        path.write_text("<topology/>")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert remove_leftovers(time.time() - 60, tmp_path) == [new.name]
    assert old.exists() and other.exists() and not new.exists()


def test_another_users_files_stay(tmp_path: Path) -> None:
    """Only files owned by the given user are removed."""
    path = tmp_path / f"{PREFIX}theirs"
    path.write_text("<topology/>")
    assert remove_leftovers(0.0, tmp_path, uid=os.getuid() + 1) == []
    assert path.exists()


def test_a_running_launcher_is_seen(tmp_path: Path) -> None:
    """A process named like MPICH's launcher keeps the files; none, and they may go."""
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "comm").write_text("hydra_pmi_proxy\n")
    (tmp_path / "13").mkdir()
    (tmp_path / "13" / "comm").write_text("python\n")
    (tmp_path / "self").mkdir()
    assert launchers_running(tmp_path)
    (tmp_path / "12" / "comm").write_text("bash\n")
    assert not launchers_running(tmp_path)
