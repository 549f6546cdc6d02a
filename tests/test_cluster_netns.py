"""mpicrossbow across real nodes: a 3-node cluster of network namespaces (tests/netns_cluster.py), the data
over veth links, MPICH's hydra launching into the nodes.

One cluster serves the whole module (set-up shared); one mpiexec job trains every rule across 2 nodes × 2
ranks one run after another (tests/mpi_scripts/digits_runs.py), and the link counters show what each run
moved between the nodes. Skips without root or ``ip``/``unshare``/``nsenter``/``tc``.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from digits_rules import DIGITS_RULES, DIGITS_SHORT, DIGITS_TARGET
from netns_cluster import NetnsCluster, drill_settings, leftovers, missing_reason

from benchmarks.node_loss import drill
from conftest import REPO, assert_loads_whole, epoch_of, find_mpiexec, launcher, mpi_env, only_run
from mpicrossbow.training.checkpoints.checkpoint_files import complete_checkpoints as checkpoint_folders
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

SCRIPTS = Path(__file__).parent / "mpi_scripts"
#: label → overrides of launch/digits.cfg, for 2 nodes × 2 ranks: every rule, the hierarchical stages, GSP
#: with a group per node, and Gloo.
RULES = {
    "BSP": "RULE=BSP",
    "BSP-gloo": "RULE=BSP,comm.backend=gloo",
    "SMA": "RULE=SMA",
    "SMA-m2": "RULE=SMA,pool.learners=2",
    "EASGD": "RULE=EASGD",
    **{label: rule for label, rule in DIGITS_RULES[4].items() if label != "GSP-auto"},
    "POSTLOCALSGD": "RULE=POSTLOCALSGD",
    "GSP-nodes": "RULE=GSP,rule.groups={groups}",
}
#: the 4-rank digits target of the one-node tests
TARGET = DIGITS_TARGET[4]


def run_at_head(cluster: NetnsCluster, argv: list[str], timeout: float, env: dict[str, str] | None = None):
    """``argv`` (an mpiexec line built by the cluster) with the test environment, bounded."""
    return subprocess.run(
        argv, cwd=REPO, env=mpi_env(env), capture_output=True, text=True, timeout=timeout
    )  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    """Three nodes for the module; removed at its end (the test of a failed start checks for leftovers)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    if find_mpiexec() is None:
        pytest.skip("no mpiexec")
    made = NetnsCluster(3)
    started = time.perf_counter()
    made.start()
    made.up_seconds = time.perf_counter() - started  # type: ignore[attr-defined]
    try:
        yield made
    finally:
        made.stop()


def test_three_nodes_start_in_seconds_and_mpi_sees_three_hosts(cluster: NetnsCluster) -> None:
    assert cluster.up_seconds < 5.0  # type: ignore[attr-defined]
    proc = run_at_head(cluster, cluster.mpiexec(find_mpiexec() or "", 2, ["hostname"]), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split()) == ["node1", "node1", "node2", "node2", "node3", "node3"]


def test_a_failed_start_and_a_stop_leave_nothing_behind() -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    broken = NetnsCluster(2, rate="no-such-rate")  # tc refuses it after the nodes are up
    with pytest.raises(RuntimeError, match="tc"):
        broken.start()
    mine = [item for item in leftovers() if broken.ident in item or str(broken.root) in item]
    assert mine == [] and not broken.root.exists()
    fine = NetnsCluster(2).start()
    holders = [n.pid for n in fine.members]
    fine.stop()
    assert [item for item in leftovers() if fine.ident in item or str(fine.root) in item] == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in holders)


#: tests/netns_cluster.py run as a script, as docs/cluster.md has a user start it by hand
BY_HAND = [sys.executable, str(Path(__file__).parent / "netns_cluster.py"), "--nodes", "2"]
#: the line the script ends with: why, the holders by node, the namespaces, the folder
REMOVED = re.compile(
    r"^netns_cluster: (?P<why>.+?): removed holder pids (?P<holders>(node\d [\d ]+(, )?)+) "
    r"\(each node's processes and /dev/shm with them\); namespaces (?P<namespaces>[\w ]+); "
    r"folder (?P<folder>\S+)$",
    re.MULTILINE,
)


def _read_lines(stream: IO[str], lines: list[str]) -> None:
    """Every line of ``stream`` appended to ``lines`` as it comes (a reader thread's body)."""
    for line in iter(stream.readline, ""):
        lines.append(line)


def _wait_for(lines: list[str], text: str, job: subprocess.Popen[str], timeout: float) -> str:
    """The output so far once ``text`` is in it; fails when ``job`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = "".join(lines)
        if text in out:
            return out
        assert job.poll() is None, f"ended with status {job.returncode}: {out[-2000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {timeout:g} s: {''.join(lines)[-2000:]}")


def _mine(ident: str, root: str) -> list[str]:
    """:func:`leftovers` of one cluster only (other clusters may be up beside it)."""
    own = re.compile(rf"namespace xbc{ident}(sw|hd|n\d+)$")
    return [item for item in leftovers() if own.match(item) or (root and f"{root}/" in item + "/")]


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "--seconds", "a failed start"])
def test_the_cluster_started_by_hand_in_the_background_removes_itself_and_says_what(how: str) -> None:
    """``python tests/netns_cluster.py`` as a background job of a non-interactive shell (SIGINT ignored by
    its parent, so no KeyboardInterrupt would ever come): SIGINT and SIGTERM each end it within seconds, as
    does the end of ``--seconds`` and a start that fails half way (tc refuses the rate after the nodes are
    up); each time status 0 (1 for the failed start), one line naming the holders by node, the namespaces
    and the folder it removed, and nothing of the cluster left. Whatever happens, the test removes what the
    script made."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    extra = {"--seconds": ["--seconds", "1"], "a failed start": ["--rate", "no-such-rate"]}.get(how, [])
    job = subprocess.Popen(
        [*BY_HAND, *extra], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(job.stdout, lines), daemon=True)
    reader.start()
    ident = root = ""
    holders: list[int] = []
    try:
        if how != "a failed start":
            up = _wait_for(lines, "removes it.", job, timeout=30)
            ident = re.search(r"namespace cluster (\d+):", up).group(1)  # type: ignore[union-attr]
            root = re.search(r"(/\S+/xbc-[^/\s]+)/hosts-head", up).group(1)  # type: ignore[union-attr]
            holders = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", up)]
            assert len(holders) == 2, up
            if how.startswith("SIG"):
                os.kill(job.pid, getattr(signal, how))
        sent = time.monotonic()
        status = job.wait(timeout=20)
        waited = time.monotonic() - sent
        reader.join(timeout=5)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=10)
        if ident:  # the script did not clean up after itself: the test does
            NetnsCluster(ident=ident, root=Path(root)).stop()
    out = "".join(lines)
    assert waited < 10, out[-2000:]
    assert status == (1 if how == "a failed start" else 0), out[-2000:]
    assert len(REMOVED.findall(out)) == 1, out[-2000:]
    line = REMOVED.search(out)
    assert line is not None
    by_node = {node: pids.split() for node, pids in re.findall(r"(node\d) ([\d ]+)", line["holders"])}
    why = {"--seconds": "1 s are over", "a failed start": "the start failed (ip netns exec "}.get(how, how)
    assert line["why"].startswith(why), line.group(0)
    nodes = ["n1"]  # the failed start: tc refuses node1's rate before node2 is made
    if how == "a failed start":
        ident = re.search(r"xbc(\d+)sw", line["namespaces"]).group(1)  # type: ignore[union-attr]
        root = line["folder"]
        assert list(by_node) == ["node1"], line.group(0)
    else:
        nodes.append("n2")
        assert [int(by_node["node1"][0]), int(by_node["node2"][0])] == holders, line.group(0)
    assert all(len(pids) == 2 for pids in by_node.values()), line.group(0)  # the holder and its unshare
    assert sorted(line["namespaces"].split()) == sorted(f"xbc{ident}{s}" for s in ("hd", "sw", *nodes))
    assert line["folder"] == root
    assert _mine(ident, root) == [] and not Path(root).exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in holders)


#: A program that holds a cluster the way the benchmarks do (``with started(...)``) until it is signalled.
HELD = (
    "import sys, time; sys.path.insert(0, 'tests')\n"
    "from netns_cluster import NetnsCluster, started\n"
    "with started(NetnsCluster(2)) as cluster:\n"
    "    print(cluster.ident, cluster.root, 'up', flush=True)\n"
    "    time.sleep(120)\n"
)


def test_a_benchmarks_cluster_is_removed_when_the_benchmark_is_sent_sigterm() -> None:
    """benchmarks/links.py and link_slowdown.py hold their cluster in ``started``: SIGTERM (``timeout``, a
    kill by hand) removes it, names what it removed in one line, and exits with 143. A plain
    ``try/finally`` left the namespaces and node holders behind: SIGTERM ends Python before any finally."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    job = subprocess.Popen(
        [sys.executable, "-c", HELD], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(job.stdout, lines), daemon=True)
    reader.start()
    ident = root = ""
    try:
        ident, root, _ = _wait_for(lines, " up", job, timeout=30).split()[-3:]
        job.send_signal(signal.SIGTERM)
        status = job.wait(timeout=20)
        reader.join(timeout=5)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=10)
        if ident:
            NetnsCluster(ident=ident, root=Path(root)).stop()  # what the program left, if anything
    out = "".join(lines)
    assert status == 143, out[-2000:]
    line = REMOVED.search(out)
    assert line is not None and line["why"] == "SIGTERM", out[-2000:]
    assert _mine(ident, root) == [] and not Path(root).exists(), out[-2000:]


def test_each_node_has_its_own_dev_shm_that_goes_with_the_node() -> None:
    """A segment written to /dev/shm in node1 is there in node1 only: not in node2, not on the host. It
    goes with its node: node1 booted again has an empty /dev/shm, and once the cluster stops no process
    is left in the mount namespace that held it (its tmpfs, mounted nowhere else, is released)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    made = NetnsCluster(2).start()
    segment = f"xbc-segment-{made.ident}"
    try:

        def in_node(node: str, script: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                made.node_command(node, ["sh", "-c", script]), capture_output=True, text=True, timeout=20
            )

        assert in_node("node1", f"echo written in node1 > /dev/shm/{segment}").returncode == 0
        assert in_node("node1", f"cat /dev/shm/{segment}").stdout == "written in node1\n"
        assert in_node("node2", f"test -e /dev/shm/{segment}").returncode == 1
        assert not Path("/dev/shm", segment).exists()
        mounts = in_node("node2", "grep ' /dev/shm ' /proc/self/mounts").stdout  # the last one is seen
        assert mounts.splitlines()[-1].startswith("shm /dev/shm tmpfs rw,nosuid,nodev"), mounts
        made.restart_node("node1")
        assert in_node("node1", f"test -e /dev/shm/{segment}").returncode == 1
        assert in_node("node1", f"echo again > /dev/shm/{segment}").returncode == 0
        namespace = os.readlink(f"/proc/{made.node('node1').pid}/ns/mnt")
    finally:
        made.stop()
    assert not Path("/dev/shm", segment).exists()
    assert _mine(made.ident, str(made.root)) == []
    holding = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns" / "mnt") == namespace:
                holding.append(proc.name)
        except OSError:
            continue
    assert holding == []


@pytest.fixture(scope="module")
def every_rule(
    cluster: NetnsCluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, int]]:
    """One mpiexec across node1 and node2, 2 ranks each: every run of :data:`RULES`, with each run's bytes on
    node1's and node2's links."""
    out = tmp_path_factory.mktemp("nodes")
    groups = out / "groups"
    groups.write_text("node1\nnode2\n", encoding="utf-8")
    runs = [f"{label}={spec.format(groups=groups)}" for label, spec in RULES.items()]
    argv = [sys.executable, str(SCRIPTS / "digits_runs.py"), str(out), *runs, "--", *DIGITS_SHORT]
    proc = run_at_head(
        cluster,
        cluster.mpiexec(find_mpiexec() or "", 2, argv, nodes=2),
        90 * len(runs),
        {"LINK_COUNTERS": "eth0"},
    )
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    counters = re.findall(r"^LINK (\S+) node1=(\d+) node2=(\d+)$", proc.stdout, re.MULTILINE)
    assert [c[0] for c in counters] == ["start", *RULES], proc.stdout[-2000:]
    moved = {}
    for (_, *before), (label, *after) in itertools.pairwise(counters):
        moved[label] = min(int(a) - int(b) for a, b in zip(after, before, strict=True))
    return out, moved, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("label", list(RULES))
def test_every_rule_trains_across_two_nodes_over_the_links(
    every_rule: tuple[Path, dict[str, int], str], label: str
) -> None:
    out, moved, _ = every_rule
    run = only_run(out / label)
    metrics = read_metrics(run / "metrics.h5")
    assert metrics["attrs"]["world_size"] == 4
    assert metrics["val"]["accuracy"][-1] >= TARGET, metrics["val"]["accuracy"]
    # every run moved data between the nodes (each node's link, both ways summed): a model is 36 KB
    assert moved[label] > 100_000, moved


@pytest.mark.slow
def test_bsp_across_nodes_matches_the_same_job_on_one_node(
    every_rule: tuple[Path, dict[str, int], str], tmp_path: Path
) -> None:
    """BSP's run across node1 and node2 — the hierarchical exchange: node-shared memory inside each node, MPI
    between the node leaders — against the same 4 ranks on one host: the same training to float tolerance
    (the sums are added in another order across nodes, so not bit for bit: 2e-8 apart in the loss)."""
    out, _, log = every_rule
    assert "4 rank(s), rule BSP, comm mpi+shm" in log
    assert re.search(r"^2\s+node2\s", log, re.MULTILINE), log[-3000:]  # the binding table: rank 2 on node2
    mpiexec = find_mpiexec() or ""
    script = [sys.executable, str(SCRIPTS / "digits_runs.py"), str(tmp_path), "BSP=RULE=BSP"]
    argv = [mpiexec, "-n", "4", *script, "--", *DIGITS_SHORT]
    proc = subprocess.run(argv, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    across = read_metrics(only_run(out / "BSP") / "metrics.h5")
    alone = read_metrics(only_run(tmp_path / "BSP") / "metrics.h5")
    np.testing.assert_allclose(across["train"]["loss"], alone["train"]["loss"], rtol=1e-6)
    np.testing.assert_allclose(across["val"]["accuracy"], alone["val"]["accuracy"], atol=0.003)


@pytest.mark.slow
def test_gloo_across_nodes_whose_hostnames_resolve_to_loopback(cluster: NetnsCluster, tmp_path: Path) -> None:
    """Debian's ``127.0.1.1 nodeI`` on every node: Gloo alone would listen on loopback and hang; the ranks
    find the subnet they share, meet there and train."""
    cluster.write_hosts(loopback=True)
    try:
        run = "gloo=RULE=BSP,comm.backend=gloo"
        argv = [sys.executable, str(SCRIPTS / "digits_runs.py"), str(tmp_path), run, "--", "session.epochs=3"]
        proc = run_at_head(cluster, cluster.mpiexec(find_mpiexec() or "", 1, argv, nodes=2), timeout=120)
    finally:
        cluster.write_hosts(loopback=False)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    assert re.search(rf"meeting on {re.escape(cluster.subnet)}\.0/24 \(rank 0: eth0 ", proc.stderr), (
        proc.stderr[-3000:]
    )
    assert read_metrics(only_run(tmp_path / "gloo") / "metrics.h5")["val"]["accuracy"][-1] >= 0.9


#: A digits job long enough to be cut in the middle: 2 nodes x 2 ranks, a checkpoint every epoch.
LONG = ["session.epochs=400", "checkpoint.every_epochs=1", "checkpoint.keep=2"]


def start_long_job(
    cluster: NetnsCluster, out: Path, rule: str = "BSP", *overrides: str
) -> subprocess.Popen[str]:
    """The job of :data:`LONG` under mpiexec across node1 and node2, with ``overrides``, in the background."""
    argv = [
        *launcher(),
        "-cfg",
        "launch/digits.cfg",
        f"RULE={rule}",
        f"session.output={out}",
        *LONG,
        *overrides,
    ]
    return subprocess.Popen(
        cluster.mpiexec(find_mpiexec() or "", 2, argv, nodes=2), cwd=REPO, env=mpi_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def wait_for_checkpoints(out: Path, count: int, job: subprocess.Popen[str], timeout: float = 120) -> Path:
    """The run folder once it holds ``count`` complete checkpoints."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
        if runs and len(complete_checkpoints(runs[0])) >= count:
            return runs[0]
        assert job.poll() is None, job.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {count} checkpoints in {timeout:g} s")


def complete_checkpoints(run: Path) -> list[Path]:
    return checkpoint_folders(run / "checkpoints") if (run / "checkpoints").exists() else []


def finish(job: subprocess.Popen[str], timeout: float) -> tuple[int | None, str, float]:
    """Wait up to ``timeout`` s: (exit status or None when it had to be killed, stderr, seconds waited)."""
    started = time.monotonic()
    try:
        _, err = job.communicate(timeout=timeout)
        return job.returncode, err, time.monotonic() - started
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        _, err = job.communicate(timeout=30)
        return None, err, time.monotonic() - started


def resume_finishes(cluster: NetnsCluster, run: Path, out: Path, rule: str) -> None:
    """``checkpoint.resume`` of ``run``, six epochs past its newest checkpoint, trains to the end (an
    asynchronous rule resumed from epoch 2 is not reliably at 90 % two epochs later: 0.86 once in CI)."""
    newest = complete_checkpoints(run)[-1]
    argv = [*launcher(), "-cfg", "launch/digits.cfg", f"RULE={rule}", f"session.output={out}",
            "checkpoint.every_epochs=1",
            f"checkpoint.resume={run}", "session.epochs=" + str(epoch_of(newest) + 6)]  # fmt: skip
    proc = run_at_head(cluster, cluster.mpiexec(find_mpiexec() or "", 2, argv, nodes=2), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{newest.name}" in proc.stderr
    assert read_metrics(run / "metrics.h5")["val"]["accuracy"][-1] >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, failure",
    [("BSP", "link down"), ("BSP", "link crawls"), ("BSP", "node killed"), ("ASGD", "link down")],
)
def test_a_lost_link_or_node_ends_the_job_in_a_minute_and_the_resume_finishes(
    cluster: NetnsCluster, tmp_path: Path, rule: str, failure: str
) -> None:
    """BSP across node1 and node2 with a checkpoint every epoch; after two, node2's link is cut, slowed to
    8 kbit/s, or every process of node2 is killed. The job must end within 60 s — a cut or crawling link with
    one line naming both nodes and node2's rank (the watchdog's network probe: the heartbeats on the shared
    file system go on) — and the newest checkpoint stays whole (every file loads); after a cut link, a
    resume across both nodes finishes the run (the same resume after each failure: run once per rule).
    A killed node ends the job at once through MPICH's hydra, whose own message names no node. ASGD: the same
    with its coordinated snapshots (before they used matched probes, a snapshot across nodes hung)."""
    out = tmp_path / "runs"
    job = start_long_job(cluster, out, rule, *drill_settings(failure))
    try:
        run = wait_for_checkpoints(out, 2, job)
        cluster.fail("node2", failure)
        status, err, waited = finish(job, timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        cluster.heal("node2")
    assert status not in (None, 0), f"still running {waited:.0f} s after the {failure}: {err[-3000:]}"
    assert waited < 60, err[-3000:]
    if failure != "node killed":
        line = re.search(
            r"the network between node\d and node\d is gone or crawling: rank \d on node\d .*", err
        )
        assert line and "node2" in line.group(0), err[-3000:]
    assert_loads_whole(complete_checkpoints(run)[-1], ranks=2)
    if failure == "link down":
        resume_finishes(cluster, run, out, rule)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["BSP", "ASGD"])
def test_the_embedded_example_runs_across_three_nodes(
    cluster: NetnsCluster, tmp_path: Path, rule: str
) -> None:
    """``examples/train_digits.py`` (the embedded API) under mpiexec on 3 nodes × 1 rank: a synchronous rule
    (every rank tests the same model each epoch) and a parameter server on node1 serving workers on node2
    and node3; the saved model loads and the data crossed both workers' links."""
    saved = tmp_path / "model.pt"
    argv = [
        sys.executable,
        "examples/train_digits.py",
        "--rule",
        rule,
        "--epochs",
        "3",
        "--save-model",
        str(saved),
    ]
    before = [sum(cluster.link_bytes(n)) for n in ("node2", "node3")]
    proc = run_at_head(cluster, cluster.mpiexec(find_mpiexec() or "", 1, argv), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = [sum(cluster.link_bytes(n)) - b for n, b in zip(("node2", "node3"), before, strict=True)]
    assert min(moved) > 100_000, moved
    accuracies = [
        float(a)
        for a in re.findall(r"Test: average loss [\d.]+, accuracy \d+/\d+ \(([\d.]+)%\)", proc.stdout)
    ]
    assert accuracies and accuracies[-1] >= 90.0, proc.stdout[-2000:]
    import torch

    assert "fc2.weight" in torch.load(saved, weights_only=True)


@pytest.mark.slow
def test_crossbow_launch_run_alone_names_the_node_it_lost(cluster: NetnsCluster, tmp_path: Path) -> None:
    """``crossbow-launch -hostfile`` at the head starts mpiexec itself (hydra reaching the nodes through the
    cluster's launcher, as through ssh); every process of node2 is killed after two checkpoints. Hydra ends
    the job at once naming no node (SIGKILL to every rank: none lives to say it); crossbow-launch, still
    there, asks each host whether it answers and names node2 in one line."""
    out = tmp_path / "runs"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnode2:2\n", encoding="utf-8")
    argv = [
        *launcher(),
        "-cfg",
        "launch/digits.cfg",
        "-hostfile",
        str(hostfile),
        f"session.output={out}",
        *LONG,
    ]
    env = {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(cluster.launcher)}
    job = subprocess.Popen(
        cluster.head_command(argv), cwd=REPO, env=mpi_env(env), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_checkpoints(out, 2, job)
        cluster.kill_node("node2")
        status, err, waited = finish(job, timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        if cluster.node("node2").pid == 0:
            cluster.restart_node("node2")
    assert status not in (None, 0) and waited < 60, err[-3000:]
    lines = [line for line in err.splitlines() if "no longer answer" in line]
    assert lines == [
        f"crossbow-launch: error: the job ended with status {status} and node2 no longer answers (its "
        "processes, its node or its link are lost); resume from the last checkpoint with "
        "checkpoint.resume=<run folder> once it is back, or leave it out of the host list"
    ], err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["BSP", "SMA"])
def test_a_killed_node_costs_its_replica_group_and_its_restart_rejoins(
    cluster: NetnsCluster, tmp_path: Path, rule: str
) -> None:
    """Issue 52's lost node: each node its own MPI job, a replica group ([link] groups = 3); node3 killed
    whole (every process of it at once) once group 0 logs epoch 3 of 10, then booted again at once and its
    group's job started anew there. Groups 0 and 1 exit 0, group 0 names the lost group and node3 in one line
    within 5 s of the kill; the restarted group takes a peer's state at a step's boundary (one line each
    side, the same step) and ends with status 0; the three groups end on the same accuracy, trained
    (benchmarks/node_loss.py runs the same drill to 20 epochs). The groups' steps sleep 0.1 s while a group
    is missing, so the run is still going when the restarted job is up on a loaded machine (in one CI run it
    came after the others had finished, unslowed)."""
    slowed = ("session.slow_ranks=0", "session.slow_seconds=0.1", "session.slow_while_short=true")
    result = drill(cluster, rule, tmp_path / "runs", epochs=10, kill_epoch=3, restart=True, extra=slowed)
    out = "\n".join(line for lines in result.lines for _, line in lines[-15:])
    assert result.codes[:2] == [0, 0] and result.codes[2] != 0 and result.codes[3:] == [0], (
        result.codes,
        out,
    )
    lost = [line for _, line in result.lines[0] if "link: group(s)" in line and " lost " in line]
    assert len(lost) == 1 and "link: group(s) 2 on node3 lost" in lost[0], out
    back = result.back_s()
    assert back is not None and back < 5.0, (back, out)
    handed = [re.findall(r"back at step (\d+)", line) for _, line in result.lines[0] if "handed over" in line]
    took = [re.findall(r"back at step (\d+)", line) for _, line in result.lines[3] if "from a peer" in line]
    assert len(handed) == 1 and handed == took, out
    runs = tmp_path / "runs"
    _, again = sorted(runs.glob("*-group2"))  # the killed job's folder, then the restart's (its time)
    groups = [read_metrics(next(runs.glob(f"*-group{g}")) / "metrics.h5") for g in (0, 1)]
    groups.append(read_metrics(again / "metrics.h5"))
    assert (groups[0]["val"]["accuracy"] == groups[1]["val"]["accuracy"]).all()
    assert groups[0]["val"]["accuracy"][-1] == groups[2]["val"]["accuracy"][-1]
    assert result.accuracy[-1] >= 0.85, result.accuracy  # SMA: 0.8875 at epoch 10 of the 20-epoch schedule
