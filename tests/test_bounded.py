"""tests/bounded.py: a test's job that hangs ends whole, and its failure says where each process was."""

from __future__ import annotations

import os
import sys
import time

import pytest

from bounded import JobTimedOut, py_spy, run_bounded

pytestmark = pytest.mark.quick

#: A parent that starts a child and both wait in a function whose name the stacks must show.
HANGS = """
import subprocess, sys, time
def waiting_for_a_peer_that_never_answers():
    time.sleep(600)
child = subprocess.Popen([sys.executable, "-c", "import time; print('child', flush=True); time.sleep(600)"])
print("parent", child.pid, flush=True)
waiting_for_a_peer_that_never_answers()
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is no zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_hung_job_is_killed_whole_and_its_stacks_are_in_the_failure() -> None:
    """Past its timeout the parent and its child are both gone, the message shows the output so far, and
    (where py-spy can read the processes) the function the parent waited in."""
    started = time.monotonic()
    with pytest.raises(JobTimedOut) as caught:
        run_bounded([sys.executable, "-c", HANGS], timeout=3, cwd=os.getcwd(), env=os.environ)
    message = str(caught.value)
    assert "timed out after 3 s" in message
    assert "parent" in message and "child" in message, message
    child = int(message.split("parent ", 1)[1].split()[0])
    assert not alive(child), f"the job's child {child} outlived the timeout"
    assert time.monotonic() - started < 3 + 2 * 20, "the stacks and the kill took too long"
    if py_spy() is None:
        pytest.skip("py-spy is not installed (the test extra brings it)")
    if "Permission denied" in caught.value.stacks or "ptrace" in caught.value.stacks.lower():
        pytest.skip(f"py-spy may not read other processes here: {caught.value.stacks[-300:]}")
    assert "waiting_for_a_peer_that_never_answers" in caught.value.stacks, caught.value.stacks


def test_a_job_that_ends_in_time_returns_its_status_and_output() -> None:
    """No timeout: the exit status and both streams come back as ``subprocess.run`` gives them."""
    done = run_bounded(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        timeout=60,
        cwd=os.getcwd(),
        env=os.environ,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
