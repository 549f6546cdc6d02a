"""Launch detection, the self-spawned job's command line, and the oversubscription settings."""

from __future__ import annotations

import sys

import pytest

from mpicrossbow.devices import parse_devices
from mpicrossbow.env import OVERSUBSCRIBED_SETTINGS, detect_launcher, tune_for_oversubscription
from mpicrossbow.errors import UsageError
from mpicrossbow.spawn import expand_devices, spawn_command


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"SLURM_PROCID": "0", "SLURM_JOB_ID": "5"}, None),  # inside sbatch but not srun'd under PMI
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "openmpi"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9"}, "mpich"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_STEP_ID": "0"}, "slurm-pmi2"),
        ({"PMIX_RANK": "0", "SLURM_STEP_ID": "0"}, "slurm-pmix"),
    ],
)
def test_detect_launcher(environ: dict[str, str], expected: str | None) -> None:
    assert detect_launcher(environ) == expected


def test_spawn_command_one_rank_per_device() -> None:
    cmd = spawn_command("/x/mpiexec", "mpich", parse_devices("cpu0,cpu1,cpu2"), ["-cfg", "a.cfg"])
    assert cmd == ["/x/mpiexec", "-n", "3", sys.executable, "-m", "mpicrossbow.launcher", "-cfg", "a.cfg"]


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
