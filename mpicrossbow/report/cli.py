"""``crossbow-report RUN_FOLDER [RUN_FOLDER ...]``: a picture and a summary of finished runs.

Writes ``report.png`` and ``report.svg`` into each run folder (and ``timeline.png`` beside a
``timeline.json``) and prints each run's summary; with several folders also one figure comparing them
(``--compare``, default ``crossbow-report.png`` here). matplotlib is a dependency of the package, so the
default install can see its runs; where it is missing all the same (an install with ``--no-deps``, an
environment put together by hand), one line says the one command that adds it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import USAGE_EXIT_CODE, UsageError

PROGRAM = "crossbow-report"
#: The line without matplotlib: the install that adds it alone, not the package again.
MISSING = "needs matplotlib (a dependency of mpicrossbow, missing here): pip install matplotlib"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog=PROGRAM, description="Plot and summarise finished runs.")
    parser.add_argument("folders", nargs="+", type=Path, help="run folders (runs/<name>)")
    parser.add_argument(
        "--compare",
        type=Path,
        default=Path("crossbow-report.png"),
        help="the comparison figure (several runs)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Report every folder; 2 with one line on bad input or without matplotlib."""
    args = parse(argv)
    try:
        import matplotlib
    except ImportError:
        sys.stderr.write(f"{PROGRAM}: error: {MISSING}\n")
        return USAGE_EXIT_CODE
    matplotlib.use("Agg")
    from .figure import report_figure
    from .run_data import load_run
    from .summary import summary
    from .timeline_figure import timeline_figure

    try:
        runs = [load_run(folder) for folder in args.folders]
    except UsageError as exc:
        sys.stderr.write(f"{PROGRAM}: error: {exc}\n")
        return USAGE_EXIT_CODE
    for run in runs:
        figure = report_figure([run])
        for suffix in ("png", "svg"):
            figure.savefig(run.folder / f"report.{suffix}", dpi=110)
        sys.stdout.write(summary(run) + f"\n  figure: {run.folder / 'report.png'}\n")
        trace = run.folder / "timeline.json"
        if trace.is_file():
            timeline_figure(json.loads(trace.read_text())["traceEvents"]).savefig(
                trace.with_suffix(".png"), dpi=110
            )
            sys.stdout.write(
                f"  timeline: {trace.with_suffix('.png')} (open {trace.name} in chrome://tracing)\n"
            )
    if len(runs) > 1:
        report_figure(runs).savefig(args.compare, dpi=110)
        sys.stdout.write(f"comparison of {len(runs)} runs: {args.compare}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
