"""``[optim] precision`` under real ``mpiexec``: every synchronous rule trains the digits MLP in bf16 within
one point of its fp32 accuracy, and BSP the MNIST-1D CNN within :data:`ONE_SEED_MNIST1D` (benchmarks/
precision.py's grid on seed 0: one MPI job per world size, fp32's and bf16's runs one after another through
``crossbow-launch``'s own path), and an fp16 overflow on one rank is skipped by every rank.

On MNIST-1D the test runs BSP alone: the convolutions' bf16 arithmetic is the same under every rule, and
each rule's own bf16 path (gradients or models exchanged) is the digits case's; the 4-rank rules on
MNIST-1D took 4 of the test's 6 minutes on 2 cores, and SMA's two runs are gone too (issue 51). The benchmark
(``python -m benchmarks.precision``) keeps the whole grid on both data sets.

The synchronous rules' runs are deterministic on one machine, but not from one CPU to the next: bf16 matmuls
and convolutions run on the CPU's own bf16 units where it has them (AVX512-BF16 and AMX on an Intel Xeon
here) and through float32 elsewhere (the AMD EPYC the bars were first set on), so bf16's run is another
training trajectory on each. On the digits that moves nothing (every rule within 0.56 points on the Xeon,
2026-12-02). On MNIST-1D one seed's trajectory moves by about a point whatever changes it: BSP on seed 0
read fp32 0.964, bf16 0.953 on the Xeon (−1.1 points; seeds 1 and 2: −0.1 and +1.1; SMA and EASGD down to
−1.9), while the three seeds' means stayed within a point (benchmarks/results/precision.md). So the
one-seed MNIST-1D bar is that spread, and the one-point claim is the benchmark's, on the means over three
seeds, every rule's, asynchronous ones included (docs/precision.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.precision import RULES, SYNCHRONOUS, TOLERANCE, measure
from conftest import only_run, run_mpi
from mpicrossbow.training.reporting.metrics import read_metrics

pytestmark = [pytest.mark.mpi]

SCRIPTS = Path(__file__).parent / "mpi_scripts"
#: How far BSP's bf16 accuracy may be from fp32's on MNIST-1D, one seed (a fraction): one trajectory's
#: spread (the module's docstring); a broken bf16 path loses far more (chance is 0.10).
ONE_SEED_MNIST1D = 0.02
#: What the MNIST-1D paper's CNN reaches; launch/mnist1d.cfg's fp32 BSP run must too (read 0.964 here).
PAPERS_ACCURACY = 0.94


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["digits", "mnist1d"])
def test_bf16_trains_every_synchronous_rule_close_to_fp32(mpiexec: str, tmp_path: Path, dataset: str) -> None:
    rules = {ranks: {k: v for k, v in by.items() if k in SYNCHRONOUS} for ranks, by in RULES.items()}
    if dataset == "mnist1d":
        rules = {2: {k: v for k, v in rules[2].items() if k == "BSP"}}  # the CNN; every rule: digits
    outcomes = measure(tmp_path, [dataset], rules=rules, timeout_s=300)
    assert {o.rule for o in outcomes} == {rule for by in rules.values() for rule in by}
    bar = ONE_SEED_MNIST1D if dataset == "mnist1d" else TOLERANCE
    off = {o.rule: (o.fp32, o.bf16) for o in outcomes if abs(o.bf16 - o.fp32) > bar}
    assert not off, f"bf16 more than {100 * bar:.0f} point(s) from fp32 (fp32, bf16): {off}"
    assert all(o.fp32 > 0.9 for o in outcomes), outcomes  # both really trained
    if dataset == "mnist1d":  # the paper's CNN reaches 94 % (launch/mnist1d.cfg's BSP run, fp32, seed 0)
        assert all(o.fp32 >= PAPERS_ACCURACY for o in outcomes), outcomes


def test_an_fp16_overflow_on_one_rank_is_skipped_by_every_rank(mpiexec: str, tmp_path: Path) -> None:
    """crossbow-launch's path, 2 ranks, BSP: rank 1's gradient made NaN at step 5 ([inject] action = nan)
    under a fixed loss scale; rank 0, whose own gradients were finite, logs the skip (the agreed flag), the
    job ends normally and trains to its target."""
    args = [
        sys.executable,
        str(SCRIPTS / "digits_runs.py"),
        str(tmp_path),
        "fp16=RULE=BSP,optim.precision=fp16,optim.loss_scale=1024,inject.rank=1,inject.step=5,inject.action=nan",
    ]
    proc = run_mpi(mpiexec, 2, args, timeout=120)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count("step skipped on every rank") == 1, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path / "fp16") / "metrics.h5")
    assert float(metrics["val"]["accuracy"][-1]) >= 0.95
