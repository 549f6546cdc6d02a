"""Removing what failed MPICH jobs leave in /dev/shm, without MPI: a temporary folder stands in for /dev/shm,
and the live processes are either given (fake readers) or real children that map or open a file there.

``crossbow-launch --clean-shm`` runs as a subprocess with ``$MPICROSSBOW_SHM_DIR`` naming the stand-in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, mpi_env
from mpicrossbow.launch.shm_hygiene import (
    SHM_DIR_VARIABLE,
    Cleanup,
    OpenProbe,
    ProcessFiles,
    Segment,
    in_use,
    list_segments,
    live_processes,
    mapped_paths,
    open_elsewhere,
    process_uids,
    remove_unused,
    remove_unused_segments,
    removing_new_segments,
    shm_dir,
)

ME = os.geteuid()
OTHER = ME + 1


def segment(folder: Path, name: str, size: int = 100) -> Path:
    """A stand-in MPICH segment of ``size`` bytes."""
    path = folder / name
    path.write_bytes(b"\0" * size)
    return path


def nobody(folder: Path) -> list[ProcessFiles]:
    """A process reader that sees no live process."""
    return []


def mapping(*names: str, uids: frozenset[int] = frozenset({ME})) -> ProcessFiles:
    """A readable process that maps ``names`` (paths)."""
    return ProcessFiles(1000, uids, frozenset(names))


def unreadable(uid: int) -> ProcessFiles:
    """A process of ``uid`` whose maps cannot be read."""
    return ProcessFiles(1001, frozenset({uid}), None)


def free(path: Path) -> bool:
    """A probe that finds every file open nowhere else."""
    return False


def unknown(path: Path) -> None:
    """A probe that cannot tell (leases unavailable)."""
    return None


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A child that maps ``mpich_shm_mapped_0`` (fd closed) and holds ``mpich_shm_open_0`` open, unmapped."""
    for name in ("mpich_shm_mapped_0", "mpich_shm_open_0"):
        segment(tmp_path, name, 4096)
    code = textwrap.dedent(f"""
        import mmap, os, sys, time
        fd = os.open({str(tmp_path / "mpich_shm_mapped_0")!r}, os.O_RDWR)
        view = mmap.mmap(fd, 4096)
        os.close(fd)
        held = open({str(tmp_path / "mpich_shm_open_0")!r}, "rb")
        print("ready", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.kill()
        child.wait(10)


def test_segments_are_this_users_regular_mpich_files(tmp_path: Path) -> None:
    segment(tmp_path, "mpich_shm_1a2b_0", 300)
    segment(tmp_path, "other_0")
    (tmp_path / "mpich_shm_dir_0").mkdir()
    (tmp_path / "mpich_shm_link_0").symlink_to(tmp_path / "mpich_shm_1a2b_0")
    assert list_segments(tmp_path) == {"mpich_shm_1a2b_0": Segment("mpich_shm_1a2b_0", 300, ME)}
    assert list_segments(tmp_path, uid=OTHER) == {}
    assert list_segments(tmp_path / "missing") == {}


def test_maps_and_status_are_parsed() -> None:
    maps = (
        "7f00-7f01 rw-s 00000000 00:1a 11 /dev/shm/mpich_shm_a_0\n"
        "7f01-7f02 rw-s 00000000 00:1a 12 /dev/shm/mpich_shm_b_0 (deleted)\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f03-7f04 r--p 00000000 08:01 13 /dev/shm2/mpich_shm_c_0\n"
        "7f04-7f05 rw-s 00000000 00:1a 14 /dev/shm/mpich_shm_a_0\n"
    )
    assert mapped_paths(maps, "/dev/shm") == {"/dev/shm/mpich_shm_a_0"}
    assert process_uids("Name:\tx\nUid:\t1000\t1000\t1000\t0\nGid:\t5\t5\t5\t5\n") == {1000, 0}
    assert process_uids("Name:\tx\n") == frozenset()


def test_a_segment_a_process_maps_is_kept_the_others_removed(tmp_path: Path) -> None:
    for name, size in (("mpich_shm_a_0", 1_000_000), ("mpich_shm_b_0", 2_000_000), ("mpich_shm_c_0", 500)):
        segment(tmp_path, name, size)
    folder = Path(os.path.realpath(tmp_path))
    done = remove_unused(
        list_segments(tmp_path), tmp_path, lambda f: [mapping(str(folder / "mpich_shm_c_0"))], free
    )
    assert done == Cleanup(("mpich_shm_a_0", "mpich_shm_b_0"), 3_000_000, ("mpich_shm_c_0",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_c_0"]
    assert done.summary(tmp_path) == (
        f"removed 2 MPI shared-memory segment(s), 3.0 MB, from {tmp_path}; 1 in use, kept"
    )


@pytest.mark.parametrize(
    ("process", "probe", "kept"),
    [
        (unreadable(ME), unknown, True),  # might map it, and the kernel cannot tell: keep
        (unreadable(ME), free, False),  # the kernel says nobody has it open
        (unreadable(OTHER), unknown, False),  # another user cannot open this user's segment
        (mapping(), lambda path: True, True),  # open somewhere the maps did not show
        (mapping(), unknown, False),
    ],
    ids=["unreadable-same-user", "unreadable-but-free", "unreadable-other-user", "open-elsewhere", "unused"],
)
def test_a_process_that_cannot_be_read_keeps_what_it_might_use(
    tmp_path: Path, process: ProcessFiles, probe: OpenProbe, kept: bool
) -> None:
    segs = {"mpich_shm_a_0": Segment("mpich_shm_a_0", 10, ME)}
    assert in_use(segs, tmp_path, [process], probe) == ({"mpich_shm_a_0"} if kept else set())


def test_after_a_job_only_its_new_unused_segments_go(tmp_path: Path) -> None:
    segment(tmp_path, "mpich_shm_old_0")
    folder = Path(os.path.realpath(tmp_path))
    busy = [mapping(str(folder / "mpich_shm_busy_0"))]
    with pytest.raises(RuntimeError, match="job failed"):
        with removing_new_segments(tmp_path, lambda f: busy, free):
            segment(tmp_path, "mpich_shm_left_0", 2_118_784)
            segment(tmp_path, "mpich_shm_busy_0")
            raise RuntimeError("job failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_busy_0", "mpich_shm_old_0"]


def test_clean_all_and_the_folder_override(tmp_path: Path) -> None:
    """MPICH's segment and Open MPI's (a rank killed in an elastic run leaves one) go; other files stay."""
    segment(tmp_path, "mpich_shm_x_0")
    segment(tmp_path, "sm_segment.vm.0.57be0000.0")
    segment(tmp_path, "someone_elses_file")
    assert shm_dir({}) == Path("/dev/shm") and shm_dir({SHM_DIR_VARIABLE: str(tmp_path)}) == tmp_path
    removed = remove_unused_segments(tmp_path, nobody, free).removed
    assert removed == ("mpich_shm_x_0", "sm_segment.vm.0.57be0000.0")
    assert remove_unused_segments(tmp_path, nobody, free) == Cleanup((), 0, ())
    assert [p.name for p in tmp_path.iterdir()] == ["someone_elses_file"]


def test_real_processes_mapping_or_holding_a_segment_are_seen(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    folder = Path(os.path.realpath(tmp_path))
    (seen,) = [p for p in live_processes(folder) if p.pid == holder.pid]
    assert seen.paths == {str(folder / "mpich_shm_mapped_0"), str(folder / "mpich_shm_open_0")}
    segment(tmp_path, "mpich_shm_free_0")
    if open_elsewhere(tmp_path / "mpich_shm_free_0") is None:
        pytest.skip("file leases are not available here")
    assert open_elsewhere(tmp_path / "mpich_shm_free_0") is False
    assert open_elsewhere(tmp_path / "mpich_shm_mapped_0") is True  # the kernel's view, without /proc
    assert open_elsewhere(tmp_path / "mpich_shm_open_0") is True


def clean_shm(*args: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``crossbow-launch args`` as a subprocess, with ``folder`` standing in for /dev/shm."""
    return subprocess.run(
        [sys.executable, "-m", "mpicrossbow.cli", *args],
        cwd=REPO,
        env=mpi_env({SHM_DIR_VARIABLE: str(folder)}),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_clean_shm_keeps_what_a_live_process_maps_or_holds(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    segment(tmp_path, "mpich_shm_left_0", 2_000_000)
    segment(tmp_path, "not_mpich_0")
    proc = clean_shm("--clean-shm", folder=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "crossbow-launch --clean-shm: removed 1 MPI shared-memory segment(s), 2.0 MB, "
        f"from {tmp_path}; 2 in use, kept\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mpich_shm_mapped_0",
        "mpich_shm_open_0",
        "not_mpich_0",
    ]
    holder.kill()
    holder.wait(10)
    proc = clean_shm("--clean-shm", folder=tmp_path)
    assert proc.returncode == 0 and "removed 2 MPI shared-memory segment(s)" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["not_mpich_0"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "the following arguments are required: -cfg/--cfg (or --clean-shm alone)"),
        (("--clean-shm", "-cfg", "launch/digits.cfg"), "--clean-shm starts no job"),
        (("--clean-shm", "session.epochs=1"), "--clean-shm starts no job"),
    ],
)
def test_clean_shm_runs_alone_and_a_cfg_is_required_otherwise(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    segment(tmp_path, "mpich_shm_x_0")
    proc = clean_shm(*args, folder=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "usage: crossbow-launch" in proc.stderr
    assert (tmp_path / "mpich_shm_x_0").exists()
