"""Images end to end: the zoo's ResNet-18 trains on a generated image folder and on the same images packed
as shards, through DataLoader workers, under ``mpiexec -n 2``; both read every sample once per epoch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import launcher, only_run, run_mpi
from mpicrossbow.data.images import ImageFolder
from mpicrossbow.data.loader import LoaderData, LoaderOptions
from mpicrossbow.data.pack import pack
from mpicrossbow.data.shapes import make_shapes
from mpicrossbow.data.shards import Shards
from mpicrossbow.model.shard import Shard
from mpicrossbow.training.reporting.metrics import read_metrics

BATCH = 16


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """256 training and 64 validation 64×64 JPEGs of 4 shapes, and the same packed as 4 shards."""
    root = tmp_path_factory.mktemp("images")
    folder = make_shapes(root / "shapes", per_class_train=64, per_class_val=16, size=64, classes=4, seed=0)
    pack(folder, root / "packed", shards=4)
    return folder, root / "packed"


def relative(name: str) -> str:
    """``class/file.jpg`` of a sample's name: a file path (folder) or ``shard.h5[row] (class/file.jpg)``."""
    inside = re.search(r"\((.*)\)$", name)
    return inside[1] if inside else "/".join(Path(name).parts[-2:])


def seen(dataset: ImageFolder | Shards, epoch: int, ranks: int = 2) -> list[str]:
    """Every sample the ranks' loaders read in ``epoch``, by its file name, in reading order."""
    names = []
    for rank in range(ranks):
        data = LoaderData(dataset, dataset, Shard(rank, ranks, BATCH, seed=1), LoaderOptions(verify=False))
        data.sampler.set_epoch(epoch)
        names += [relative(dataset.name(i)) for batch in data.sampler for i, _ in batch]
    return names


def test_folder_and_shards_read_every_sample_once_an_epoch(images: tuple[Path, Path]) -> None:
    folder, shards = (
        cls(root, "train", image_size=64) for cls, root in ((ImageFolder, images[0]), (Shards, images[1]))
    )
    for epoch in (0, 1):
        a, b = seen(folder, epoch), seen(shards, epoch)
        assert len(a) == len(set(a)) == 256 and sorted(a) == sorted(b)
    assert seen(shards, 0) != seen(shards, 1)  # reshuffled within each rank's shards
    # A rank reads only its own shards: rank r's part is a run of consecutive samples of the packed order.
    part = LoaderData(shards, shards, Shard(1, 2, BATCH), LoaderOptions(verify=False)).sampler.part
    assert np.array_equal(part, np.arange(128, 256))
    assert {shards.locate(int(i))[0] for i in part} == {2, 3}


@pytest.mark.mpi
@pytest.mark.parametrize("dataset", ["imagefolder", "shards"])
def test_resnet18_trains_an_epoch_on_images_with_loader_workers(
    mpiexec: str, tmp_path: Path, images: tuple[Path, Path], dataset: str
) -> None:
    root = images[0] if dataset == "imagefolder" else images[1]
    args = [
        *launcher(), "-cfg", "launch/resnet18_shapes.cfg", f"session.output={tmp_path}",
        f"data.dataset={dataset}", f"dataset.root={root}", "data.workers=2", "session.epochs=1",
        f"data.batch_size={BATCH}",
    ]  # fmt: skip
    proc = run_mpi(mpiexec, 2, args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path) / "metrics.h5")
    assert list(metrics["train"]["step"]) == [256 // (2 * BATCH)]
    assert np.isfinite(metrics["train"]["loss"][0]) and np.isfinite(metrics["val"]["loss"][0])
    assert "resnet18 from models.imagenet_resnet" in proc.stderr


@pytest.mark.mpi
def test_bad_image_folders_end_every_rank_with_one_line_or_are_skipped(
    mpiexec: str, tmp_path: Path, images: tuple[Path, Path]
) -> None:
    """A missing root, an empty class folder and a garbage .jpg (error / skip), before the first step."""
    bad = tmp_path / "bad"
    shutil.copytree(images[0], bad)
    (bad / "train" / "circle" / "zz-garbage.jpg").write_bytes(b"\xff\xd8 not really a JPEG" * 10)

    def launch(*overrides: str) -> subprocess.CompletedProcess[str]:
        args = [*launcher(), "-cfg", "launch/resnet18_shapes.cfg", f"session.output={tmp_path / 'runs'}",
                "session.steps=1", "data.workers=1", *overrides]  # fmt: skip
        return run_mpi(mpiexec, 2, args, timeout=120)

    def one_error(proc: subprocess.CompletedProcess[str]) -> str:
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("crossbow-launch: error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        return errors[0]

    assert f"[dataset] root '{tmp_path / 'nowhere'}': no such folder" in one_error(
        launch(f"dataset.root={tmp_path / 'nowhere'}")
    )
    garbage = one_error(launch(f"dataset.root={bad}"))
    assert f"{bad}/train/circle/zz-garbage.jpg: not a decodable image" in garbage
    assert "set [data] on_bad_sample = skip" in garbage
    skipped = launch(f"dataset.root={bad}", "data.on_bad_sample=skip")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "zz-garbage.jpg" in skipped.stderr
    (bad / "train" / "empty").mkdir()
    assert f"{bad}/train/empty: empty class folder" in one_error(launch(f"dataset.root={bad}"))
