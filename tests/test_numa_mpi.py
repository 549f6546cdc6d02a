"""Binding inside real MPI ranks: what each rank reports is what the kernel enforces, for every mode.

Runs under whichever MPI wheel this environment has (MPICH's Hydra or Open MPI); one launch per scenario.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run_local, run_mpi
from mpicrossbow.launch.binding import MODES
from mpicrossbow.launch.spawn import mpi_flavor

pytestmark = [pytest.mark.mpi]
LAUNCH = [sys.executable, "-m", "mpicrossbow.cli"]


def quick(out: Path) -> list[str]:
    return ["session.epochs=1", f"session.output={out}", "session.progress=off"]


def ranks_results(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_every_mode_binds_what_it_reports_disjointly(mpiexec: str, tmp_path: Path) -> None:
    flavor = mpi_flavor(mpiexec)
    no_bind = {"openmpi": ["--bind-to", "none"], "mpich": ["-bind-to", "none"]}.get(flavor, [])
    proc = run_mpi(
        mpiexec,
        2,
        [*no_bind, sys.executable, "tests/mpi_scripts/binding_check.py", str(tmp_path), ",".join(MODES)],
        env={"OMP_NUM_THREADS": ""},  # the default count (two pytest workers set 1 for their jobs)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = ranks_results(tmp_path, 2)
    usable = sorted(os.sched_getaffinity(0))
    for mode in MODES:
        got = [r[mode] for r in ranks]
        for g in got:
            assert g["affinity"] == g["reported"], (mode, g)
            assert all(t == g["reported"] for t in g["thread_affinities"]), (mode, g)  # every thread
            assert g["torch_threads"] == g["threads"] and g["omp"] == str(g["threads"])
        if mode == "none":
            assert all(g["source"] == "none" and g["affinity"] == usable for g in got)
            assert all(g["threads"] == max(1, len(usable) // 2) for g in got)
        else:
            assert all(g["source"] == mode for g in got)
            assert not set(got[0]["affinity"]) & set(got[1]["affinity"]), (mode, got)
            assert set(got[0]["affinity"]) | set(got[1]["affinity"]) == set(usable)
            assert all(g["threads"] == len(g["affinity"]) for g in got)
    assert proc.stderr.count("bindings:") == len(MODES)  # one table per mode, from rank 0 only
    assert "binds like numa: some ranks of this node drive no GPU" in proc.stderr


def test_a_launcher_binding_is_detected_and_kept(mpiexec: str, tmp_path: Path) -> None:
    flavor = mpi_flavor(mpiexec)
    if flavor not in ("openmpi", "mpich"):
        pytest.skip(f"unknown MPI launcher flavour at {mpiexec}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable cores for the launcher to bind ranks apart")
    flag = ["--bind-to", "core"] if flavor == "openmpi" else ["-bind-to", "core"]
    proc = run_mpi(
        mpiexec, 2, [*flag, sys.executable, "tests/mpi_scripts/binding_check.py", str(tmp_path), "core"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [r["core"] for r in ranks_results(tmp_path, 2)]
    assert [g["source"] for g in got] == ["launcher", "launcher"]
    assert all(g["affinity"] == g["reported"] and len(g["affinity"]) == 1 for g in got)
    assert got[0]["affinity"] != got[1]["affinity"]
    assert "already bound the ranks; keeping that binding" in proc.stderr


def test_crossbow_launch_bind_flag_spawns_and_reports(tmp_path: Path) -> None:
    """Run alone with -bind core: the spawned job binds each rank to its own core and prints the table."""
    proc = run_local([*LAUNCH, "-cfg", "launch/digits.cfg", "-np", "2", "-bind", "core", *quick(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stderr.split("bindings:\n", 1)[1].splitlines()[:3]
    assert table[0].split()[:4] == ["rank", "host", "device", "cores"]
    cores = [row.split()[3] for row in table[1:]]
    assert len(set(cores)) == 2 and [row.split()[-1] for row in table[1:]] == ["core", "core"]
    assert "numa.bind=core" not in (next(tmp_path.iterdir()) / "session.cfg").read_text()
    assert "bind = core" in (next(tmp_path.iterdir()) / "session.cfg").read_text()
