"""Horovod's ``examples/pytorch/pytorch_mnist.py``, ported to mpicrossbow's embedded API line by line.

Each ``hvd.`` call has its counterpart here, and a comment names it (docs/embedded.md has the table). The
data are the bundled 8x8 digits instead of MNIST (nothing downloads), so the network is a size smaller;
everything else keeps Horovod's shape: the rate scaled by the number of ranks, the evaluation set sharded
with every sample counted, and ``metric_average`` through ``xb.allreduce``.

    mpiexec -n 2 python examples/horovod_port.py
    mpiexec -n 3 python examples/horovod_port.py --rule SMA --epochs 6
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn, optim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's data/ package
import mpicrossbow as xb  # noqa: E402
from data.digits import digits_dataset  # noqa: E402


class Net(nn.Module):
    """Horovod's example network, sized for 1x8x8 digits: two convolutions, dropout, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(20 * 2 * 2, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(value: float) -> float:
    """Horovod's ``metric_average``: ``hvd.allreduce(tensor, name=...)`` averages over the ranks."""
    return xb.allreduce(value)  # hvd.allreduce(torch.tensor(value)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description="Horovod's PyTorch MNIST example on mpicrossbow")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--test-batch-size", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05, help="one rank's rate (scaled by the ranks)")
    parser.add_argument(
        "--lr-cap",
        type=float,
        default=0.5,
        help="the most the scaled rate may be (model averaging needs one)",
    )
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--rule", default="BSP", help="the exchange rule (Horovod: always allreduce)")
    args = parser.parse_args()

    world = xb.init()  # hvd.init(); torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(args.seed)

    train_dataset = digits_dataset("train")
    # hvd: DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank()) + DataLoader
    train_loader = xb.shard(train_dataset, args.batch_size, seed=args.seed)
    test_dataset = digits_dataset("val")
    # hvd: DistributedSampler(test_dataset, ...): here every sample once, none padded or dropped
    test_loader = xb.shard(test_dataset, args.test_batch_size, evaluation=True)

    model = Net().to(world.device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    # hvd.broadcast_parameters + hvd.broadcast_optimizer_state + hvd.DistributedOptimizer, and
    # lr * hvd.size() (Horovod's lr_scaler for allreduce)
    model, optimizer = xb.distribute(
        model, optimizer, rule=args.rule, lr_scaling="linear", lr_cap=args.lr_cap
    )

    for epoch in range(1, args.epochs + 1):
        model.train()
        for data, target in train_loader:  # hvd: train_sampler.set_epoch(epoch) is implicit here
            data, target = data.to(world.device), target.to(world.device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()

        with xb.consensus(model):  # the rule's model (for BSP: every rank's own, all equal)
            model.eval()
            test_loss, correct = 0.0, 0.0
            with torch.no_grad():
                for data, target in test_loader:
                    data, target = data.to(world.device), target.to(world.device)
                    output = model(data)
                    test_loss += F.nll_loss(output, target, reduction="sum").item()
                    correct += output.argmax(dim=1).eq(target).sum().item()
        # Horovod divides by len(test_sampler) and averages the ranks' means, which weighs unequal shares
        # alike; summing the sums and the counts gives the mean over every sample.
        samples = xb.allreduce(test_loader.samples, op="sum")
        test_loss = xb.allreduce(test_loss, op="sum") / samples
        accuracy = xb.allreduce(correct, op="sum") / samples
        rank_mean = metric_average(correct / max(test_loader.samples, 1))  # Horovod's own recipe, for show
        if world.rank == 0:
            print(
                f"epoch {epoch}: test set {samples} samples: average loss {test_loss:.4f}, "
                f"accuracy {100 * accuracy:.2f} % (mean of the ranks' accuracies {100 * rank_mean:.2f} %)",
                flush=True,
            )
        print(f"rank {world.rank}: {test_loader.samples} test samples, {correct:.0f} correct", flush=True)
    xb.finish()


if __name__ == "__main__":
    main()
