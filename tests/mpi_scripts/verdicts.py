"""The verdict loop of the MPI check scripts: every rank runs each named check, rank 0 prints each verdict.

The ranks' outcomes are gathered after each check, so a line names every rank that failed (``CHECK
<label>.<name> OK``, ``SKIP <why>`` when every rank raised :class:`unittest.SkipTest`, or ``FAIL rank r:
<error>; ...``, parsed by ``conftest.verdicts``) and the next check starts with every rank present. ``DONE``
ends the output; the exit status is non-zero on every rank if a check failed anywhere.
"""

from __future__ import annotations

import sys
import time
import traceback
import unittest
from collections.abc import Callable, Iterable

from mpi4py import MPI

from mpicrossbow.launch.failure import ABORT_GRACE_S

WORLD = MPI.COMM_WORLD


def say(line: str) -> None:
    """Print ``line`` on rank 0 only."""
    if WORLD.rank == 0:
        print(line, flush=True)


def run_checks(label: str, checks: Iterable[tuple[str, Callable[[], object]]]) -> bool:
    """Run each check on every rank and say its verdict as ``CHECK <label>.<name>``; True when no rank
    failed a check."""
    all_ok = True
    for name, check in checks:
        try:
            check()
            outcome = ("OK", "")
        except unittest.SkipTest as exc:
            outcome = ("SKIP", str(exc))
        except Exception as exc:
            outcome = ("FAIL", f"{type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
        outcomes = WORLD.allgather(outcome)
        kinds = {kind for kind, _ in outcomes}
        if kinds == {"OK"}:
            verdict = "OK"
        elif kinds == {"SKIP"}:
            verdict = f"SKIP {outcomes[0][1]}"
        else:  # a failure, or ranks that disagree whether the check applies
            why = [
                f"rank {r}: {'skipped: ' if k == 'SKIP' else ''}{w}" for r, (k, w) in enumerate(outcomes) if w
            ]
            verdict = "FAIL " + "; ".join(why)
        all_ok = all_ok and not verdict.startswith("FAIL")
        say(f"CHECK {label}.{name} {verdict}")
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
        time.sleep(ABORT_GRACE_S)  # the launcher forwards output through pipes and drops what is in flight
        WORLD.Abort(3)
