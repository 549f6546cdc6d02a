"""Each rule twice in one MPI job: under crossbow-launch's own code path, then in examples/train_digits.py.

    mpiexec -n 2 python tests/mpi_scripts/embedded_runs.py OUT EPOCHS RULE [RULE ...]

A RULE is a name with optional settings, one argument: ``"EASGD mode=async"``.

For every rule, the same data (digits), network (the example's ``Net``), seed, batch size and schedule
(SGD with momentum, the learning rate times 0.7 every epoch) train first through ``prepare_session`` and
``train`` (what ``crossbow-launch`` runs, with the cfg below), then through the example script's ``main``
with the embedded API. Rank 0 writes ``OUT/embedded.json``: per rule, both final validation accuracies and
the largest difference between the two final models' weights (the rule's model: learner 0's, or SMA's z,
EASGD's centre, the servers' w, GOSGD's weighted mean). Torch starts once per rank for all of it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples import train_digits as example  # noqa: E402
from mpicrossbow.config import load_config  # noqa: E402
from mpicrossbow.training.run.runner import prepare_session, train  # noqa: E402

CFG = """
RULE={rule}
MODELFILE=examples.train_digits
MODELCLASS=Net
DEVICES=cpu
[session]
epochs = {epochs}
seed = {seed}
progress = off
output = {out}
[optim]
lr = {lr}
momentum = 0.9
schedule = step
step_epochs = 1
gamma = 0.7
[data]
dataset = digits
batch_size = {batch}
"""
SEED, LR, BATCH = 1, 0.05, 16


def launch(rule: str, epochs: int, out: Path) -> tuple[float, torch.Tensor]:
    """crossbow-launch's path: (final validation accuracy, the rule's final weights)."""
    name, *settings = rule.split()
    text = CFG.format(rule=name, epochs=epochs, seed=SEED, out=out / name, lr=LR, batch=BATCH)
    text += "[rule]\n" + "\n".join(settings) + "\n"
    world, session, code = prepare_session(load_config(text=text))
    if code:
        raise SystemExit(code)
    result = train(world, session)
    assert session.rule is not None and session.pool is not None
    final = session.rule.eval_params()
    return result.val_accuracy, (session.pool.learners[0].params if final is None else final).clone()


def embedded(rule: str, epochs: int) -> tuple[float, torch.Tensor]:
    """The example script's path: (final validation accuracy, its model's weights after xb.finish())."""
    argv = ["--rule", rule, "--epochs", str(epochs), "--seed", str(SEED), "--lr", str(LR)]
    argv += ["--batch-size", str(BATCH), "--log-interval", "1000000"]
    model = example.main(argv)
    _, val_set, _ = example.datasets_and_model("digits")
    loader = torch.utils.data.DataLoader(val_set, batch_size=512)
    accuracy = example.test(model, torch.device("cpu"), loader)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return accuracy, flat


def main(argv: list[str]) -> int:
    out, epochs, rules = Path(argv[0]), int(argv[1]), argv[2:]
    rows = []
    for rule in rules:
        launched, launched_weights = launch(rule, epochs, out)
        mine, my_weights = embedded(rule, epochs)
        difference = float((launched_weights - my_weights).abs().max())
        rows.append({"rule": rule, "launch": launched, "embedded": mine, "max_weight_difference": difference})
    if MPI.COMM_WORLD.rank == 0:
        (out / "embedded.json").write_text(json.dumps(rows, indent=1))
        print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
