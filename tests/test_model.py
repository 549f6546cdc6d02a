"""The model contract: loading by module or path, both forms, and one-line errors for broken model files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpicrossbow.config import load_config
from mpicrossbow.errors import ContractError
from mpicrossbow.launch.failure import agree
from mpicrossbow.launch.world import World
from mpicrossbow.model.contract import contract_form, load_model_class
from mpicrossbow.training.run.session import Session


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(text)
    return str(path)


def test_builtin_models_follow_their_contracts() -> None:
    assert contract_form(load_model_class("models.mlp", "MLP")) == "torch"
    assert contract_form(load_model_class("models.lenet", "LeNet")) == "torch"
    assert contract_form(load_model_class("models.legacy_mlp", "LegacyMLP")) == "theano"


@pytest.mark.parametrize(
    ("source", "cls", "message"),
    [
        ("def broken(:\n", "X", r"MODELFILE '.*user_model.py': syntax error in .*user_model.py line 1"),
        ("import no_such_package_xyz\n", "X", r"imports 'no_such_package_xyz', which is not installed"),
        (
            "import torch\n\ndef make():\n    return torch.zeros(6).reshape(4, 4)\n\nW = make()\n",
            "X",
            r"failed to import at .*user_model.py:4: RuntimeError: shape '\[4, 4\]' is invalid",
        ),
        ("x = 1\nraise ValueError('bad constant')\n", "X", r"at .*user_model.py:2: ValueError: bad constant"),
        ("class A: pass\n", "B", r"MODELCLASS 'B' not found in .*; classes and functions there: A"),
        ("class A:\n    def module(self): pass\n", "A", r"A is missing data\(\); a torch-native model needs"),
        (
            "class T:\n    def train_iter(self, c, r): pass\n",
            "T",
            r"T \(Theano-MPI form\) is missing method\(s\): compile_iter_fns, val_iter, adjust_hyperp, "
            "cleanup",
        ),
    ],
)
def test_broken_model_files_give_one_line(tmp_path: Path, source: str, cls: str, message: str) -> None:
    with pytest.raises(ContractError, match=message) as info:
        contract_form(load_model_class(write(tmp_path, source), cls))
    assert "\n" not in str(info.value)


def test_missing_module() -> None:
    with pytest.raises(ContractError, match=r"MODELFILE 'models.nope': module not found"):
        load_model_class("models.nope", "X")


def one_rank() -> World:
    return World(rank=0, size=1, local_rank=0, local_size=1, node=0, nodes=1, hostname="h", launcher=None)


def prepare(overrides: list[str]) -> tuple[int, Session]:
    cfg = load_config("launch/digits.cfg", ["DEVICES=cpu0", *overrides])
    session = Session(cfg, one_rank())
    return agree(one_rank(), session.prepare_local), session


def test_prepare_reports_contract_problems_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = prepare(["model.hiden=3"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "crossbow-launch: error: [model] unknown key 'hiden'; valid keys: hidden, layers, classes, inputs"
    )
    code, _ = prepare(["data.batch_size=5000"])
    assert code == 2
    assert "holds 1438 training samples, fewer than one batch of 5000" in capsys.readouterr().err


def test_prepare_builds_flat_replica(tmp_path: Path) -> None:
    code, session = prepare(["model.hidden=16"])
    assert code == 0
    learner = session.pool.learners[0]
    n = sum(p.numel() for p in learner.module.parameters())
    assert learner.params.numel() == n == learner.grads.numel()
    first = next(learner.module.parameters())
    assert first.data_ptr() == learner.params.data_ptr()  # views, not copies
    x, y = next(iter(session.pool.datas[0].train_batches(0)))
    learner.forward_backward(x, y)
    assert torch.count_nonzero(learner.grads) > 0  # autograd accumulated into the flat buffer
