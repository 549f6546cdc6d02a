"""The link between replica groups (:mod:`mpicrossbow.comm.group_link`) with real processes: three group
leaders (tests/group_link_job.py) sum ``[group + 1, 1]`` 30 times over Gloo and a TCPStore on 127.0.0.1.
What a lost node needs of it: a group killed, or frozen (no FIN: a node cut off), costs that group only,
the survivors summing again within seconds, every sum over the quorum it reports; a slow group is not
dropped; a lost rendezvous ends every survivor with one line, never a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from slurm_cluster import free_ports

from conftest import REPO

pytestmark = pytest.mark.slow

GROUPS, SUMS = 3, 30
#: Every group's value is ``group + 1``: the sum over a quorum of groups.
FULL = [6.0, 3.0]


def leader(
    port: int, group: int, out: Path, sums: int = SUMS, kill_after: int = -1, slow_after: int = -1,
    slow_s: float = 0.0,
) -> subprocess.Popen:  # fmt: skip
    """One leader's process (tests/group_link_job.py), writing its sums to ``out``."""
    args = [sys.executable, str(REPO / "tests" / "group_link_job.py"), "127.0.0.1", str(port), str(group),
            str(GROUPS), str(sums), str(out), str(kill_after), str(slow_after), str(slow_s)]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)  # fmt: skip


@contextmanager
def leaders(
    tmp_path: Path, kill_after: int = -1, slow_after: int = -1, slow_s: float = 0.0, sums: int = SUMS
) -> Iterator[list]:
    """The three leaders' processes (group 2 killing itself after ``kill_after`` sums, or sleeping
    ``slow_s`` once after ``slow_after``), and the port of the rendezvous; every process in the list (the
    test may add one) killed on the way out."""
    (port,), procs = free_ports(1), []
    for g in range(GROUPS):
        two = g == 2
        procs.append(leader(port, g, tmp_path / f"sums{g}.json", sums, kill_after if two else -1,
                            slow_after if two else -1, slow_s))  # fmt: skip
        if g == 0:
            time.sleep(0.5)  # the rendezvous first
    try:
        yield procs, port
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    """The leader's exit status and stderr once it ended."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def rows(tmp_path: Path, group: int) -> list[dict]:
    """The JSON lines a leader wrote."""
    return [json.loads(line) for line in (tmp_path / f"sums{group}.json").read_text().splitlines()]


def test_without_a_loss_every_sum_is_over_the_three_groups(tmp_path: Path) -> None:
    with leaders(tmp_path) as (procs, _):
        ended = [finish(p) for p in procs]
    assert all(code == 0 for code, _ in ended), ended
    for g in range(GROUPS):
        sums = rows(tmp_path, g)
        assert sums[-1] == {"end": SUMS}
        assert all(r["sum"] == FULL and r["groups"] == [0, 1, 2] for r in sums[:-1])


def test_a_killed_group_costs_itself_only_and_the_others_sum_again_within_seconds(tmp_path: Path) -> None:
    """Group 2 SIGKILLed after 10 sums: groups 0 and 1 do all 30, the first 10 over three groups, the rest
    over two (sum 10 done again without group 2), one line naming the lost group; the gap under 5 s."""
    with leaders(tmp_path, kill_after=10) as (procs, _):
        ended = [finish(p) for p in procs]
    assert [code for code, _ in ended] == [0, 0, -signal.SIGKILL], ended
    line = f"link: group(s) 2 on {socket.gethostname()} lost at sum 10; 2 group(s) go on (era 1"
    assert line in ended[0][1]
    for g in (0, 1):
        sums = rows(tmp_path, g)
        assert sums[-1] == {"end": SUMS}
        assert [r["sum"] for r in sums[:10]] == [FULL] * 10
        assert [(r["sum"], r["groups"]) for r in sums[10:-1]] == [([3.0, 2.0], [0, 1])] * 20
        assert sums[10]["t"] - sums[9]["t"] < 5.0


def test_a_group_back_after_its_loss_joins_at_a_commit_and_takes_a_peers_state(tmp_path: Path) -> None:
    """Group 2 SIGKILLed after 10 of 200 sums, then started again (its job restarted, on a spare node): it
    finds the run under way, asks to join, and group 0's leader admits it at the next commit. It takes group
    0's state (handed over at the sum it joined at) and sums from there to the end with the others: every
    sum after its return over the three groups again, none done twice or without it, one line each side."""
    sums = 200
    with leaders(tmp_path, kill_after=10, sums=sums) as (procs, port):
        assert procs[2].wait(timeout=60) == -signal.SIGKILL
        restarted = time.monotonic()
        procs.append(leader(port, 2, tmp_path / "back2.json", sums))
        ended = [finish(p) for p in (procs[0], procs[1], procs[3])]
    assert [code for code, _ in ended] == [0, 0, 0], ended
    back = [json.loads(line) for line in (tmp_path / "back2.json").read_text().splitlines()]
    at = back[0]["at"]
    assert back[0] == {"healed": {"from": 0, "at": at}, "at": at}, back[0]
    assert 10 < at < sums, back[0]
    assert [r["n"] for r in back[1:-1]] == list(range(at + 1, sums + 1)) and back[-1] == {"end": sums}
    assert all(r["sum"] == FULL and r["groups"] == [0, 1, 2] for r in back[1:-1])
    assert back[1]["t"] - restarted < 30.0, "joined within seconds of its start"
    for g in (0, 1):
        rows_g = rows(tmp_path, g)
        assert [r["n"] for r in rows_g[:-1]] == list(range(1, sums + 1)) and rows_g[-1] == {"end": sums}
        # sums 1-10 over three; 11 (10 done again without group 2) to ``at`` over two; then three again
        two = [[3.0, 2.0]] * (at - 10)
        assert [r["sum"] for r in rows_g[:-1]] == [FULL] * 10 + two + [FULL] * (sums - at)
        # the sum that admitted it: over two groups, the quorum it returned (the one after it) three
        assert rows_g[at - 1]["groups"] == [0, 1, 2] and all(r["groups"] == [0, 1, 2] for r in rows_g[at:-1])
    assert f"link: group(s) 2 back at sum {at} (era 2: groups [0, 1, 2])" in ended[0][1]
    assert (
        f"link: group 2 back in era 2 at sum {at} (groups [0, 1, 2]); its state comes from group 0"
        in (ended[2][1])
    )


def test_a_frozen_group_is_dropped_by_its_heartbeat(tmp_path: Path) -> None:
    """Group 2 stopped (SIGSTOP: its sockets stay open, as a node cut off) once it summed 10 times: the
    others notice its silent heartbeat and go on over two groups."""
    with leaders(tmp_path) as (procs, _):
        path = tmp_path / "sums2.json"
        deadline = time.monotonic() + 60
        while (not path.exists() or len(path.read_text().splitlines()) < 10) and time.monotonic() < deadline:
            time.sleep(0.01)
        procs[2].send_signal(signal.SIGSTOP)
        ended = [finish(p) for p in procs[:2]]
        procs[2].send_signal(signal.SIGKILL)
    assert [code for code, _ in ended] == [0, 0], ended
    for g in (0, 1):
        sums = rows(tmp_path, g)
        assert sums[-1] == {"end": SUMS}
        lost = [i for i, r in enumerate(sums[:-1]) if r["groups"] == [0, 1]]
        assert lost and lost == list(range(lost[0], SUMS)), sums
        assert all(r["sum"] == [3.0, 2.0] for r in sums[lost[0] : -1])
        assert sums[lost[0]]["t"] - sums[lost[0] - 1]["t"] < 5.0


def test_a_slow_group_whose_heartbeat_goes_on_is_kept(tmp_path: Path) -> None:
    """Group 2 sleeps 3 s once (twice the 1.5 s after which a silent heartbeat counts as lost): no loss."""
    with leaders(tmp_path, slow_after=5, slow_s=3.0) as (procs, _):
        ended = [finish(p) for p in procs]
    assert all(code == 0 for code, _ in ended), ended
    for g in range(GROUPS):
        assert all(r["sum"] == FULL for r in rows(tmp_path, g)[:-1])


def test_a_lost_rendezvous_ends_every_survivor_with_one_line(tmp_path: Path) -> None:
    """Group 0's leader (the TCPStore) SIGKILLed mid-run: groups 1 and 2 end with status 3 and the line
    naming the rendezvous, within seconds."""
    with leaders(tmp_path) as (procs, _):
        path = tmp_path / "sums0.json"
        deadline = time.monotonic() + 60
        while (not path.exists() or len(path.read_text().splitlines()) < 5) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(procs[0].pid, signal.SIGKILL)
        cut = time.monotonic()
        ended = [finish(p, timeout=30) for p in procs[1:]]
        took = time.monotonic() - cut
    for code, err in ended:
        # the last line ours, no Python traceback (torch's own C++ warning of the broken store comes first)
        assert code == 3 and err.splitlines()[-1].startswith(
            "link: the rendezvous on group 0's leader is gone"
        ), (code, err[-3000:])
        assert "Traceback" not in err, err
    assert took < 10.0


def test_a_group_that_never_starts_is_named_in_one_line() -> None:
    """Group 0 of two alone (group 1's job failed before the link, or was given another address): its
    leader ends with one line naming group 1 once ``start_s`` has passed, not after Gloo's timeout."""
    from mpicrossbow.comm.group_link import GroupLink, GroupLost

    (port,) = free_ports(1)
    start = time.monotonic()
    with pytest.raises(GroupLost) as lost:
        GroupLink("127.0.0.1", port, 0, 2, start_s=1.0)
    assert time.monotonic() - start < 10
    assert str(lost.value) == (
        f"link: group(s) 1 of 2 never reached the rendezvous on 127.0.0.1:{port} within 1 s: start every "
        "group's job with the same [link] address and groups"
    )


def test_a_group_back_where_the_run_takes_none_back_ends_at_once_in_one_line() -> None:
    """A link whose caller cannot take a peer's state (``admit`` off; crossbow-launch's groups admit): a
    leader of group 1 that starts while the run is under way ends at once with one line, not after a wait,
    and the two groups' leaders go on."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from mpicrossbow.comm.group_link import GroupLink, GroupLost

    (port,) = free_ports(1)
    with ThreadPoolExecutor(2) as pool:
        links = list(pool.map(lambda g: GroupLink("127.0.0.1", port, g, 2), range(2)))
        start = time.monotonic()
        with pytest.raises(GroupLost) as back:
            GroupLink("127.0.0.1", port, 1, 2)
        assert time.monotonic() - start < 5
        sums = list(pool.map(lambda link: link.allreduce(torch.ones(1)).groups, links))
        list(pool.map(lambda link: link.close(), links))
    assert str(back.value) == (
        "link: group 1 came back to a run under way, which takes no group back: this job ends, the other "
        "groups train on"
    )
    assert sums == [(0, 1), (0, 1)]


def test_a_group_started_again_after_the_run_ended_ends_within_its_bound_in_one_line() -> None:
    """A lost group's job started again (``restarted``, as groups.sbatch does) just as the run ended: no
    rendezvous listens any more, and its leader ends after ``restart_connect_s`` with one line, not after the
    store's connection timeout and its retries (a minute); a first start would wait for group 0."""
    from mpicrossbow.comm.group_link import GroupLink, GroupLost

    (port,) = free_ports(1)
    start = time.monotonic()
    with pytest.raises(GroupLost) as ended:
        GroupLink("127.0.0.1", port, 1, 2, restarted=True, restart_connect_s=1.0)
    assert time.monotonic() - start < 5
    assert str(ended.value) == (
        f"link: group 1 started again, but the rendezvous on 127.0.0.1:{port} was not there within 1 s: the "
        "run has ended, nothing left to train"
    )


def test_close_twice_after_group_0_ended_the_rendezvous_returns_at_once() -> None:
    """A member's second ``close`` (the communicator contract allows it) after group 0's leader, seeing every
    member gone, ended the rendezvous: it returns, where it once asked the store that is gone and raised
    GroupLost (the linked communicator's contract check failed so under load)."""
    from concurrent.futures import ThreadPoolExecutor

    from mpicrossbow.comm.group_link import GroupLink

    (port,) = free_ports(1)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda g: GroupLink("127.0.0.1", port, g, 2), range(2))
    second.close()
    first.close()  # every member left: group 0's leader ends, and its store with it
    del first
    start = time.monotonic()
    second.close()
    assert time.monotonic() - start < 1
