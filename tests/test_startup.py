"""Start-up costs only what it must: ``crossbow-launch`` run alone starts the MPI job without importing torch,
h5py or the MPI library (fast, and no CUDA initialisation in the launcher), and its lines are the launcher's.

Imports are checked in fresh interpreters: this test process has long imported everything.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, mpi_env
from mpicrossbow.launch.binding import RankFacts, bind
from mpicrossbow.launch.collector import collector_off_then_frozen
from mpicrossbow.log import LAUNCHER_TAG, setup_logging

#: What the launcher's way to mpiexec must leave unimported (the MPI library is mpi4py.MPI; hwloc and
#: nvidia-smi are programs, checked in test_binding_nothing_reads_no_topology).
HEAVY = ("torch", "h5py", "mpi4py.MPI", "numpy", "tqdm")


def fresh(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter from the repository root, as a plain process (no MPI launcher)."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD"))}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_run_alone_reaches_mpiexec_without_heavy_imports_and_logs_as_the_launcher() -> None:
    """The whole way of ``crossbow-launch`` run alone, up to starting mpiexec (replaced by a stand-in)."""
    proc = fresh(
        "import json, subprocess, sys\n"
        "from mpicrossbow import cli\n"
        "from mpicrossbow.launch import spawn\n"
        "seen = {}\n"
        "class Job:\n"
        "    def __init__(self, cmd, env):\n"
        f"        seen.update(cmd=cmd, heavy=[m for m in {HEAVY!r} if m in sys.modules])\n"
        "    def poll(self):\n"
        "        return 0\n"
        "    def wait(self):\n"
        "        return 0\n"
        "spawn.mpi_flavor = lambda mpiexec: 'mpich'\n"
        "subprocess.Popen = Job\n"
        "code = cli.main(['-cfg', 'launch/digits.cfg', '-np', '2', 'session.epochs=1'])\n"
        "print(json.dumps([code, seen]))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    code, seen = json.loads(proc.stdout)
    assert code == 0 and seen["heavy"] == []
    assert seen["cmd"][1:3] == ["-n", "2"]
    assert seen["cmd"][-4:] == ["mpicrossbow.cli", "-cfg", "launch/digits.cfg", "session.epochs=1"]
    assert f"[{LAUNCHER_TAG}] INFO starting: " in proc.stderr and "[rank" not in proc.stderr


def test_clean_shm_imports_nothing_heavy(tmp_path: Path) -> None:
    """``crossbow-launch --clean-shm`` (no cfg) is as light as the way to mpiexec."""
    proc = fresh(
        "import json, os, sys\n"
        f"os.environ['MPICROSSBOW_SHM_DIR'] = {str(tmp_path)!r}\n"
        "from mpicrossbow import cli\n"
        "code = cli.main(['--clean-shm'])\n"
        f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0].startswith("crossbow-launch --clean-shm: removed 0 ")
    assert json.loads(proc.stdout.splitlines()[-1]) == [0, []]


@pytest.mark.slow
def test_package_root_is_lazy_and_exports_every_public_name() -> None:
    proc = fresh(
        "import json, sys\n"
        "import mpicrossbow\n"
        "before = [m for m in ('torch', 'mpicrossbow.rules', 'mpicrossbow.config') if m in sys.modules]\n"
        "from mpicrossbow import *  # noqa: F403\n"
        "names = {n: getattr(mpicrossbow, n) is globals()[n] for n in mpicrossbow.__all__}\n"
        "print(json.dumps([before, names, sorted(set(mpicrossbow.__all__) - set(dir(mpicrossbow)))]))\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, names, undirred = json.loads(proc.stdout)
    assert before == []
    assert names and all(names.values()) and undirred == []


def test_public_names_are_the_defining_modules_objects() -> None:
    """Rules come with the Theano-MPI facade mixed in; everything else is the defining module's object."""
    import mpicrossbow
    from mpicrossbow import config, errors, model, rules

    assert mpicrossbow.BSP.facade_of is rules.BSP and issubclass(mpicrossbow.BSP, rules.BSP)
    assert mpicrossbow.Rule.facade_of is rules.Rule and mpicrossbow.RULES is rules.RULES
    assert hasattr(mpicrossbow.SMA(), "init") and not hasattr(rules.SMA(), "init")
    assert mpicrossbow.Config is config.Config and mpicrossbow.load_config is config.load_config
    assert mpicrossbow.TorchModel is model.TorchModel and mpicrossbow.Shard is model.Shard
    assert mpicrossbow.UsageError is errors.UsageError and mpicrossbow.__version__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = mpicrossbow.Nope


def test_launcher_tag_replaces_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    logger = setup_logging(tag=LAUNCHER_TAG)
    logger.info("hello")
    setup_logging(1, 4, "INFO").warning("as a rank")
    err = capsys.readouterr().err
    assert "[launcher] INFO hello" in err and "[rank 1/4] WARNING as a rank" in err
    setup_logging()  # leave the default handler for other tests


def test_binding_nothing_reads_no_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    """bind = none (and a launcher's own binding) plans nothing: no hwloc run; the NUMA column from sysfs."""

    def no_hwloc() -> None:
        raise AssertionError("load_topology() called although nothing is planned")

    monkeypatch.setattr("mpicrossbow.launch.binding.load_topology", no_hwloc)
    monkeypatch.setattr("mpicrossbow.launch.binding.set_threads", lambda count: None)
    cpus = (0, 1)
    facts = [RankFacts(r, "h", r, "cpu", cpus, cpus) for r in range(2)]
    binding = bind("none", facts, 0)
    assert binding.source == "none" and binding.cpus == cpus and binding.threads == 1
    assert binding.numa_nodes and all(isinstance(n, int) for n in binding.numa_nodes)
    pinned = [RankFacts(0, "h", 0, "cpu", (0,), cpus), RankFacts(1, "h", 1, "cpu", (1,), cpus)]
    assert bind("core", pinned, 1, memory=False).source == "launcher"


def test_ranks_import_h5py_only_to_write_metrics() -> None:
    proc = fresh("import sys\nimport mpicrossbow.training.run.runner\nprint('h5py' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_rank_start_up_runs_without_the_collector_then_freezes_what_it_made() -> None:
    frozen = gc.get_freeze_count()
    try:
        with collector_off_then_frozen():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
        gc.disable()
        with collector_off_then_frozen():
            pass
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
        gc.unfreeze()
