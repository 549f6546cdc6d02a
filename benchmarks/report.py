"""What every benchmark shares: re-launching itself under MPI, describing the machine, writing results.

Results are appended to ``benchmarks/results/<name>.md`` with the date, the exact command, library versions
and a hostname-free machine description, so a figure can always be traced to how it was measured.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def add_seconds_argument(parser: Any, what: str) -> None:
    """``--seconds``, the command's time limit: by default gpu.sh's limit for the step running it
    (``GPU_SH_STEP_SECONDS``), else none (0). gpu.sh kills a step at its limit, so a script that reads it
    stops early enough to write what it measured; ``what`` says what the script does with it."""
    parser.add_argument(
        "--seconds",
        type=float,
        default=float(os.environ.get("GPU_SH_STEP_SECONDS") or 0),
        help=f"{what} (default: gpu.sh's step limit GPU_SH_STEP_SECONDS, else no limit)",
    )


def under_mpi() -> bool:
    """True when an MPI launcher started this process."""
    return any(v in os.environ for v in LAUNCHER_VARS)


def relaunch(module: str, ranks: int, argv: list[str], timeout_s: float = 1800) -> int:
    """Run ``python -m module argv`` again under the mpiexec next to the interpreter (else on PATH), from
    the repository root; its exit status. Benchmarks run as modules (``python -m benchmarks.NAME``)."""
    here = Path(sys.executable).parent
    launcher = next((str(here / n) for n in ("mpiexec", "mpirun") if (here / n).exists()), None)
    launcher = launcher or shutil.which("mpiexec") or shutil.which("mpirun")
    if launcher is None:
        sys.exit("no mpiexec next to the interpreter or on PATH; run under your MPI launcher")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    env["MPICROSSBOW_BENCH_COMMAND"] = shlex.join(["python", "-m", module, *argv])
    cmd = [launcher, "-n", str(ranks), sys.executable, "-m", module, *argv]
    return subprocess.run(cmd, env=env, cwd=REPO, timeout=timeout_s).returncode


def cfg_runs(
    folder: Path,
    ranks: int,
    runs: list[str],
    common: list[str],
    timeout_s: float,
    what: str,
    launch: Callable[[str, list[str]], list[str]] | None = None,
) -> dict[str, float]:
    """Train ``runs`` (``LABEL=CFG,override,...``) one after another in one ``mpiexec -n ranks`` job of
    tests/mpi_scripts/cfg_runs.py (torch starts once per rank; ``crossbow-launch``'s own code path), every run
    with the ``common`` overrides too, each into ``folder/LABEL``; label → final validation accuracy. A failed
    job is a RuntimeError naming ``what`` with the end of its stderr. ``launch(mpiexec, argv)`` builds the
    whole command line instead of ``mpiexec -n ranks argv`` (across namespace nodes, say)."""
    here = Path(sys.executable).parent / "mpiexec"
    launcher = str(here) if here.exists() else "mpiexec"
    script = REPO / "tests" / "mpi_scripts" / "cfg_runs.py"
    argv = [sys.executable, str(script), str(folder), *runs, "--", *common]
    cmd = launch(launcher, argv) if launch else [launcher, "-n", str(ranks), *argv]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or "DONE" not in proc.stdout:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RAN "):
            _, label, accuracy = line.split()
            found[label] = float(accuracy)
    return found


def command() -> str:
    """The command line the user typed (as passed down by :func:`relaunch`), quoted so that it reruns as
    written (``--configs 'period 4,period 16'``)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    ran = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return os.environ.get("MPICROSSBOW_BENCH_COMMAND") or shlex.join(["python", *ran, *sys.argv[1:]])


def machine() -> str:
    """CPU model and core counts, without the hostname."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{model}, {os.cpu_count()} logical cores ({usable} usable), {platform.system()} "
        f"{platform.machine()}; 1-minute load average {load:.1f} at the end of the run "
        "(a shared machine: compare ratios, not times)"
    )


def versions() -> str:
    """Python, torch, mpi4py and MPI library versions."""
    import mpi4py
    import torch
    from mpi4py import MPI

    mpi = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()  # Open MPI ends in a NUL
    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, mpi4py {mpi4py.__version__}, {mpi}"
    )


def gpu_versions() -> str:
    """CUDA, cuDNN and NCCL versions as torch was built with, the driver (from ``nvidia-smi`` where it is on
    PATH) and every visible GPU's name and memory; a short note where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    driver = "unknown (no nvidia-smi on PATH)"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
            driver = out.splitlines()[0].strip() if out.strip() else driver
        except (OSError, subprocess.SubprocessError):
            pass
    nccl = "none"
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        built = torch.cuda.nccl.version()  # a tuple (2, 21, 5) in recent torch, an int in older ones
        nccl = ".".join(map(str, built)) if isinstance(built, tuple) else str(built)
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    names = ", ".join(f"{p.name} ({p.total_memory / 2**30:.0f} GiB)" for p in gpus)
    return (
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}, driver {driver}; "
        f"{len(gpus)} GPU(s): {names}"
    )


def append_result(
    name: str, title: str, table: str, notes: str = "", versions_line: str | None = None
) -> Path:
    """Append one dated section (command, versions, machine, table) to ``results/<name>.md``;
    ``versions_line`` replaces the default versions (for benchmarks that use no MPI)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = (
        f"\n## {title} — {stamp}\n\n- command: `{command()}`\n- versions: {versions_line or versions()}\n"
        f"- machine: {machine()}\n\n{table}\n"
    )
    if notes:
        body += f"\n{notes}\n"
    with path.open("a", encoding="utf-8") as f:
        if f.tell() == 0:
            f.write(f"# {name} benchmark results\n")
        f.write(body)
    return path
