"""What benchmarks/gpu.sh and benchmarks/gpu_device.sh ask Python for: whether CUDA is here, the versions of
everything a GPU run depends on, and the sections of results/gpu.md that are not a benchmark's own table (the
run's header with the CUDA tests' outcome, a step that failed or ran out of time). Also the one place that
defines the command line a lent GPU machine runs and the carry list that goes with it (benchmarks/README.md
quotes both; tests/test_gpu_carry.py checks that it does).

    python -m benchmarks.gpu cuda                                  # prints 1 with a CUDA device, else 0
    python -m benchmarks.gpu versions                              # torch, CUDA, NCCL, MPI, hwloc, ...
    python -m benchmarks.gpu device-command                        # the command line and the carry list
    python -m benchmarks.gpu header --tests "11 passed in 40s" --tests-rc 0
    python -m benchmarks.gpu note --step "pool, ResNet-50" --rc 124 --limit 180

The tables themselves come from ``benchmarks.pool``, ``benchmarks.ddp``, ``benchmarks.exchange`` and
``benchmarks.gpu_train`` run with ``--device cuda --out gpu``; each appends its own section (command,
versions with CUDA, driver and GPU names).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable

from benchmarks.report import append_result, gpu_versions, versions

#: The file under benchmarks/results/ that gpu.sh writes.
OUT = "gpu"
#: Exit statuses of ``timeout`` that mean the step ran out of time (TERM sent; KILL after the grace period).
TIMED_OUT = (124, 137)

#: The one command line a lent GPU machine runs, from the repository root of its copy of the working tree
#: ($OUT: the folder whose files come back). benchmarks/README.md quotes it.
DEVICE_COMMAND = 'bash benchmarks/gpu_device.sh "$OUT"'
#: The ignored paths that travel with the working tree to that machine (benchmarks/gpu_carry.sh fills them).
CARRY = (".gpu-carry",)
#: The most the carried paths may hold together (benchmarks/gpu_carry.sh fails at this size).
CARRY_LIMIT_BYTES = 64 * 2**20
#: The most characters that command line may have.
COMMAND_LIMIT = 2000


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options: one sub-command (cuda, header, note) and its values."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("cuda", help="print 1 when torch sees a CUDA device, else 0")
    sub.add_parser("versions", help="print the versions a GPU run depends on, one per line")
    sub.add_parser("device-command", help="print the GPU machine's command line, then the carry list as JSON")
    header = sub.add_parser("header", help="append the run's header section")
    header.add_argument("--tests", default="", help="pytest's summary line of the CUDA tests")
    header.add_argument("--tests-rc", type=int, default=0, help="pytest's exit status")
    note = sub.add_parser("note", help="append a note that a step failed or ran out of time")
    note.add_argument("--step", required=True, help="the step's name")
    note.add_argument("--rc", type=int, required=True, help="its exit status (124/137: timed out)")
    note.add_argument("--limit", type=int, required=True, help="its time limit in seconds")
    return parser.parse_args(argv)


def header_text(tests: str, tests_rc: int) -> str:
    """The header section's body: how the CUDA tests ended, and what the sections after it are."""
    outcome = "passed (or skipped)" if tests_rc == 0 else f"FAILED (pytest exit status {tests_rc})"
    if tests.startswith("not run"):  # GPU_SH_STEPS left them out
        outcome = "left out"
    return (
        f"CUDA tests (`pytest -m cuda tests`): {outcome}; {tests.strip() or 'no summary line'}.\n\n"
        "The sections below, up to the next gpu.sh header, are this run's GPU tables, in the order gpu.sh "
        "runs its steps (GPU_SH_STEPS names those it ran): one short training run per engine against the "
        "CPU's accuracy (train), the allreduce of a CUDA buffer (exchange), the engines with CUDA graphs "
        "against without (graphs, streams), learners per GPU without graphs (learners), bf16 against fp32 "
        "(precision), BSP against DDP over NCCL (ddp), the showdown against plain PyTorch (tta) and the "
        "engines on ResNet-50 (resnet50). A step that failed or ran out of time has a note instead of its "
        "table."
    )


def note_text(step: str, rc: int, limit: int) -> str:
    """One line saying that ``step`` ran out of its ``limit`` seconds or failed with ``rc``; ``limit`` 0: it
    was not started, gpu.sh's whole time budget being spent."""
    if limit <= 0:
        return f"{step}: not started, gpu.sh's time budget (GPU_SH_SECONDS) was spent; its table is missing."
    if rc in TIMED_OUT:
        return f"{step}: stopped after its limit of {limit} s (exit status {rc}); its table is missing."
    return f"{step}: failed with exit status {rc}; its table is missing (see gpu.sh's output)."


def _torch() -> str:
    """torch's version, where it was imported from, and what it sees of CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    bf16 = f", bf16 supported: {torch.cuda.is_bf16_supported()}" if cuda else ""
    return f"{torch.__version__} from {torch.__file__}; CUDA available: {cuda}{bf16}"


def _mpi() -> str:
    """mpi4py's version and the MPI library it loaded (importing mpi4py.MPI initialises nothing)."""
    import mpi4py
    from mpi4py import MPI

    library = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    return f"mpi4py {mpi4py.__version__} from {mpi4py.__file__}; {library}"


def _mpiexec() -> str:
    """The launcher tests and benchmarks start: the one next to the interpreter, else the first on PATH."""
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec", "mpirun"):
        if os.path.exists(os.path.join(here, name)):
            return os.path.join(here, name)
    return shutil.which("mpiexec") or shutil.which("mpirun") or "none"


def _module(name: str) -> Callable[[], str]:
    """A probe of one importable module's version."""

    def probe() -> str:
        module = __import__(name)
        return str(getattr(module, "__version__", "importable (no __version__)"))

    return probe


def _lstopo() -> str:
    """hwloc's lstopo as the launcher finds it, or none."""
    from mpicrossbow.launch.topology import find_lstopo

    return find_lstopo() or "none"


def versions_report() -> str:
    """One line per thing a GPU run depends on; a probe that fails says why instead of stopping the rest."""
    probes: list[tuple[str, Callable[[], str]]] = [
        ("python", lambda: f"{platform.python_version()} ({sys.executable})"),
        ("torch", _torch),
        ("cuda", gpu_versions),
        ("mpi", _mpi),
        ("mpiexec", _mpiexec),
        ("lstopo", _lstopo),
        *((name, _module(name)) for name in ("numpy", "h5py", "PIL", "tqdm", "pytest", "mpicrossbow")),
    ]
    lines = []
    for name, probe in probes:
        try:
            value = probe()
        except Exception as exc:  # a missing or broken package is what this reports
            value = f"unavailable: {type(exc).__name__}: {exc}"
        lines.append(f"{name}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.what == "cuda":
        import torch

        print(int(torch.cuda.is_available()))
        return 0
    if args.what == "versions":
        print(versions_report())
        return 0
    if args.what == "device-command":
        print(DEVICE_COMMAND)
        print(json.dumps(list(CARRY)))
        return 0
    line = f"{versions()}; {gpu_versions()}"
    if args.what == "header":
        append_result(OUT, "benchmarks/gpu.sh", header_text(args.tests, args.tests_rc), versions_line=line)
    else:
        text = note_text(args.step, args.rc, args.limit)
        append_result(OUT, f"gpu.sh step not measured: {args.step}", text, versions_line=line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
