"""Shared test fixtures: the environment's own MPI launcher, a bounded way to run MPI jobs and subprocesses,
the step loop of in-process rule tests and :func:`run_world`, a rule's whole life on in-process ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from bounded import JobTimedOut, run_bounded
from core_slots import cores_for
from models.mlp import MLP
from mpicrossbow.comm.base import Communicator
from mpicrossbow.config import OptimSection
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.base import LearnerPool
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.rules import Rule
from mpicrossbow.testing import InProcessWorld
from mpicrossbow.training.checkpoints.checkpoint_files import META, rank_file, safe_load
from mpicrossbow.training.run.step import train_step
from openmpi_env import OPENMPI_VENV, OpenMPIEnv, why_not

#: Two workers' groups, the quick tier's marker and its check that it touches every module (``pytest -m
#: quick``), the seconds of every test to a file, the removal of MPICH's topology files that killed jobs left.
pytest_plugins = ("parallel", "quick_tier", "durations_file", "hydra_leftovers")

REPO = Path(__file__).resolve().parent.parent
#: The learners' SGD in the rule tests (the numpy references replay it: ``reference.Sgd(LR, MOMENTUM)``).
LR, MOMENTUM = 0.05, 0.9
OPTIM = OptimSection(lr=LR, momentum=MOMENTUM)


def find_mpiexec() -> str | None:
    """The launcher of the MPI that mpi4py in this environment uses: next to sys.executable, then PATH."""
    here = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        if (here / name).exists():
            return str(here / name)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for MPI subprocesses: repo importable, Open MPI allowed as root and oversubscribed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


@pytest.fixture(scope="session", autouse=True)
def no_mpich_segments_left() -> Iterator[None]:
    """MPICH leaves its /dev/shm segment behind when a job ends by MPI_Abort or a killed rank, and Open MPI
    one of a rank killed in an elastic run, which many tests do on purpose (and jobs started by a plain
    mpiexec get no launcher to clean up after them): at the end of the session remove every segment created
    during it that no live process uses."""
    from mpicrossbow.launch.shm_hygiene import removing_new_segments

    with removing_new_segments():
        yield


@pytest.fixture(autouse=True)
def mpi_tests_take_the_cores(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``mpi`` holds every core of the machine while it runs (:mod:`core_slots`), its jobs
    however they start (``run_mpi``, ``Popen``, a shell): two CPU-bound jobs at once on the CI machine's two
    cores took 4x and more their time alone. The daemons' group (Slurm, namespace nodes: mostly waiting)
    and the in-process tests run beside it."""
    from parallel import group_of  # a plugin of this conftest's (imported here: pytest rewrites it first)

    if request.node.get_closest_marker("mpi") is None or group_of(request.node.nodeid) == "daemons":
        yield
        return
    with cores_for():
        yield


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """Path of the MPI launcher; skips the test where no MPI is installed."""
    path = find_mpiexec()
    if path is None:
        pytest.skip("no mpiexec found next to the Python interpreter or on PATH")
    return path


def run_local(
    args: list[str],
    timeout: float = 120,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
    ranks: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in the MPI environment with a hard timeout, output captured as text: a launcher that
    starts its own job, or a script; the caller asserts on returncode and output. The job holds ``ranks``
    of the machine's cores (:mod:`core_slots`; all of them when not given) while it runs: the timeout
    counts from its start, not from the wait for them."""
    with cores_for(ranks):
        return run_bounded(args, timeout, cwd, mpi_env(env))


def run_mpi(
    mpiexec: str,
    n: int,
    args: list[str],
    timeout: float = 120,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n n args...`` with a hard timeout; the caller asserts on returncode and output."""
    return run_local([mpiexec, "-n", str(n), *args], timeout, cwd, env, ranks=n)


def verdicts(stdout: str) -> dict[str, str]:
    """``{check name: "OK" | "SKIP ..." | "FAIL ..."}`` from the ``CHECK`` lines of an MPI check script
    (tests/mpi_scripts/verdicts.py)."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, verdict = line.split(" ", 2)
            found[name] = verdict
    return found


#: World sizes of the communicator jobs (:func:`comm_job`).
COMM_JOB_SIZES = (1, 2, 3, 4)


@dataclass(frozen=True)
class CommJob:
    """What one launch of the communicator checks printed and returned (``returncode`` None: timed out)."""

    n: int
    returncode: int | None
    stdout: str
    stderr: str

    def verdicts(self, label: str) -> dict[str, str]:
        """``{check: verdict}`` of the checks reported as ``<label>.<check>``."""
        prefix = f"{label}."
        return {k[len(prefix) :]: v for k, v in verdicts(self.stdout).items() if k.startswith(prefix)}

    def tail(self) -> str:
        """The exit status and the end of stderr, for an assertion message."""
        return f"\n(mpiexec -n {self.n}: rc={self.returncode})\n{self.stderr[-4000:]}"


@pytest.fixture(scope="session")
def comm_job(mpiexec: str) -> Callable[[int], CommJob]:
    """``comm_job(n)``: the one ``mpiexec -n n`` launch (made on first use, then shared by every test of the
    session) of tests/test_communicator_contract.py, which runs the communicator contract on every MPI-based
    implementation and then the MPI- and shared-memory-specific checks of tests/mpi_scripts/mpi_check.py and
    shm_check.py: importing torch costs seconds per rank, so the comm tests share four launches."""
    jobs: dict[int, CommJob] = {}
    script = REPO / "tests" / "test_communicator_contract.py"

    def job(n: int) -> CommJob:
        if n not in jobs:
            args = [sys.executable, str(script), "--also", "mpi_check", "--also", "shm_check"]
            try:
                proc = run_mpi(mpiexec, n, args, timeout=300)
                jobs[n] = CommJob(n, proc.returncode, proc.stdout, proc.stderr)
            except JobTimedOut as exc:
                jobs[n] = CommJob(n, None, exc.stdout or "", str(exc))
        return jobs[n]

    return job


def launcher() -> list[str]:
    """The installed ``crossbow-launch`` console script, or the module when the package is not installed."""
    script = Path(sys.executable).parent / "crossbow-launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mpicrossbow.cli"]


def epoch_of(checkpoint: Path) -> int:
    """The furthest epoch any rank's file of ``checkpoint`` holds (a parameter server's holds none)."""
    return max(
        int(torch.load(f, weights_only=True)["position"]["epoch"]) for f in checkpoint.glob("rank-*.pt")
    )


def assert_loads_whole(checkpoint: Path, ranks: int) -> None:
    """Each of ``ranks`` rank files of ``checkpoint`` and its metadata load as a resume loads them (a
    failure's drill checks what its resume would rely on without running one)."""
    safe_load(checkpoint / META, "its metadata file")
    for rank in range(ranks):
        safe_load(rank_file(checkpoint, rank), f"rank {rank}'s file")


def only_run(out: Path) -> Path:
    """The one run folder a job created under ``out``."""
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def train_steps(pool: Any, rule: Any, steps: int, sleep_s: float = 0.0) -> list[np.ndarray]:
    """The session's step loop without the session, for in-process rule tests: each epoch started as it
    begins, then :func:`~mpicrossbow.training.run.step.train_step`, then ``sleep_s`` (a test's straggler).
    Returns every step's gradients as the rule received them, ``(learners, P)`` arrays: what the
    differential tests replay in numpy."""
    per_epoch = pool.n_batch_train
    grads: list[np.ndarray] = []

    def record(step: int) -> None:
        grads.append(np.stack([learner.grads.numpy().copy() for learner in pool.learners]))

    for step in range(steps):
        if step % per_epoch == 0:
            pool.start_epoch(step // per_epoch)
        train_step(pool, rule, step, guard=record)
        time.sleep(sleep_s)
    return grads


class NormedMLP(MLP):
    """The digits MLP with a BatchNorm1d after its first layer: running statistics among the learners' float
    ``buffers``, which bind, averaging and checkpoints must carry like the weights. They start random (from
    the torch seed, as the weights do), so replicas built under different seeds differ in both."""

    def module(self) -> nn.Module:
        """A fresh replica: Flatten → Linear → BatchNorm1d → ReLU → Linear."""
        norm = nn.BatchNorm1d(self.hidden)
        norm.running_mean.normal_(0.0, 0.1)
        norm.running_var.uniform_(0.5, 1.5)
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(self.inputs, self.hidden),
            norm,
            nn.ReLU(),
            nn.Linear(self.hidden, self.classes),
        )


def stacked(pool: LearnerPool, attr: str = "params") -> np.ndarray:
    """Every learner's flat ``attr`` (``params``, ``grads`` or ``buffers``) as one ``(m, n)`` array copy."""
    return np.stack([getattr(learner, attr).detach().cpu().numpy().copy() for learner in pool.learners])


@dataclass
class WorldRun:
    """What :func:`run_world` recorded; every list is indexed by rank."""

    pools: list[LearnerPool]
    rules: list[Rule]
    #: Every rank's learners' ``(params, buffers)`` as built, before ``bind`` (each rank's own seed).
    built: list[tuple[np.ndarray, np.ndarray]]
    #: Every rank's learners' ``(params, buffers)`` right after ``bind``.
    bound: list[tuple[np.ndarray, np.ndarray]]
    #: Every rank's ``(m, P)`` gradients of each step, as the rule received them (empty where it served).
    grads: list[list[np.ndarray]]
    #: Every rank's ``(m, P)`` weights after ``finish``, before ``sync_state``.
    final: list[np.ndarray]
    #: ``eval_params()`` after ``sync_state`` (None: learner 0's own weights).
    evals: list[np.ndarray | None]
    #: What ``after_finish`` returned on each rank.
    extra: list[Any]

    @property
    def w0(self) -> np.ndarray:
        """The weights every learner started from: rank 0's learner 0 after bind."""
        return self.bound[0][0][0]

    def learner_grads(self) -> list[list[np.ndarray]]:
        """Each global learner's gradient at every step (rank-major: learner j of rank r is r·m + j)."""
        return [[step[j] for step in per_rank] for per_rank in self.grads for j in range(len(per_rank[0]))]

    def learner_final(self) -> list[np.ndarray]:
        """Each global learner's weights after ``finish`` (rank-major)."""
        return [w for per_rank in self.final for w in per_rank]

    def worker_grads(self) -> dict[int, list[np.ndarray]]:
        """The recorded gradients of the ranks that trained, by rank (what the server references replay)."""
        return {r: g for r, g in enumerate(self.grads) if g}


def _count(
    steps: int | Mapping[int, int] | Callable[[LearnerPool], int], rank: int, pool: LearnerPool
) -> int:
    """How many steps ``rank`` takes: ``steps`` itself, its entry for the rank, or ``steps(pool)``."""
    if isinstance(steps, int):
        return steps
    return steps[rank] if isinstance(steps, Mapping) else steps(pool)


def run_world(
    size: int,
    make_rule: Callable[[], Rule],
    steps: int | Mapping[int, int] | Callable[[LearnerPool], int],
    *,
    model: Callable[[], Any] = lambda: MLP(hidden=16),
    optim: OptimSection = OPTIM,
    learners: int = 1,
    engine: type[LearnerPool] = SerialPool,
    sleep_s: Mapping[int, float] | None = None,
    report: Callable[[LearnerPool, torch.Tensor, float], None] | None = None,
    after_finish: Callable[[Communicator, LearnerPool, Rule], Any] | None = None,
    ranks_per_node: int | None = None,
    timeout_s: float = 30.0,
) -> WorldRun:
    """A rule's whole life on ``size`` in-process ranks, as the session runs it; returns what happened.

    Pools are built as the session builds them (rank r under torch seed r, so the replicas differ until
    ``bind``; the data shard the rule gives a training rank, the whole set to a rank it keeps out of
    training). Then on every rank: ``bind``; ``steps`` steps (per rank, when a mapping; ``steps(pool)``
    when a function) of :func:`train_steps`, each followed by ``sleep_s[rank]``, or on a rank that does
    not train the rule's ``serve`` loop, which reports to ``report(pool, params, epoch)``; ``finish``;
    ``after_finish(comm, pool, rule)``; ``sync_state`` and ``eval_params``.
    """
    pools: list[LearnerPool] = []
    for r in range(size):
        rule = make_rule()
        trains = rule.trains(r, size)
        index, count = rule.train_shard(r, size) if trains else (0, 1)
        span = rule.train_span(r, size) if trains else None
        torch.manual_seed(r)
        spec = PoolSpec(index, count, 8, optim, torch.device("cpu"), seed=1, learners=learners, span=span)
        pools.append(engine(model(), spec))
    built = [(stacked(p), stacked(p, "buffers")) for p in pools]
    rules: list[Any] = [None] * size
    bound: list[Any] = [None] * size
    grads: list[list[np.ndarray]] = [[] for _ in range(size)]
    final: list[Any] = [None] * size
    evals: list[np.ndarray | None] = [None] * size
    extra: list[Any] = [None] * size

    def body(comm: Communicator) -> None:
        rank, pool = comm.rank, pools[comm.rank]
        rule = make_rule()
        trains = rule.trains(rank, size)
        rules[rank] = rule.bind(comm, pool)
        bound[rank] = (stacked(pool), stacked(pool, "buffers"))
        if trains:
            grads[rank] = train_steps(pool, rule, _count(steps, rank, pool), (sleep_s or {}).get(rank, 0.0))
        else:
            rule.serve(lambda params, epoch: report(pool, params, epoch) if report is not None else None)
        rule.finish()
        final[rank] = stacked(pool)
        extra[rank] = after_finish(comm, pool, rule) if after_finish is not None else None
        rule.sync_state()
        params = rule.eval_params()
        evals[rank] = None if params is None else params.numpy().copy()

    InProcessWorld(size, timeout_s=timeout_s, ranks_per_node=ranks_per_node).run(body)
    return WorldRun(pools, rules, built, bound, grads, final, evals, extra)


@pytest.fixture(scope="session")
def openmpi() -> OpenMPIEnv:
    """The Open MPI environment with ULFM that the elastic tests start their jobs in
    (:mod:`openmpi_env`); skips the test, saying why, where there is none."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    return OpenMPIEnv(OPENMPI_VENV)
