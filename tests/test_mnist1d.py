"""mpicrossbow/data/mnist1d.py (the MNIST-1D factory and its cache) and models/mnist1d.py (the models).

Small argument sets (500 samples) keep generation well under a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import mpicrossbow.data.mnist1d as m1d
from conftest import REPO, mpi_env
from models.mnist1d import MNIST1DCNN, MNIST1DMLP
from mpicrossbow.errors import ConfigError

SMALL = {"num_samples": 500, "seed": 3}


@pytest.mark.slow
def test_splits_shapes_and_labels(tmp_path: Path) -> None:
    train = m1d.mnist1d("train", cache=str(tmp_path), **SMALL)
    val = m1d.mnist1d("val", cache=str(tmp_path), **SMALL)
    assert (len(train), len(val)) == (400, 100)
    x, y = train[0]
    assert x.shape == (40,) and x.dtype == torch.float32 and isinstance(y, int)
    assert train.targets.dtype == torch.int64 and set(train.targets.tolist()) == set(range(10))
    assert train.classes == [str(d) for d in range(10)]
    assert all(0 <= int(label) < 10 for label in val.targets)
    assert len(list(tmp_path.glob("*.h5"))) == 1 and not list(tmp_path.glob(".*.tmp"))


def test_the_package_s_own_generator_and_defaults() -> None:
    """Same samples as ``mnist1d.data.make_dataset`` with the overrides; callers' global RNGs untouched."""
    from mnist1d.data import get_dataset_args, make_dataset

    state = np.random.get_state()[1].copy()
    made = m1d.generate({"num_samples": 500, "seed": 3, "train_split": 0.8})
    assert np.array_equal(np.random.get_state()[1], state)
    args = get_dataset_args()
    args.num_samples, args.seed = 500, 3
    reference = make_dataset(args)
    assert np.array_equal(made["x"], reference["x"]) and np.array_equal(made["y_test"], reference["y_test"])
    assert (get_dataset_args().num_samples, get_dataset_args().train_split) == (5000, 0.8)  # 4000 / 1000


def test_deterministic_across_caches(tmp_path: Path) -> None:
    a = m1d.mnist1d("train", cache=str(tmp_path / "a"), **SMALL)
    b = m1d.mnist1d("train", cache=str(tmp_path / "b"), **SMALL)
    assert torch.equal(a.data, b.data) and torch.equal(a.targets, b.targets)
    other = m1d.mnist1d("train", cache=str(tmp_path / "a"), num_samples=500, seed=4)
    assert not torch.equal(a.data, other.data)
    assert len(list((tmp_path / "a").glob("*.h5"))) == 2  # one file per argument set


def test_cache_is_reused_not_regenerated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = m1d.mnist1d("train", cache=str(tmp_path), **SMALL)
    (path,) = tmp_path.glob("*.h5")
    mtime = path.stat().st_mtime_ns

    def refuse(overrides: dict) -> dict:
        raise AssertionError("regenerated although the cache exists")

    monkeypatch.setattr(m1d, "generate", refuse)
    again = m1d.mnist1d("val", cache=str(tmp_path), **SMALL)
    again_train = m1d.mnist1d("train", cache=str(tmp_path), **SMALL)
    assert len(again) == 100 and torch.equal(again_train.data, first.data)
    assert path.stat().st_mtime_ns == mtime


def test_unreadable_cache_is_regenerated(tmp_path: Path) -> None:
    good = m1d.mnist1d("train", cache=str(tmp_path), **SMALL)
    (path,) = tmp_path.glob("*.h5")
    path.write_bytes(path.read_bytes()[:1000])  # truncated by something outside the factory
    assert torch.equal(m1d.mnist1d("train", cache=str(tmp_path), **SMALL).data, good.data)


@pytest.mark.slow
def test_two_processes_generating_at_once_leave_one_good_file(tmp_path: Path) -> None:
    """Both start before either has a cache file (a barrier on a start file): both generate and rename."""
    script = textwrap.dedent(f"""
        import os, sys, time
        import mpicrossbow.data.mnist1d as m1d
        generate = m1d.generate
        def slow(overrides):
            arrays = generate(overrides)
            open(os.path.join({str(tmp_path)!r}, "ready-" + sys.argv[1]), "w").close()
            while len([n for n in os.listdir({str(tmp_path)!r}) if n.startswith("ready-")]) < 2:
                time.sleep(0.01)
            return arrays
        m1d.generate = slow
        data = m1d.mnist1d("train", cache={str(tmp_path / "cache")!r}, num_samples=500, seed=3)
        print(float(data.data.sum()), len(data))
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i)], env=mpi_env(), cwd=REPO, stdout=subprocess.PIPE
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].decode().split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and outs[0][1] == "400"
    assert sorted(os.listdir(tmp_path / "cache")) == ["mnist1d-500-3-0.8-v1.h5"]  # no temporary left
    reread = m1d.mnist1d("train", cache=str(tmp_path / "cache"), num_samples=500, seed=3)
    assert float(reread.data.sum()) == float(outs[0][0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "test"}, "split must be 'train' or 'val'"),
        ({"num_samples": 10}, r"\[dataset\] num_samples"),
        ({"seed": -1}, r"\[dataset\] seed"),
        ({"train_split": 1.0}, r"\[dataset\] train_split"),
        ({"train_split": 0.001, "num_samples": 100}, r"\[dataset\] train_split"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path: Path, kwargs: dict, message: str) -> None:
    split = kwargs.pop("split", "train")
    with pytest.raises(ConfigError, match=message) as info:
        m1d.mnist1d(split, cache=str(tmp_path), **kwargs)
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_models_shapes_parameters_and_inputs() -> None:
    cnn, mlp = MNIST1DCNN(), MNIST1DMLP()
    assert sum(p.numel() for p in cnn.parameters()) == 5210  # the paper's ConvBase: 25 channels, 125 -> 10
    assert sum(p.numel() for p in mlp.parameters()) == 15210  # the paper's MLPBase: hidden 100
    x = torch.randn(3, 40)
    for model in (cnn, mlp):
        assert model(x).shape == (3, 10)
        assert torch.equal(model(x), model(x.unsqueeze(1)))
        with pytest.raises(ValueError, match=r"\(N, 40\)"):
            model(torch.randn(3, 41))
    assert MNIST1DCNN(num_classes=4, channels=8)(x).shape == (3, 4)
    assert MNIST1DMLP(num_classes=4, hidden=16)(x).shape == (3, 4)
