"""Launch detection, the self-spawned job's command line, and the oversubscription settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, mpi_env
from mpicrossbow.errors import UsageError
from mpicrossbow.launch.devices import parse_devices
from mpicrossbow.launch.spawn import (
    expand_devices,
    read_hostfile,
    spawn_command,
    srun_command,
)
from mpicrossbow.launch.world import OVERSUBSCRIBED_SETTINGS, detect_launcher, tune_for_oversubscription


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "5"}, None),  # inside sbatch but not srun'd under PMI
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "openmpi"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9"}, "mpich"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_STEP_ID": "0"}, "slurm-pmi2"),
        ({"PMIX_RANK": "0", "SLURM_STEP_ID": "0"}, "slurm-pmix"),
        ({"PMIX_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),  # Open MPI 5's mpirun sets both
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "SLURM_JOB_ID": "9", "SLURM_PROCID": "0"},
            "mpich",
        ),  # mpiexec in sbatch
    ],
)
def test_detect_launcher(environ: dict[str, str], expected: str | None) -> None:
    assert detect_launcher(environ) == expected


def test_spawn_command_one_rank_per_device() -> None:
    cmd = spawn_command("/x/mpiexec", "mpich", parse_devices("cpu0,cpu1,cpu2"), ["-cfg", "a.cfg"])
    assert cmd == ["/x/mpiexec", "-n", "3", sys.executable, "-m", "mpicrossbow.cli", "-cfg", "a.cfg"]


def test_spawn_command_hosts() -> None:
    devices = parse_devices("a:cuda0,cuda1 b:cuda0")
    assert spawn_command("m", "mpich", devices, [])[:5] == ["m", "-n", "3", "-hosts", "a:2,b:1"]
    assert spawn_command("m", "openmpi", devices, [])[:5] == ["m", "-n", "3", "--host", "a:2,b:1"]
    with pytest.raises(UsageError, match="give a host for every entry or for none"):
        spawn_command("m", "mpich", parse_devices("a:cuda0 cuda1"), [])


def test_oversubscription_settings_only_when_oversubscribed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    env = {"MPI_LOCALNRANKS": "2"}
    assert not tune_for_oversubscription(env) and env == {"MPI_LOCALNRANKS": "2"}
    env = {"MPI_LOCALNRANKS": "4", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1000"}
    assert tune_for_oversubscription(env)
    assert env["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1000"  # the user's setting wins
    assert all(k in env for k in OVERSUBSCRIBED_SETTINGS)


def test_devices_cpu_fits_any_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = parse_devices("cpu")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert [str(d) for d in expand_devices(cpu, None)] == ["cpu", "cpu", "cpu"]  # one rank per usable core
    assert len(expand_devices(cpu, 5)) == 5
    assert len(expand_devices(parse_devices("cpu0,cpu1"), None)) == 2
    with pytest.raises(UsageError, match=r"-np 3 does not match DEVICES, which lists 2 device\(s\)"):
        expand_devices(parse_devices("cpu0,cpu1"), 3)


# Golden command lines (what crossbow-launch runs when started alone), as DeepSpeed's launcher tests do.
PY = [sys.executable, "-m", "mpicrossbow.cli", "-cfg", "s.cfg"]


@pytest.mark.parametrize(
    ("flavor", "devices", "bind", "expected"),
    [
        ("mpich", "cpu0,cpu1", "none", ["/m/mpiexec", "-n", "2", *PY]),
        ("openmpi", "cpu0,cpu1", "none", ["/m/mpiexec", "-n", "2", *PY]),
        ("openmpi", "cuda0,cuda1", "gpu", ["/m/mpiexec", "-n", "2", "--bind-to", "none", *PY]),
        ("mpich", "cuda0,cuda1", "gpu", ["/m/mpiexec", "-n", "2", *PY]),
        (
            "mpich",
            "host0:cuda0,cuda1 host1:cuda0",
            "none",
            ["/m/mpiexec", "-n", "3", "-hosts", "host0:2,host1:1", *PY],
        ),
        (
            "openmpi",
            "host0:cuda0,cuda1 host1:cuda0",
            "core",
            ["/m/mpiexec", "-n", "3", "--host", "host0:2,host1:1", "--bind-to", "none", *PY],
        ),
    ],
)
def test_golden_mpiexec_commands(flavor: str, devices: str, bind: str, expected: list[str]) -> None:
    assert (
        spawn_command("/m/mpiexec", flavor, parse_devices(devices), ["-cfg", "s.cfg"], bind=bind) == expected
    )


def test_golden_hostfile_commands(tmp_path: Path) -> None:
    ompi = tmp_path / "ompi.hosts"
    ompi.write_text("# two nodes\nnode-a slots=2\nnode-b slots=2 max_slots=4\n\n")
    mpich = tmp_path / "mpich.hosts"
    mpich.write_text("node-a:2\nnode-b:2  # comment\n")
    plain = tmp_path / "plain.hosts"
    plain.write_text("node-a\nnode-b\n")
    for path in (ompi, mpich):
        assert read_hostfile(path) == [("node-a", 2), ("node-b", 2)]
    assert read_hostfile(plain) == [("node-a", 1), ("node-b", 1)]
    four = parse_devices("cuda0,cuda1,cuda0,cuda1")
    hosts = read_hostfile(ompi)
    assert spawn_command("mpiexec", "mpich", four, ["-cfg", "s.cfg"], hosts) == [
        *("mpiexec", "-n", "4", "-hosts", "node-a:2,node-b:2"),
        *PY,
    ]
    assert spawn_command("mpiexec", "openmpi", four, ["-cfg", "s.cfg"], hosts, bind="gpu") == [
        *("mpiexec", "-n", "4", "--host", "node-a:2,node-b:2", "--bind-to", "none"),
        *PY,
    ]


def test_hostfile_mistakes_are_one_line_usage_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.hosts"
    bad.write_text("node-a slots=2\nnode-b slots two\n")
    with pytest.raises(UsageError, match=r"bad.hosts line 2: cannot parse 'node-b slots two'"):
        read_hostfile(bad)
    with pytest.raises(UsageError, match="cannot read it"):
        read_hostfile(tmp_path / "missing.hosts")
    (tmp_path / "empty.hosts").write_text("# nothing\n")
    with pytest.raises(UsageError, match="names no host"):
        read_hostfile(tmp_path / "empty.hosts")
    with pytest.raises(UsageError, match=r"the hostfile has 2 slot\(s\) but the job needs 3 rank\(s\)"):
        spawn_command("m", "mpich", parse_devices("cpu0,cpu1,cpu2"), [], [("a", 1), ("b", 1)])
    with pytest.raises(UsageError, match="DEVICES names hosts and -hostfile was given too"):
        spawn_command("m", "mpich", parse_devices("a:cuda0"), [], [("a", 1)])


def test_golden_srun_commands() -> None:
    two = parse_devices("cpu0,cpu1")
    assert srun_command("mpich", two, ["-cfg", "s.cfg"]) == ["srun", "--mpi=pmi2", "-n", "2", *PY]
    assert srun_command("openmpi", two, ["-cfg", "s.cfg"], bind="core") == [
        *("srun", "--mpi=pmix", "-n", "2", "--cpu-bind=none"),
        *PY,
    ]
    hosts = parse_devices("n1:cuda0,cuda1 n2:cuda0,cuda1")
    assert srun_command("mpich", hosts, ["-cfg", "s.cfg"], bind="gpu") == [
        *("srun", "--mpi=pmi2", "-n", "4", "-N", "2", "--nodelist=n1,n2", "--ntasks-per-node=2"),
        "--cpu-bind=none",
        *PY,
    ]
    with pytest.raises(UsageError, match="same number of ranks on every host"):
        srun_command("mpich", parse_devices("n1:cuda0,cuda1 n2:cuda0"), [])


def test_bad_hostfile_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.hosts"
    bad.write_text("node-a slots=x\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mpicrossbow.cli", "-cfg", "launch/digits.cfg", "-hostfile", str(bad)],
        cwd=REPO,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"crossbow-launch: error: -hostfile {bad} line 1: cannot parse 'node-a slots=x'; "
        "expected 'host', 'host slots=N' or 'host:N'"
    ]
