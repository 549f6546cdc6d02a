"""A small network on the bundled 8x8 digits (or MNIST-1D), in the shape of PyTorch's classic MNIST example.

``examples/train_digits_plain.py`` is a plain single-process script: argparse, a ``Net``, ``train`` and
``test`` once per epoch, a StepLR schedule. ``examples/train_digits.py`` is the same script plus nine lines
of mpicrossbow's embedded API that make it an MPI job under any exchange rule (docs/embedded.md shows the
diff; tests/test_embedded.py keeps it that small):

    python examples/train_digits_plain.py                       # digits, 8 epochs: seconds on a CPU
    mpiexec -n 2 python examples/train_digits.py --rule SMA
    mpiexec -n 4 python examples/train_digits.py --rule ASGD        # rank 0 serves, ranks 1-3 train
    python examples/train_digits.py --rule BSP --dataset mnist1d --epochs 20    # one process works too
"""

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's data/ and models/ packages
import mpicrossbow as xb  # noqa: E402
from data.digits import digits_dataset  # noqa: E402
from models.mnist1d import MNIST1DCNN  # noqa: E402
from mpicrossbow.data.mnist1d import mnist1d  # noqa: E402


class Net(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two fully connected layers, for 1x8x8 digit images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the 10 digit classes."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def datasets_and_model(name: str) -> tuple[Dataset, Dataset, nn.Module]:
    """The training and test sets of ``name`` and a fresh network for them."""
    if name == "digits":
        return digits_dataset("train"), digits_dataset("val"), Net()
    cache = str(ROOT / "data" / "mnist1d")  # generated on first use by the mnist1d package, then cached
    return mnist1d("train", cache=cache), mnist1d("val", cache=cache), MNIST1DCNN()


def train(
    args: argparse.Namespace,
    model: nn.Module,
    device: torch.device,
    loader: Iterable,
    optimizer: optim.Optimizer,
    epoch: int,
) -> None:
    """One epoch over ``loader``."""
    model.train()
    for batch, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if batch % args.log_interval == 0:
            seen = batch * len(data)
            print(f"Train epoch {epoch} [{seen}/{len(loader.dataset)}] loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def test(model: nn.Module, device: torch.device, loader: DataLoader) -> float:
    """Print and return the accuracy of ``model`` on ``loader``."""
    model.eval()
    total_loss, correct = 0.0, 0
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        output = model(data)
        total_loss += F.cross_entropy(output, target, reduction="sum").item()
        correct += (output.argmax(dim=1) == target).sum().item()
    n = len(loader.dataset)
    print(
        f"Test: average loss {total_loss / n:.4f}, accuracy {correct}/{n} ({100 * correct / n:.1f}%)",
        flush=True,
    )
    return correct / n


def main(argv: list[str] | None = None) -> nn.Module:
    """Parse ``argv``, train, test after every epoch; returns the trained model."""
    parser = argparse.ArgumentParser(description="Train a small network on digits or MNIST-1D")
    parser.add_argument("--dataset", choices=["digits", "mnist1d"], default="digits")
    parser.add_argument("--batch-size", type=int, default=16, help="training batch size")
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning-rate factor per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=20, help="batches between log lines")
    parser.add_argument("--save-model", default="", help="file to save the trained weights to")
    parser.add_argument("--rule", default="SMA", help="exchange rule: BSP, SMA, EASGD, GOSGD, ASGD, ...")
    args = parser.parse_args(argv)
    xb.init(elastic="auto")  # under mpiexec --with-ft ulfm: a lost rank is dropped, the rest go on
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    train_set, test_set, model = datasets_and_model(args.dataset)
    train_loader = xb.shard(train_set, args.batch_size, args.seed)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)
    model = model.to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = xb.distribute(model, optimizer, rule=args.rule)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in xb.epochs(1, args.epochs + 1):  # a replacement rank goes on at the survivors' epoch
        train(args, model, device, train_loader, optimizer, epoch)
        with xb.consensus(model):
            test(model, device, test_loader)
        scheduler.step()
    if xb.finish() and args.save_model:
        torch.save(model.state_dict(), args.save_model)
    return model


if __name__ == "__main__":
    main()
