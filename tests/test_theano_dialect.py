"""Theano-MPI users move over unchanged: its cfg dialect (golden files: tests/data/theano_mpi/), its import
facade and rule list, and its recorder's semantics (what a model does not report is not a measurement)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError, ContractError
from mpicrossbow.launch.devices import DeviceSpec
from mpicrossbow.pool.theano import TheanoPool, TheanoRecorder
from mpicrossbow.training.run.evaluation import per_sample

GOLDEN = Path(__file__).parent / "data" / "theano_mpi"


def test_every_theano_mpi_example_cfg_parses_as_tmlauncher_read_it() -> None:
    single = load_config(GOLDEN / "session_single_node.cfg")
    assert (single.rule, single.modelclass, single.size) == ("BSP", "LegacyMLP", None)
    multi = load_config(GOLDEN / "session_multi_node.cfg")
    assert multi.devices == (DeviceSpec("cpu", 0, "localhost"), DeviceSpec("cpu", 1, "localhost"))
    assert multi.comm.backend == "mpi"  # BSP_EXCH_STRATEGY='ar', quotes and all
    assert load_config(GOLDEN / "session_lstm_2gpu.cfg").rule_params == {"mode": "avg"}
    assert load_config(GOLDEN / "session_size.cfg").size == 2
    assert load_config(GOLDEN / "session_gap.cfg").rule_params == {"mode": "swap"}


def test_the_resolved_cfg_of_a_multi_node_array_reads_back_the_same() -> None:
    config = load_config(GOLDEN / "session_multi_node.cfg")
    again = load_config(text=config.to_ini())
    assert again.devices == config.devices and again.comm.backend == "mpi"


@pytest.mark.parametrize(
    ("line", "sync", "comm"),
    [
        ("BSP_SYNC_TYPE=cdd", {"mode": "grad"}, {}),
        ('BSP_EXCH_STRATEGY="nccl32"', {}, {"backend": "nccl"}),
        ("BSP_EXCH_STRATEGY=nccl16", {}, {"backend": "nccl", "compression": "fp16"}),
    ],
)
def test_bsp_keys_map_to_this_projects_settings(line: str, sync: dict, comm: dict) -> None:
    config = load_config(text=f"RULE=BSP\n{line}\nMODELFILE=m\nMODELCLASS=M\nDEVICES=cpu\n")
    assert config.rule_params == sync
    assert {k: getattr(config.comm, k) for k in comm} == comm


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("RULE=GOSGD\nBSP_SYNC_TYPE=avg", "BSP_SYNC_TYPE=avg applies to RULE=BSP only"),
        ("RULE=BSP\nBSP_SYNC_TYPE=sum", "BSP_SYNC_TYPE=sum is not supported; supported: avg (BSP mode avg)"),
        ("RULE=BSP\nBSP_EXCH_STRATEGY=copper", "BSP_EXCH_STRATEGY=copper is not supported; supported: ar"),
        ("RULE=BSP\nSIZE=3", "SIZE=3 but DEVICES lists 2 device(s)"),
        ("RULE=BSP\nSIZE=two", "SIZE=two: expected the number of ranks"),
        (
            "RULE=BSP\nBSP_SYNC_TYPE=avg\n[rule]\nmode = grad",
            "[rule] mode = grad contradicts the Theano-MPI key",
        ),
    ],
)
def test_what_the_dialect_cannot_mean_is_one_config_error(text: str, words: str) -> None:
    head, _, tail = text.partition("[")
    cfg = f"{head}\nMODELFILE=m\nMODELCLASS=M\nDEVICES=cpu0,cpu1\n" + (f"[{tail}\n" if tail else "")
    with pytest.raises(ConfigError) as caught:
        load_config(text=cfg)
    assert words in str(caught.value)


def test_the_facade_exports_every_rule_and_the_rule_list_reads() -> None:
    from mpicrossbow import BSP, EASGD, GOSGD, RULES, SMA

    assert all(
        callable(getattr(cls, "init", None)) and callable(getattr(cls, "wait", None))
        for cls in (BSP, EASGD, GOSGD, SMA)
    )
    assert list(RULES) == sorted(RULES.names()) and "GOSGD" in RULES and "gosgd" in RULES and len(RULES) >= 11
    assert repr(RULES).startswith("Registry('rule': ASGD, AUTO, BSP,")
    helped = subprocess.run(
        [sys.executable, "-m", "mpicrossbow.cli", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        "RULE= one of ASGD, AUTO, BSP, DILOCO, EASGD, GOSGD, GSP, LOCALSGD, POSTLOCALSGD, PSGD, SMA, SSP, "
        "WEEDOUT" in helped.stdout
    )


class SilentModel:
    """A Theano-MPI-form model that reports nothing, or (``returns``) returns its cost from train_iter."""

    def __init__(self, returns: bool) -> None:
        self.returns = returns
        self.params = [torch.nn.Parameter(torch.zeros(3))]
        self.data = type("Data", (), {"n_batch_train": 2, "n_batch_val": 1})()

    def compile_iter_fns(self) -> None:
        """Nothing to compile."""

    def train_iter(self, count: int, recorder: TheanoRecorder) -> float | None:
        return 0.5 if self.returns else None

    def val_iter(self, count: int, recorder: TheanoRecorder) -> tuple[float, float] | None:
        return (0.25, 0.1) if self.returns else None

    def adjust_hyperp(self, epoch: int) -> None:
        """No schedule."""

    def cleanup(self) -> None:
        """Nothing to release."""


def test_what_a_model_does_not_report_is_not_a_measurement() -> None:
    silent = TheanoPool(SilentModel(returns=False))
    silent.compute(0)
    assert all(math.isnan(v) for v in per_sample(*silent.take_stats()))
    assert all(math.isnan(v) for v in per_sample(*silent.validate()))
    costs = TheanoPool(SilentModel(returns=True))
    costs.compute(0)
    costs.compute(1)
    loss, accuracy = per_sample(*costs.take_stats())
    assert loss == 0.5 and math.isnan(accuracy), "a cost without an error rate has no accuracy"
    assert per_sample(*costs.validate()) == (0.25, 0.9)


def test_a_theano_form_model_under_a_gradient_rule_is_one_line_naming_the_rules_that_run_it() -> None:
    from mpicrossbow.launch.world import World
    from mpicrossbow.rules.registry import build_rule
    from mpicrossbow.training.run.pool_builder import build_pool

    config = load_config(GOLDEN / "session_single_node.cfg", ["RULE=GSP"])
    world = World(0, 2, 0, 2, 0, 1, "localhost", None)
    with pytest.raises(ContractError, match=r"RULE=GSP exchanges gradients.*GOSGD, SMA"):
        build_pool(config, world, build_rule("GSP", {}), torch.device("cpu"), 1)
