"""Image data sets on generated data: the shapes generator, ImageFolder, the transforms, packing into HDF5
shards and reading them back, and every bad input's one-line DataError. CPU only, no MPI."""

from __future__ import annotations

import logging
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from mpicrossbow.data.images import ImageFolder
from mpicrossbow.data.pack import main as pack_main
from mpicrossbow.data.pack import pack
from mpicrossbow.data.shapes import SHAPES, make_shapes
from mpicrossbow.data.shapes import main as shapes_main
from mpicrossbow.data.shards import Shards
from mpicrossbow.data.transforms import MEAN, STD, ImageTransform, centre_crop_box, random_resized_crop_box
from mpicrossbow.errors import ConfigError, DataError

SIZE = 40
TRAIN, VAL = 5, 2


def one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message and message, message
    return message


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shapes(tmp_path_factory.mktemp("shapes"), TRAIN, VAL, size=SIZE, classes=4, seed=3)


@pytest.fixture(scope="module")
def packed(shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("packed")
    pack(shapes, dst, shards=3, seed=1)
    return dst


def copy_tree(src: Path, dst: Path) -> Path:
    for path in src.rglob("*.jpg"):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return dst


def test_shapes_are_deterministic_and_laid_out_by_split_and_class(shapes: Path, tmp_path: Path) -> None:
    again = make_shapes(tmp_path / "again", TRAIN, VAL, size=SIZE, classes=4, seed=3)
    other = make_shapes(tmp_path / "other", TRAIN, VAL, size=SIZE, classes=4, seed=4)
    for split, count in (("train", TRAIN), ("val", VAL)):
        assert sorted(p.name for p in (shapes / split).iterdir()) == sorted(SHAPES[:4])
        for kind in SHAPES[:4]:
            files = sorted((shapes / split / kind).glob("*.jpg"))
            assert len(files) == count
            for f in files:
                assert f.read_bytes() == (again / split / kind / f.name).read_bytes()
    first = shapes / "train" / "circle" / "00000.jpg"
    assert first.read_bytes() != (other / "train" / "circle" / "00000.jpg").read_bytes()
    with Image.open(first) as image:
        assert image.size == (SIZE, SIZE) and image.format == "JPEG"
    assert (
        shapes_main([str(tmp_path / "cli"), "--train", "1", "--val", "1", "--size", "16", "--seed", "3"]) == 0
    )
    assert sorted(p.relative_to(tmp_path / "cli").as_posix() for p in (tmp_path / "cli").rglob("*.jpg")) == [
        f"{split}/{kind}/00000.jpg" for split in ("train", "val") for kind in sorted(SHAPES[:4])
    ]


def test_image_folder_lists_classes_samples_and_targets(shapes: Path) -> None:
    train, val = ImageFolder(shapes, "train", image_size=16), ImageFolder(shapes, "val", image_size=16)
    assert train.classes == val.classes == sorted(SHAPES[:4])
    assert len(train) == 4 * TRAIN and len(val) == 4 * VAL
    assert train.targets == [label for label in range(4) for _ in range(TRAIN)]
    assert train.samples[0] == (str(shapes / "train" / "circle" / "00000.jpg"), 0)
    assert train.source == str(shapes) and train.bad_samples == [] and not train.pre_shuffled
    x, y = train[TRAIN]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 1


def test_transform_output_and_normalisation(tmp_path: Path) -> None:
    grey = tmp_path / "grey.png"
    Image.new("RGB", (50, 30), (128, 64, 255)).save(grey)
    x = ImageTransform("none", 12, train=True)(grey.read_bytes(), str(grey))
    assert x.shape == (3, 12, 12) and x.dtype == torch.float32 and x.is_contiguous()
    expected = [(v / 255 - m) / s for v, m, s in zip((128, 64, 255), MEAN, STD, strict=True)]
    assert torch.allclose(x.mean(dim=(1, 2)), torch.tensor(expected), atol=1e-5)
    assert torch.allclose(x.std(dim=(1, 2)), torch.zeros(3), atol=1e-5)


def test_crop_boxes() -> None:
    assert centre_crop_box(256, 256, 224) == (16, 16, 240, 240)
    left, top, right, bottom = centre_crop_box(500, 375, 224)
    assert right - left == pytest.approx(bottom - top, rel=0.01) and bottom - top == pytest.approx(328, abs=1)
    torch.manual_seed(0)
    for _ in range(200):
        left, top, right, bottom = random_resized_crop_box(300, 200)
        assert 0 <= left < right <= 300 and 0 <= top < bottom <= 200
        area = (right - left) * (bottom - top) / 60000
        assert 0.07 <= area <= 1.0
    assert random_resized_crop_box(1000, 10) == (493, 0, 506, 10)  # 10 tries fail: centre crop, ratio 4/3


def test_val_transform_is_deterministic_and_train_follows_torch_seed(shapes: Path) -> None:
    data = (shapes / "train" / "square" / "00001.jpg").read_bytes()
    val, train = ImageTransform("standard", 24, train=False), ImageTransform("standard", 24, train=True)
    state = torch.get_rng_state()
    assert torch.equal(val(data, "f"), val(data, "f"))
    assert torch.equal(torch.get_rng_state(), state)  # validation draws nothing
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(train(data, "f"))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    with pytest.raises(ConfigError, match="augment"):
        ImageTransform("fancy", 24)


def test_reduced_jpeg_decode_stays_close_to_a_full_decode(tmp_path: Path) -> None:
    path = make_shapes(tmp_path, 1, 0, size=512, classes=2, seed=0) / "train" / "circle" / "00000.jpg"
    fast = ImageTransform("standard", 32, train=False)(path.read_bytes(), str(path))
    with Image.open(path) as image:
        slow = image.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR, box=(32, 32, 480, 480))
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    reference = (torch.from_numpy(np.asarray(slow).copy()).permute(2, 0, 1) / 255 - mean) / std
    assert (fast - reference).abs().mean() < 0.1  # a few grey levels: the noise averages differently


def test_bad_layouts_are_one_line_data_errors(shapes: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such folder") as error:
        ImageFolder(tmp_path / "nowhere", "train")
    assert one_line(error).startswith(f"[dataset] root '{tmp_path / 'nowhere'}'")
    root = copy_tree(shapes, tmp_path / "tree")
    train_only = copy_tree(shapes / "train", tmp_path / "train_only" / "train").parent
    with pytest.raises(DataError, match="no such folder") as error:
        ImageFolder(train_only, "val")
    assert one_line(error).startswith(str(train_only / "val"))
    (root / "val" / "hexagon").mkdir()
    (root / "val" / "hexagon" / "0.jpg").write_bytes(b"x")
    with pytest.raises(DataError, match="class folder not in") as error:
        ImageFolder(root, "val")
    assert "hexagon" in one_line(error)
    (root / "train" / "hexagon").mkdir()
    with pytest.raises(DataError, match="empty class folder") as error:
        ImageFolder(root, "train")
    assert str(root / "train" / "hexagon") in one_line(error)
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="no class folders"):
        ImageFolder(empty, "train")
    with pytest.raises(DataError, match="val") as error:
        ImageFolder(empty, "val")
    assert str(empty / "val") in one_line(error)
    with pytest.raises(ConfigError, match="on_bad_sample"):
        ImageFolder(shapes, "train", on_bad_sample="ignore")


def test_garbage_jpeg_fails_verify_and_getitem_or_is_skipped(
    shapes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_tree(shapes, tmp_path / "tree")
    bad = root / "train" / "cross" / "00002.jpg"
    bad.write_bytes(b"this is not a jpeg at all" * 10)
    truncated = root / "train" / "square" / "00000.jpg"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    folder = ImageFolder(root, "train", image_size=16)
    i_bad = folder.samples.index((str(bad), 1))
    i_cut = folder.samples.index((str(truncated), 2))
    found = folder.verify(range(len(folder)))
    assert [i for i, _ in found] == [i_bad]  # a header check: the truncated file's header is intact
    assert str(bad) in found[0][1] and "\n" not in found[0][1]
    for index in (i_bad, i_cut):
        with pytest.raises(DataError, match="not a decodable image") as error:
            folder[index]
        assert folder.samples[index][0] in one_line(error)
    skipping = ImageFolder(root, "train", image_size=16, on_bad_sample="skip")
    with caplog.at_level(logging.WARNING, logger="mpicrossbow.data.encoded"):
        for _ in range(2):
            torch.manual_seed(0)
            x, y = skipping[i_bad]
    torch.manual_seed(0)
    assert y == 1 and torch.equal(x, folder[i_bad + 1][0])  # the next sample, drawn with the same RNG state
    assert skipping.bad_samples == [str(bad)]
    assert sum(str(bad) in r.getMessage() for r in caplog.records) == 1


def test_shards_hold_the_folder_and_give_the_same_tensors(shapes: Path, packed: Path) -> None:
    for split in ("train", "val"):
        folder = ImageFolder(shapes, split, image_size=20)
        shards = Shards(packed, split, image_size=20)
        assert shards.pre_shuffled and shards.classes == folder.classes and len(shards) == len(folder)
        rel = {}
        for i in range(len(shards)):
            shard, row = shards.locate(i)
            rel[shards.shard(shard)["paths"][row].decode()] = i
        assert Counter((shards.targets[i], p) for p, i in rel.items()) == Counter(
            (label, str(Path(path).relative_to(shapes / split))) for path, label in folder.samples
        )
        assert shards.targets != folder.targets or split == "val"  # permuted once by the pack seed
        for j in (0, len(folder) - 1):
            i = rel[str(Path(folder.samples[j][0]).relative_to(shapes / split))]
            torch.manual_seed(11)
            a = folder[j]
            torch.manual_seed(11)
            b = shards[i]
            assert a[1] == b[1] and torch.equal(a[0], b[0])
        assert shards.verify(range(len(shards))) == []


def test_shards_open_lazily_and_pickle_without_handles(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = Shards(packed, "train", image_size=16)
    assert shards._open == {}
    shards[0]
    shards[len(shards) - 1]
    assert set(shards._open) == {0, 2}
    monkeypatch.setattr("mpicrossbow.data.shards.MAX_OPEN", 1)
    shards[shards.offsets[1]]
    assert set(shards._open) == {1}
    copy = pickle.loads(pickle.dumps(shards))
    assert copy._open == {} and copy.encoded(0) == shards.encoded(0)
    shards.close()


def test_pack_resumes_only_what_is_missing(
    shapes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dst = tmp_path / "packed"
    assert pack_main([str(shapes), str(dst), "--shards", "3", "--seed", "1"]) == 0
    files = sorted(dst.glob("*.h5"))
    assert [f.name for f in files][:3] == [f"train-0000{k}-of-00003.h5" for k in range(3)]
    before = {f.name: f.stat().st_mtime_ns for f in files}
    (dst / "train-00001-of-00003.h5").unlink()  # killed half-way: one shard missing, one being written
    (dst / "val-00002-of-00003.h5").rename(dst / "val-00002-of-00003.h5.partial")
    (dst / "index.json").unlink()
    with caplog.at_level(logging.INFO, logger="mpicrossbow.data.pack"):
        pack(shapes, dst, shards=3, seed=1)
    skipped = {r.getMessage().split(":")[0] for r in caplog.records if "complete, skipped" in r.getMessage()}
    assert {Path(s).name for s in skipped} == set(before) - {
        "train-00001-of-00003.h5",
        "val-00002-of-00003.h5",
    }
    after = {f.name: f.stat().st_mtime_ns for f in dst.glob("*.h5")}
    assert after.keys() == before.keys() and not list(dst.glob("*.partial"))
    assert all(
        after[n] == before[n] for n in before if n not in ("train-00001-of-00003.h5", "val-00002-of-00003.h5")
    )
    assert len(Shards(dst, "train")) == 4 * TRAIN
    assert pack_main([str(shapes), str(tmp_path / "x"), "--shards", "999"]) == 2


def test_truncated_shard_and_missing_index_are_data_errors(packed: Path, tmp_path: Path) -> None:
    dst = tmp_path / "broken"
    dst.mkdir()
    for f in packed.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cut = dst / "train-00001-of-00003.h5"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    shards = Shards(dst, "train", image_size=16)
    shards[0]
    with pytest.raises(DataError, match="re-run") as error:
        shards[shards.offsets[1]]
    assert str(cut) in one_line(error)
    with pytest.raises(
        DataError, match="re-run"
    ):  # a broken shard is not a bad sample: skip does not hide it
        Shards(dst, "train", image_size=16, on_bad_sample="skip")[shards.offsets[1]]
    (dst / "index.json").write_text('{"format": "mpicrossbow-shards-1", "splits": {"train": {}}}')
    with pytest.raises(DataError, match="malformed") as error:
        Shards(dst, "train")
    assert str(dst / "index.json") in one_line(error)
    (dst / "index.json").unlink()
    with pytest.raises(DataError, match=r"index\.json") as error:
        Shards(dst, "train")
    assert "re-run" in one_line(error)


def test_shards_through_forked_dataloader_workers(packed: Path) -> None:
    shards = Shards(packed, "val", augment="none", image_size=8)
    shards[0]  # the parent holds an open shard before the workers fork
    alone = torch.cat([x for x, _ in DataLoader(shards, batch_size=4)])
    forked = DataLoader(shards, batch_size=4, num_workers=2, multiprocessing_context="fork")
    assert torch.equal(torch.cat([x for x, _ in forked]), alone)
    shards.close()
