"""session.cfg: Theano-MPI bare keys, sections, overrides, and one clear line for every kind of mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpicrossbow.cli import main, resolved
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.launch.devices import DeviceSpec, device_for_rank, parse_devices

BASE = "RULE=BSP\nMODELFILE=models.mlp\nMODELCLASS=MLP\nDEVICES=cpu0,cpu1\n"


def test_theano_mpi_bare_keys_and_defaults() -> None:
    cfg = load_config(text=BASE)
    assert (cfg.rule, cfg.modelfile, cfg.modelclass) == ("BSP", "models.mlp", "MLP")
    assert cfg.devices == (DeviceSpec("cpu", 0), DeviceSpec("cpu", 1))
    assert cfg.optim.lr == 0.1 and cfg.session.epochs == 10
    assert cfg.rule_params == {}  # [rule] as written; the rule resolves its defaults
    assert resolved(cfg).rule_params == {"mode": "auto", "bucket_mb": 5.0}


def test_sections_types_and_overrides() -> None:
    text = (
        BASE
        + "[optim]\nlr = 0.5\nschedule = multistep\nmilestones = 3, 6\nnesterov = yes\n[model]\nhidden=7\n"
    )
    cfg = load_config(text=text)
    assert cfg.optim.milestones == (3, 6) and cfg.optim.nesterov is True
    cfg = load_config(
        text=text, overrides=["optim.lr=0.25", "session.epochs=3", "RULE=bsp", "model.hidden=9"]
    )
    assert cfg.optim.lr == 0.25 and cfg.session.epochs == 3 and cfg.rule == "BSP"
    assert cfg.model_params == {"hidden": "9"}


def test_resolved_config_round_trips() -> None:
    cfg = load_config(text=BASE + "[optim]\nmilestones=2,4\nschedule=multistep\n[rule]\nmode=avg\n")
    again = load_config(text=cfg.to_ini())
    assert again.replace(source="x") == cfg.replace(source="x")


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        (BASE + "[sesion]\nepochs=1\n", [], r"unknown section \[sesion\]; valid sections: session, optim"),
        (BASE + "[optim]\nlearning_rate=1\n", [], r"\[optim\] unknown key 'learning_rate'; valid keys: lr,"),
        (BASE + "RULES=x\n", [], r"unknown key 'RULES' before the first section; valid bare keys: RULE,"),
        (BASE + "[optim]\nlr=fast\n", [], r"\[optim\] lr: expected a number, got 'fast'"),
        (BASE + "[session]\nepochs=2.5\n", [], r"\[session\] epochs: expected an integer"),
        (BASE + "[optim]\nnesterov=maybe\n", [], r"\[optim\] nesterov: expected true or false"),
        (BASE + "[optim]\nlr=-1\n", [], r"\[optim\] lr: -1.0 is out of range; must be > 0"),
        (BASE + "[optim]\nmomentum=1\n", [], r"momentum: 1.0 is out of range; must be < 1"),
        (
            BASE + "[optim]\nschedule=cosine\n",
            [],
            r"schedule: 'cosine' is not valid; choose one of none, step",
        ),
        (BASE + "[optim]\nschedule=multistep\n", [], r"multistep needs milestones"),
        (
            BASE + "[comm]\nbackend=tcp\n",
            [],
            r"backend: 'tcp' is not valid; choose one of auto, mpi, gloo, nccl",
        ),
        (BASE.replace("MODELCLASS=MLP\n", ""), [], r"missing required key MODELCLASS"),
        (
            BASE.replace("RULE=BSP", "RULE=BPS"),
            [],
            r"unknown rule 'BPS'; valid: ASGD, AUTO, BSP, \S.*, or module:Class for your own",
        ),
        (
            BASE + "[rule]\nmode=sum\n",
            [],
            r"\[rule\] mode: 'sum' is not valid; choose one of auto, grad, avg",
        ),
        (BASE + "[rule]\nalpha=1\n", [], r"\[rule\] unknown key 'alpha'; valid keys: mode"),
        (  # issue 51: k learners that each step on their own batch, the rate scaled without a cap
            BASE.replace("RULE=BSP", "RULE=SMA"),
            ["optim.lr_scaling=linear"],
            r"\[optim\] lr_scaling = linear scales RULE=SMA's rate .* \[optim\] lr_cap = 0 sets no cap",
        ),
        (BASE.replace("cpu0,cpu1", "gpu0"), [], r"DEVICES: unknown device 'gpu0'; valid forms: cudaN, cpu"),
        (BASE, ["optim.lr"], r"override 'optim.lr': expected section.key=value"),
        (BASE, ["optim.lr=x"], r"\[optim\] lr: expected a number"),
        (BASE, ["nosuch.key=1"], r"unknown section \[nosuch\]"),
        ("RULE=BSP\nRULE=BSP\n", [], r"cfg: line 2: key 'rule' appears twice in the bare keys"),
        (BASE + "[optim]\nlr\n", [], r"cfg: line 6: cannot parse 'lr'; expected key = value"),
    ],
)
def test_bad_input_names_the_key(text: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        resolved(load_config(text=text, overrides=overrides))  # [rule] is checked when the rule is built
    assert "\n" not in str(info.value)


#: Every key of the old ``[fault]`` section and where it lives now.
FAULT_KEYS = {
    "elastic": ("elastic", "enabled"),
    "min_ranks": ("elastic", "min_ranks"),
    "commit_every": ("elastic", "commit_every"),
    "replace": ("elastic", "replace"),
    "rank": ("inject", "rank"),
    "step": ("inject", "step"),
    "action": ("inject", "action"),
}


@pytest.mark.parametrize("old", FAULT_KEYS)
def test_old_fault_keys_are_refused_naming_the_new_key(old: str) -> None:
    """``[fault]`` was split into ``[elastic]`` and ``[inject]``: an old key, in a file or as an override, is
    one line naming its new home, and the new key reads the same value."""
    section, key = FAULT_KEYS[old]
    value = "kill" if old == "action" else "1"
    with pytest.raises(ConfigError) as info:
        load_config(text=BASE + f"[fault]\n{old} = {value}\n")
    assert str(info.value) == f"[fault] {old} moved: use [{section}] {key}"
    with pytest.raises(ConfigError) as info:
        load_config(text=BASE, overrides=[f"fault.{old}={value}"])
    assert str(info.value) == f"fault.{old} moved: use {section}.{key}"
    read = getattr(getattr(load_config(text=BASE + f"[{section}]\n{key} = {value}\n"), section), key)
    assert read in ("kill", 1, True)


def test_fault_section_without_a_known_key_lists_where_its_keys_went() -> None:
    where = "[elastic] enabled, min_ranks, commit_every, replace; [inject] rank, step, action"
    with pytest.raises(ConfigError) as info:
        load_config(text=BASE + "[fault]\n")
    assert str(info.value) == f"[fault]: [fault] is gone; its keys moved: {where}"
    with pytest.raises(ConfigError) as info:
        load_config(text=BASE, overrides=["fault.nosuch=1"])
    assert str(info.value) == f"fault.nosuch: [fault] is gone; its keys moved: {where}"
    with pytest.raises(ConfigError, match=r"^\[fault\] elastic moved: use \[elastic\] enabled$"):
        load_config(extra={"__top__": {"rule": "BSP", "modelfile": "m", "modelclass": "M", "devices": "cpu"},
                           "fault": {"elastic": True}})  # fmt: skip


def test_cli_refuses_an_old_fault_key_in_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "s.cfg"
    cfg.write_text(BASE)
    assert main(["-cfg", str(cfg), "fault.elastic=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["crossbow-launch: error: fault.elastic moved: use elastic.enabled"]
    cfg.write_text(BASE + "[fault]\nrank = 1\nstep = 5\n")
    assert main(["-cfg", str(cfg)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "crossbow-launch: error: [fault] rank moved: use [inject] rank"
    ]


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="no such cfg file"):
        load_config("does/not/exist.cfg")


def test_devices_forms_and_rank_mapping() -> None:
    assert parse_devices("cpu") == (DeviceSpec("cpu"),)
    assert parse_devices("cuda0,cuda1") == (DeviceSpec("cuda", 0), DeviceSpec("cuda", 1))
    specs = parse_devices("nodeA:cuda0,cuda1 nodeB:cuda0")
    assert [str(s) for s in specs] == ["nodeA:cuda0", "nodeA:cuda1", "nodeB:cuda0"]
    assert device_for_rank(parse_devices("localhost:cpu0,cpu1"), 1, 2) == DeviceSpec("cpu", 1, "localhost")
    assert device_for_rank(parse_devices("cpu"), 6, 8) == DeviceSpec("cpu")  # DEVICES=cpu: any world size
    with pytest.raises(
        ConfigError, match=r"DEVICES lists 2 device\(s\) \(cpu0,cpu1\) but the job has 4 rank"
    ):
        device_for_rank(parse_devices("cpu0,cpu1"), 0, 4)
    with pytest.raises(ConfigError, match=r"rank 0 is on host .* but its entry is no-such-host-x:cpu0"):
        device_for_rank(parse_devices("no-such-host-x:cpu0"), 0, 1)


def test_cli_bad_cfg_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "s.cfg"
    cfg.write_text(BASE + "[optim]\nlr=0\n")
    assert main(["-cfg", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["crossbow-launch: error: [optim] lr: 0.0 is out of range; must be > 0"]


def test_cli_print_config_accepts_theano_spelling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "s.cfg"
    cfg.write_text(BASE)
    assert main([f"-cfg={cfg}", "--print-config", "session.epochs=4"]) == 0
    assert "epochs = 4" in capsys.readouterr().out


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "-cfg" in capsys.readouterr().err
