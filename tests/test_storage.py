"""Disks and folders a job writes to: the checkpoint directory's lock, preflight checks, a full disk while
saving, atomic run folders, and unreadable checkpoints told without unsafe advice."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import REPO
from mpicrossbow.config import load_config
from mpicrossbow.errors import CheckpointError, ConfigError, StorageError
from mpicrossbow.training.checkpoints.checkpoint_files import atomic_save, safe_load
from mpicrossbow.training.checkpoints.checkpoint_lock import LOCK, CheckpointLock, LockOwner
from mpicrossbow.training.checkpoints.storage import check_room, check_writable
from mpicrossbow.training.reporting.reporting import make_run_dir


def finished_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def write_lock(directory: Path, **changes: object) -> None:
    owner = {**LockOwner.me().__dict__, **changes}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK).write_text(json.dumps(owner))


def test_a_live_owner_keeps_its_checkpoint_directory(tmp_path: Path) -> None:
    first = CheckpointLock(tmp_path)
    first.acquire()
    with pytest.raises(
        CheckpointError, match=rf"checkpoint directory {tmp_path} is in use by a job on \S+ \(pid"
    ):
        CheckpointLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK).exists()
    second = CheckpointLock(tmp_path)
    second.acquire()  # free again
    assert second.held


def test_a_lock_whose_owner_is_gone_is_taken_over(tmp_path: Path) -> None:
    write_lock(tmp_path, pid=finished_pid())
    CheckpointLock(tmp_path).acquire()
    write_lock(tmp_path / "requeued", job="4711", pid=1)  # an earlier run of this same Slurm job
    os.environ["SLURM_JOB_ID"] = "4711"
    try:
        CheckpointLock(tmp_path / "requeued").acquire()
    finally:
        del os.environ["SLURM_JOB_ID"]
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / LOCK).write_text("")  # a crash between creating and writing it
    old = time.time() - 60
    os.utime(tmp_path / "crashed" / LOCK, (old, old))
    CheckpointLock(tmp_path / "crashed").acquire()


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_two_jobs_taking_over_one_stale_lock_leave_one_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    """Jobs A and B both read a gone owner's lock; B takes it over and writes its own before A acts on what
    it read. A must not remove B's live lock: it stops, naming B, and B's lock stays, with nothing beside
    (also on a file system without hard links, where the lock goes back by rename)."""
    if not links:

        def no_link(src: object, dst: object) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    write_lock(tmp_path, pid=finished_pid())
    a, b = CheckpointLock(tmp_path), CheckpointLock(tmp_path)  # b is this live process
    a.owner = replace(a.owner, pid=finished_pid())
    take_over = a._remove

    def b_first(seen: bytes) -> None:
        b.acquire()  # between A's read of the stale lock and A's take-over
        take_over(seen)

    a._remove = b_first  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match=rf"checkpoint directory {tmp_path} is in use by a job on "):
        a.acquire()
    assert b.held and not a.held
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]


def test_an_owner_on_another_host_is_named_with_how_to_remove_the_lock(tmp_path: Path) -> None:
    write_lock(tmp_path, host="node9", boot="another-boot", job="77")
    lock = tmp_path / LOCK
    with pytest.raises(
        CheckpointError, match=rf"in use by job 77 on node9 .*\(if that job is gone, delete {lock}\)"
    ):
        CheckpointLock(tmp_path).acquire()
    mine = CheckpointLock(tmp_path)
    mine.held = True
    mine.release()  # never removes a lock it does not hold
    assert lock.exists()


def test_preflight_names_an_unwritable_or_small_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^\[session\] output /proc/x: cannot write there: "):
        check_writable(Path("/proc/x"), "[session] output")
    check_writable(tmp_path / "new" / "folder", "[session] output")
    assert list((tmp_path / "new" / "folder").iterdir()) == []  # the probe file is gone
    with pytest.raises(ConfigError, match=r"MB free, one checkpoint needs about"):
        check_room(tmp_path, 1 << 60, "[checkpoint] directory")


def test_a_full_disk_while_saving_is_one_line_and_leaves_the_old_file(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to write into")
    target = tmp_path / "rank-00000.pt"
    atomic_save({"w": torch.ones(4)}, target)
    tmp = tmp_path / f".{target.name}.tmp"
    tmp.symlink_to("/dev/full")  # every write there fails with ENOSPC
    with pytest.raises(
        StorageError, match=rf"^out of space writing {target}: needs about [\d.]+ MB, [\d.]+ MB free"
    ):
        atomic_save({"w": torch.zeros(1 << 16)}, target)
    assert not tmp.exists() and not tmp.is_symlink()  # the temporary file is removed
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(4))  # the old one intact


class Foreign:
    """A class a checkpoint must never unpickle."""


def test_an_unreadable_checkpoint_keeps_the_cause_and_drops_the_unsafe_advice(tmp_path: Path) -> None:
    path = tmp_path / "meta.pt"
    torch.save({"version": 1, "x": Foreign()}, path)
    with pytest.raises(CheckpointError) as info:
        safe_load(path, "its metadata file")
    message = str(info.value)
    assert message.startswith(f"checkpoint file {path} is truncated or corrupt (UnpicklingError: ")
    assert "Unsupported global: GLOBAL" in message and "Foreign" in message
    assert "weights_only" not in message and "add_safe_globals" not in message
    path.write_bytes(pickle.dumps([1], protocol=2)[:3])
    with pytest.raises(CheckpointError, match="is truncated or corrupt"):
        safe_load(path, "its metadata file")


def test_run_folders_are_never_shared_by_jobs_starting_together(tmp_path: Path) -> None:
    config = load_config(REPO / "launch" / "digits.cfg", [f"session.output={tmp_path}", "session.name=run"])
    made: list[Path] = []
    threads = [threading.Thread(target=lambda: made.append(make_run_dir(config))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(made)) == 8 and {p.name for p in made} == {"run", *(f"run-{n}" for n in range(2, 9))}
