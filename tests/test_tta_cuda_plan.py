"""The showdown on one device (benchmarks/tta.cfg ``[cuda]``, ``python -m benchmarks.tta --device cuda``):
the plan read from the file (rates by the grid's rule, sides alternating, the CPU grid untouched), where
``[pool] cuda_graphs`` goes, and (under mpiexec) the whole path run on the CPU with two tiny configurations:
a row per setup, the ratio of the two sides' winners computed from the runs, the section in the folder
``--out`` names and nowhere in benchmarks/results; without CUDA, ``--device cuda`` is one skip line."""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.tta_grid import TORCH, XB, load_grid, load_one_device

REPO = Path(__file__).parents[1]
GRID = REPO / "benchmarks" / "tta.cfg"


def test_the_plan_follows_the_grids_rates_and_alternates_the_sides() -> None:
    plan = load_one_device(GRID)
    task = plan.task  # base_lr 0.1 at batch 64: the centre for a step of B samples is 0.1 x B / 64
    assert task.name == "mnist1d" and task.target == 0.94 and plan.seeds == (0,)
    assert plan.validate_every == load_grid(GRID).validate_every == 0.25
    torch_side = [s for s in plan.setups if s.side == TORCH]
    ours = [s for s in plan.setups if s.side == XB]
    assert {s.global_batch: s.lr for s in torch_side} == pytest.approx({256: 0.2, 128: 0.1, 64: 0.1})
    assert [(s.learners, s.batch) for s in ours] == [(16, 16), (8, 32), (8, 16), (4, 16)]
    assert [s.lr for s in ours] == pytest.approx([0.2, 0.2, 0.1, 0.1])
    assert {(s.rule, s.engine) for s in ours} == {("BSP", "fused")} and plan.cuda_graphs == "on"
    # the sides alternate, each side's likeliest winner first, so a step cut short still compares them
    assert [s.side for s in plan.setups] == [TORCH, XB, TORCH, XB, TORCH, XB, XB]
    assert plan.settings == {"data": {"pin_memory": "false"}, "session": {"noise_scale_every": "0"}}


def test_a_malformed_plan_entry_is_refused_by_name(tmp_path: Path) -> None:
    for key, value, said in [
        ("torch", "256", "SIZE@FACTOR"),
        ("torch", "0@1", "at least 1"),
        ("mpicrossbow", "16@0.5", "LEARNERSxBATCH"),
        ("settings", "pin_memory=false", "SECTION.KEY=VALUE"),
    ]:
        cfg = configparser.ConfigParser(inline_comment_prefixes=("#",))
        cfg.read(GRID, encoding="utf-8")
        cfg["cuda"][key] = value
        path = tmp_path / "grid.cfg"
        with path.open("w", encoding="utf-8") as f:
            cfg.write(f)
        with pytest.raises(SystemExit, match=said):
            load_one_device(path)


def test_cuda_graphs_is_set_on_a_cuda_device_where_the_framework_has_the_key() -> None:
    from benchmarks.tta import one_device_pool
    from mpicrossbow.config.sections import PoolSection

    plan = load_one_device(GRID)
    ours = next(s for s in plan.setups if s.side == XB)
    assert one_device_pool(plan, ours, "cpu") == {"learners": 16, "engine": "fused"}
    has_key = "cuda_graphs" in {f.name for f in dataclasses.fields(PoolSection)}
    expected = {"learners": 16, "engine": "fused", **({"cuda_graphs": "on"} if has_key else {})}
    assert one_device_pool(plan, ours, "cuda") == expected


def test_no_run_starts_past_the_deadline_and_the_section_lists_what_was_left_out() -> None:
    import torch

    from benchmarks.tta import one_device_report, train_one_device

    plan = load_one_device(GRID)
    threads = torch.get_num_threads()
    try:  # a deadline 5 s away: less than [cuda] run_seconds, so nothing starts (and no world is needed)
        runs, skipped, failed = train_one_device(plan, None, "cpu", time.time() + 5, None)
    finally:
        torch.set_num_threads(threads)
    assert plan.run_seconds > 5 and runs == [] and failed == []
    assert skipped == [(setup, 0) for setup in plan.setups]
    args = argparse.Namespace(device="cpu", no_write=True, out="unused")
    text = one_device_report(plan, runs, skipped, failed, args)
    assert "goal ≤ 0.5: no ratio" in text
    left = text.split("- not run, the step's time being spent: ")[1]
    assert left.split("; ") == [f"{setup.label} seed 0" for setup in plan.setups]


def tiny_grid(tmp_path: Path) -> Path:
    """tta.cfg with a two-configuration plan (PyTorch at batch 64, BSP 4 x b16), a 2-epoch cap and a target
    of 25 % (chance is 10 %): the whole path in seconds."""
    cfg = configparser.ConfigParser(inline_comment_prefixes=("#",))
    cfg.read(GRID, encoding="utf-8")
    cfg["cuda"].update(torch="64@1", mpicrossbow="4x16@1")
    cfg["task mnist1d"].update(target="0.25", max_epochs="2")
    path = tmp_path / "tta.cfg"
    with path.open("w", encoding="utf-8") as f:
        cfg.write(f)
    return path


@pytest.mark.mpi
def test_the_one_device_path_runs_on_the_cpu_and_writes_its_section_where_told(tmp_path: Path) -> None:
    results = REPO / "benchmarks" / "results"
    before = {p.name: p.read_bytes() for p in results.glob("*.md")}
    out, runs_json = tmp_path / "gpu", tmp_path / "runs.json"
    args = [
        sys.executable, "-m", "benchmarks.tta", "--one-device", "--device", "cpu",
        "--grid", str(tiny_grid(tmp_path)), "--out", str(out), "--runs", str(runs_json),
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = (tmp_path / "gpu.md").read_text(encoding="utf-8")
    assert "## Time to accuracy on one CPU process: mpicrossbow against PyTorch" in section
    rows = [line for line in section.splitlines() if line.startswith(("| PyTorch |", "| mpicrossbow |"))]
    assert len(rows) == 2, section
    labels = {row.split(" | ")[1] for row in rows}
    assert labels == {"PyTorch one replica, batch 64, lr 0.1", "BSP 4 learner(s) x b16 fused, lr 0.1"}
    assert all(" | 1/1 | " in row for row in rows), rows  # both reached 25 % within 2 epochs
    runs = {r["setup"]["side"]: r for r in json.loads(runs_json.read_text())["mnist1d"]}
    assert set(runs) == {TORCH, XB} and all(r["seconds"] > 0 for r in runs.values())
    ratio = re.search(r"best mpicrossbow ÷ best PyTorch time to target: \*\*([0-9.]+)\*\*", section)
    assert ratio, section
    assert float(ratio.group(1)) == pytest.approx(runs[XB]["seconds"] / runs[TORCH]["seconds"], abs=0.006)
    assert "goal ≤ 0.5: " in section and "`[pool] cuda_graphs` not set" in section
    assert {p.name: p.read_bytes() for p in results.glob("*.md")} == before


@pytest.mark.slow
def test_without_cuda_the_gpu_showdown_is_one_skip_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the step runs instead of skipping")
    args = [sys.executable, "-m", "benchmarks.tta", "--device", "cuda", "--out", str(tmp_path / "gpu")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines() == [
        "tta on one GPU: needs a CUDA device, and this machine has none: skipped"
    ]
    assert not (tmp_path / "gpu.md").exists()
