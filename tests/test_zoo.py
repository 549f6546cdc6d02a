"""models/imagenet_resnet.py: ResNet-18/50 with torchvision's parameter counts, shapes and state_dict names.

torchvision does not import beside this venv's torch; the direct comparison runs where it does and is
skipped otherwise. The fingerprints below pin the same facts without it: sha256 of the ``name (shape)``
lines of torchvision 0.29.1's ``resnet18(weights=None).state_dict()`` / ``resnet50(...)``, in order (measured
in a throwaway venv with torch 2.14.1 + torchvision 0.29.1; there a saved torchvision state_dict also loaded
with ``strict=True`` and gave bitwise-equal eval logits).
"""

from __future__ import annotations

import hashlib
import importlib
import io
import math
import re
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from torch import nn

from models.imagenet_resnet import Bottleneck, ResNet, resnet18, resnet50

FACTORIES: dict[str, Callable[..., ResNet]] = {"resnet18": resnet18, "resnet50": resnet50}
PARAMETERS = {"resnet18": 11_689_512, "resnet50": 25_557_032}
TORCHVISION_FINGERPRINT = {
    "resnet18": "84fb10d9c6905a1cbb020b284537dc97c4f4ec55fb2a780a41152a23a2dd0e9d",
    "resnet50": "d7e4f8bb0a5363446a59c81c3887ccf66900a11651a0ae2dec96d1bb1eb6ea81",
}
KEY = re.compile(
    r"(conv1\.weight|bn1\.\w+|fc\.(weight|bias)"
    r"|layer[1-4]\.\d+\.(conv[1-3]\.weight|bn[1-3]\.\w+|downsample\.0\.weight|downsample\.1\.\w+))"
)


def fingerprint(model: nn.Module) -> str:
    """sha256 of the state_dict's ``name (shape)`` lines, in order."""
    lines = "\n".join(f"{name} {tuple(t.shape)}" for name, t in model.state_dict().items())
    return hashlib.sha256(lines.encode()).hexdigest()


def torchvision_models() -> ModuleType:
    """torchvision.models, or skip: it is absent here, or built for another torch (then import fails)."""
    try:
        return importlib.import_module("torchvision.models")
    except Exception as exc:  # a torchvision built for another torch raises RuntimeError, not ImportError
        pytest.skip(f"torchvision does not import beside torch {torch.__version__}: {exc}")


@pytest.mark.parametrize("name", FACTORIES)
def test_parameter_count(name: str) -> None:
    model = FACTORIES[name]()
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]


@pytest.mark.parametrize("name", FACTORIES)
def test_state_dict_names_and_shapes_are_torchvision_s(name: str) -> None:
    state = FACTORIES[name]().state_dict()
    assert all(KEY.fullmatch(k) for k in state), [k for k in state if not KEY.fullmatch(k)]
    assert fingerprint(FACTORIES[name]()) == TORCHVISION_FINGERPRINT[name]
    shortcuts = sorted({k.split(".downsample")[0] for k in state if ".downsample." in k})
    first = ["layer2.0", "layer3.0", "layer4.0"]
    assert shortcuts == (["layer1.0", *first] if name == "resnet50" else first)


def test_bottleneck_strides_on_the_3x3_convolution() -> None:
    block = resnet50().layer2[0]
    assert isinstance(block, Bottleneck)
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)
    assert block.downsample is not None and block.downsample[0].stride == (2, 2)


@pytest.mark.parametrize("name", FACTORIES)
def test_forward_shapes(name: str) -> None:
    torch.manual_seed(0)
    model = FACTORIES[name](num_classes=7)
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 224, 224)).shape == (1, 7)
        assert model.train()(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_grayscale_input_and_bad_arguments() -> None:
    with torch.no_grad():
        assert resnet18(num_classes=4, in_channels=1).eval()(torch.randn(1, 1, 64, 64)).shape == (1, 4)
    with pytest.raises(ValueError, match="num_classes"):
        resnet18(num_classes=0)
    with pytest.raises(ValueError, match="layers"):
        ResNet(Bottleneck, (3, 4, 6))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", FACTORIES)
def test_state_dict_round_trip(name: str) -> None:
    torch.manual_seed(1)
    source = FACTORIES[name](num_classes=5)
    with torch.no_grad():
        source.train()(torch.randn(2, 3, 64, 64))  # move the BatchNorm running statistics off their init
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(2)
    target = FACTORIES[name](num_classes=5)
    target.load_state_dict(torch.load(buffer), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(source.eval()(x), target.eval()(x))


def test_initialisation_is_torchvision_s() -> None:
    torch.manual_seed(0)
    model = resnet50()
    conv = model.layer3[0].conv2  # 256 -> 256, 3x3: He normal, fan out = 256 * 9
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / (256 * 9)), rel=0.05)
    assert torch.all(model.layer1[0].bn3.weight == 1) and torch.all(model.layer1[0].bn3.bias == 0)
    zeroed = resnet50(zero_init_residual=True)
    assert all(torch.all(b.bn3.weight == 0) for layer in (zeroed.layer1, zeroed.layer4) for b in layer)
    assert torch.all(resnet18(zero_init_residual=True).layer2[1].bn2.weight == 0)


@pytest.mark.parametrize("name", FACTORIES)
def test_matches_torchvision(name: str) -> None:
    theirs = getattr(torchvision_models(), name)(weights=None, num_classes=10)
    ours = FACTORIES[name](num_classes=10)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()
    ]
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), theirs.eval()(x))
