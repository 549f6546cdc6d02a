"""launch/lost_hosts.py: which hosts of a failed multi-node job still answer, asked the launcher's way."""

from __future__ import annotations

import time
from pathlib import Path

from mpicrossbow.launch.lost_hosts import lost_hosts, lost_line, reach_command


def test_the_launchers_own_agent_is_used_before_ssh() -> None:
    assert reach_command("n2", {"HYDRA_LAUNCHER_EXEC": "/x/enter -q"}) == ["/x/enter", "-q", "n2", "true"]
    assert reach_command("n2", {"OMPI_MCA_plm_rsh_agent": "rsh"}) == ["rsh", "n2", "true"]
    ssh = reach_command("n2", {})
    assert ssh[0] == "ssh" and "BatchMode=yes" in ssh and ssh[-2:] == ["n2", "true"]


def test_hosts_that_fail_or_hang_are_lost_and_asked_at_once(tmp_path: Path) -> None:
    """An agent that answers for up, fails for down and hangs for hung: the last two are lost, in the
    job's host order, after one timeout (not one per host)."""
    agent = tmp_path / "agent"
    agent.write_text('#!/bin/sh\ncase "$1" in up) exit 0 ;; down) exit 255 ;; *) sleep 30 ;; esac\n')
    agent.chmod(0o755)
    started = time.monotonic()
    lost = lost_hosts(["hung", "up", "down", "up"], {"HYDRA_LAUNCHER_EXEC": str(agent)}, timeout=1.0)
    assert lost == ["hung", "down"]
    assert time.monotonic() - started < 5


def test_the_line_names_every_lost_host() -> None:
    assert lost_line(255, ["node2"]).startswith("the job ended with status 255 and node2 no longer answers (")
    assert "node2, node3 no longer answer (" in lost_line(255, ["node2", "node3"])
