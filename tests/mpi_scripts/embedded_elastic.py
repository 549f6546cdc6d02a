"""examples/train_digits.py under ``mpiexec --with-ft ulfm``, one rank SIGKILLed mid-epoch on request.

    mpiexec --with-ft ulfm -n 4 python tests/mpi_scripts/embedded_elastic.py OUT RULE KILL_RANK KILL_STEP [S]
    mpiexec --with-ft ulfm -n 4 python tests/mpi_scripts/embedded_elastic.py OUT RULE,RULE,... -1 0

``KILL_RANK`` (-1: none) SIGKILLs itself right after its optimizer step number ``KILL_STEP`` (1-based: the
hook runs after the rule's own post-hook, so the step's exchange is done on that rank; the others meet
the loss in their next collective). ``S`` (seconds, default none): the example's ``xb.init`` asks for
``replace`` too, and every rank sleeps that long after each optimizer step while the world is short of 4
ranks, so the survivors are still training when the replacement they spawn (this script again, from its
top) has started. After ``main`` returns (``xb.finish`` left the consensus in the model), every rank
writes ``OUT/rank-<rank>.pt`` (several rules, uninterrupted one after another in one job:
``OUT/<rule>/rank-<rank>.pt``): its
flat weights, its validation accuracy, its rank, the world size it ended in, and the ranks an
``xb.allreduce`` after the job counted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mpicrossbow as xb  # noqa: E402
from examples import train_digits as example  # noqa: E402

#: The world's ranks at the start, and again once a replacement joined.
WHOLE = 4


def replacing() -> Any:
    """``xb.init``, with ``elastic={"replace": True}`` in place of the example's ``elastic="auto"``."""
    init = xb.init

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return init(*args, **{**kwargs, "elastic": {"replace": True}})

    return wrapped


def short_world_sleep(slow: float) -> None:
    """After an optimizer step: sleep ``slow`` seconds while the world is short of its 4 ranks (from the
    loss until the replacement joined), so the survivors still train when it is up, and only then."""
    if xb.init().size < WHOLE:
        time.sleep(slow)


def killing(kill_rank: int, kill_step: int, slow: float) -> Any:
    """``xb.distribute``, with a hook on ``kill_rank``'s optimizer: SIGKILL after step ``kill_step``; and on
    every rank a sleep of ``slow`` seconds after each step taken while the world is short
    (:func:`short_world_sleep`)."""
    distribute = xb.distribute

    def wrapped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        model, optimizer = distribute(model, optimizer, **kwargs)
        if slow:
            optimizer.register_step_post_hook(lambda *_: short_world_sleep(slow))
        if xb.init().rank == kill_rank:
            steps = [0]

            def hook(*_: Any) -> None:
                steps[0] += 1
                if steps[0] == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)

            optimizer.register_step_post_hook(hook)
        return model, optimizer

    return wrapped


def train_and_save(out: Path, rule: str) -> None:
    """The example's ``main`` under ``rule``, then this rank's state to ``out/rank-<rank>.pt``."""
    model = example.main(["--rule", rule, "--log-interval", "1000"])
    _, test_set, _ = example.datasets_and_model("digits")
    loader = torch.utils.data.DataLoader(test_set, batch_size=512)
    accuracy = example.test(model, torch.device("cpu"), loader)
    world = xb.init()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ranks = xb.allreduce(1, op="sum")  # the API's own collective after the job: over the survivors
    state = {"weights": weights, "accuracy": accuracy, "rank": world.rank, "size": world.size, "ranks": ranks}
    torch.save(state, out / f"rank-{world.rank}.pt")


def main() -> None:
    out, rules, kill_rank, kill_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    slow = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    if slow:
        xb.init = replacing()
    xb.distribute = killing(kill_rank, kill_step, slow)
    if "," not in rules:
        train_and_save(out, rules)
    else:  # uninterrupted runs, one after another in this job (torch starts once): OUT/<rule>/rank-*.pt
        assert kill_rank < 0, "several rules: uninterrupted runs only"
        for rule in rules.split(","):
            (out / rule).mkdir(exist_ok=True)
            train_and_save(out / rule, rule)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
