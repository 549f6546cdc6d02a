"""What the MPI check scripts share: every rank runs each named check; rank 0 prints one verdict per check.

The ranks' errors are gathered after each check, so a line names every rank that failed (``CHECK <name> OK``
or ``CHECK <name> FAIL rank r: <error>; ...``, parsed by the pytest side) and the next check starts with every
rank present. ``DONE`` ends the output; the exit status is non-zero on every rank if a check failed anywhere.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterable

from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def say(line: str) -> None:
    """Print ``line`` on rank 0 only."""
    if WORLD.rank == 0:
        print(line, flush=True)


def run_checks(label: str, checks: Iterable[tuple[str, Callable[[], object]]]) -> bool:
    """Run each check on every rank and say its verdict as ``CHECK <label>.<name>`` (``<name>`` when the label
    is empty); True when every rank passed every check."""
    all_ok = True
    for name, check in checks:
        try:
            check()
            why = ""
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        failures = [(r, w) for r, w in enumerate(WORLD.allgather(why)) if w]
        all_ok = all_ok and not failures
        verdict = "OK" if not failures else "FAIL " + "; ".join(f"rank {r}: {w}" for r, w in failures)
        say(f"CHECK {f'{label}.' if label else ''}{name} {verdict}")
    return all_ok


def finish(ok: bool) -> int:
    """Say ``DONE``; the exit status: 0 when every rank's checks passed."""
    say("DONE")
    return 0 if WORLD.allreduce(int(not ok)) == 0 else 1


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s status; an exception outside the checks aborts the whole job, so no rank is left
    waiting in a collective for the one that raised."""
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        WORLD.Abort(3)
