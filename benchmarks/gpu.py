"""What benchmarks/gpu.sh asks Python for: whether CUDA is here, and the sections of results/gpu.md that are
not a benchmark's own table (the run's header with the CUDA tests' outcome, a step that failed or ran out of
time).

    python -m benchmarks.gpu cuda                                  # prints 1 with a CUDA device, else 0
    python -m benchmarks.gpu header --tests "11 passed in 40s" --tests-rc 0
    python -m benchmarks.gpu note --step "pool, ResNet-50" --rc 124 --limit 180

The tables themselves come from ``benchmarks.pool``, ``benchmarks.ddp`` and ``benchmarks.exchange`` run with
``--device cuda --out gpu``; each appends its own section (command, versions with CUDA, driver and GPU names).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.report import append_result, gpu_versions, versions

#: The file under benchmarks/results/ that gpu.sh writes.
OUT = "gpu"
#: Exit statuses of ``timeout`` that mean the step ran out of time (TERM sent; KILL after the grace period).
TIMED_OUT = (124, 137)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options: one sub-command (cuda, header, note) and its values."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("cuda", help="print 1 when torch sees a CUDA device, else 0")
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
    return (
        f"CUDA tests (`pytest -m cuda tests`): {outcome}; {tests.strip() or 'no summary line'}.\n\n"
        "The sections below, up to the next gpu.sh header, are this run's GPU tables: the pool engines "
        "(serial, fused, streams) on ResNet-20 and ResNet-50, BSP against DDP over NCCL, and the allreduce "
        "of a CUDA buffer. CUDA graphs are not captured by any engine yet."
    )


def note_text(step: str, rc: int, limit: int) -> str:
    """One line saying that ``step`` ran out of its ``limit`` seconds or failed with ``rc``; ``limit`` 0: it
    was not started, gpu.sh's whole time budget being spent."""
    if limit <= 0:
        return f"{step}: not started, gpu.sh's time budget (GPU_SH_SECONDS) was spent; its table is missing."
    if rc in TIMED_OUT:
        return f"{step}: stopped after its limit of {limit} s (exit status {rc}); its table is missing."
    return f"{step}: failed with exit status {rc}; its table is missing (see gpu.sh's output)."


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.what == "cuda":
        import torch

        print(int(torch.cuda.is_available()))
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
