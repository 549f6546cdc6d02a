"""EmbeddedJob: one distributed model in a user's own loop, from ``xb.distribute`` to ``xb.finish``.

``xb.distribute`` assembles it (:mod:`.api`); this class runs what follows. Its states:

* **running** — the rule's hooks sit around the user's ``optimizer.step()`` (:class:`.step_hooks.StepHooks`).
  A rank the rule keeps out of training (a parameter server, the asynchronous EASGD centre) never runs:
  :meth:`serve` answers the workers inside ``xb.distribute`` until every worker has finished.
* **finished** — :meth:`finish` drained everything in flight (``rule.finish()``), made the consensus
  consistent on every rank (``rule.sync_state()``, a collective) and left it in the model's weights; the
  hooks are gone and later ``optimizer.step()`` calls are plain local steps.

:meth:`consensus` is what ``with xb.consensus(model)`` shows: for a synchronous rule the rule's model after
``sync_state`` (a collective: every rank enters the block together, as every rank validates together in
``crossbow-launch``); for an asynchronous rule before the end, what this rank holds without communicating
(the server's w as last pulled, or its own replica); after the end, the rule's final model everywhere.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..comm.base import Communicator
from ..errors import CheckpointError, UsageError
from ..launch.world import World
from ..rules.base import Rule
from ..training.checkpoints.checkpoint_files import FORMAT_VERSION, META, atomic_save, rank_file, safe_load
from ..training.run.window import StepWindow, Unguarded
from ..training.tuning.noise_scale import NoiseScale
from .own_model import OwnModel
from .precision_forward import PrecisionForward
from .step_hooks import StepHooks

log = logging.getLogger(__name__)


class EmbeddedJob:
    """The rule, communicator, replica and hooks of one ``xb.distribute`` (see the module doc)."""

    def __init__(
        self,
        world: World,
        rule: Rule,
        comm: Communicator,
        own: OwnModel,
        trains: bool,
        forward: PrecisionForward | None = None,
        noise: NoiseScale | None = None,
        window: StepWindow | None = None,
    ) -> None:
        self.world, self.rule, self.comm, self.own, self.trains = world, rule, comm, own, trains
        #: How the steps and the collectives between them run: elastic training's owner
        #: (``xb.init(elastic=True)``), else :class:`Unguarded` (a lost rank ends the job).
        self.window = window if window is not None else Unguarded()
        #: The model's forward under the job's autocast (None: fp32, the forward untouched).
        self.forward = forward
        #: The gradient noise scale measured around the rule's ``on_gradients`` (``xb.noise_scale()``).
        self.noise = noise if noise is not None else NoiseScale(0, 0.0)
        precision = forward.precision.name if forward is not None else "fp32"
        self.hooks: StepHooks | None = None
        if trains:
            self.hooks = StepHooks(own, rule, precision=precision, noise=self.noise, window=self.window)
        self.finished = False
        #: The folders :meth:`checkpoint` wrote, each once, the latest save last: what the job's last line
        #: names.
        self.written: list[Path] = []

    @property
    def module(self) -> torch.nn.Module:
        """The user's model."""
        return self.own.learner.module

    @property
    def steps(self) -> int:
        """Optimizer steps taken under the rule on this rank."""
        return self.hooks.step if self.hooks is not None else 0

    def serve(self) -> None:
        """A rank that does not train: the rule's server loop until every worker finished, then the end."""
        log.info("rank %d serves for RULE=%s until every worker finished", self.world.rank, self.rule.name)

        def progress(params: torch.Tensor, epoch: float) -> None:
            log.info("serving: the workers are at epoch %.2f", epoch)

        self.rule.serve(progress)
        self.finish()

    def consensus(self) -> torch.Tensor | None:
        """The weights ``xb.consensus`` shows (None: this rank's own replica); see the module doc. In
        elastic training a committed collective, redone over the survivors after a loss."""
        if self.finished:
            return self._consensus()
        return self.window.collective(self._consensus, "xb.consensus")()

    def _consensus(self) -> torch.Tensor | None:
        if self.finished:
            return self.rule.eval_params()
        if self.rule.synchronous:
            self.rule.sync_state()
            return self.rule.eval_params()
        return self.rule.local_consensus()

    def finish(self) -> None:
        """Drain, agree on the consensus, leave it in the model, remove the hooks; idempotent. Collective."""
        if self.finished:
            return
        if self.hooks is not None:
            self.hooks.remove()
        if self.forward is not None:
            self.forward.remove()
        self.own.learner.release()
        self.window.collective(self._drain, "xb.finish")()  # elastic: redone over the survivors after a loss
        self.window.settle("xb.finish")  # elastic: replacements still starting are told the run is over
        final = self.rule.eval_params()
        if final is not None:
            self.own.learner.params.copy_(final)
        self.comm.close()
        self.finished = True
        log.info(
            "RULE=%s finished after %d step(s) on this rank; %s", self.rule.name, self.steps, self.wrote()
        )

    def _drain(self) -> None:
        """Nothing left in flight; the consensus consistent on every rank (collective)."""
        self.rule.finish()
        self.rule.sync_state()

    def wrote(self) -> str:
        """What the job wrote, for its last line: the embedded API writes no run folder nor metrics.h5, only
        the checkpoints the script asked for; the model is the script's to save."""
        if not self.written:
            return "mpicrossbow wrote no files (no run folder, no metrics.h5): save the model yourself"
        last = self.written[-1]
        more = f" (the last of {len(self.written)} xb.checkpoint folders)" if len(self.written) > 1 else ""
        return f"wrote checkpoint {last}{more}; the model is yours to save"

    # ------------------------------------------------------------ checkpoints
    def checkpoint(self, path: Path) -> None:
        """Collective: every rank writes the rule's state and its step count into folder ``path``
        (``rank-NNNNN.pt``, atomically), then rank 0 writes ``meta.pt``; the user saves the model's and the
        optimizer's own ``state_dict`` beside it.

        A folder written before is taken over: its ``meta.pt`` goes first, so it never vouches for rank
        files of two saves, and rank files past the world's size go too. In elastic training the save is a
        committed collective over the fault-tolerant group: a rank lost during it is recovered from like
        any loss and the survivors write the folder again, for the world they form."""
        self._check_checkpointable("xb.checkpoint")
        self.window.collective(self._write_checkpoint, "xb.checkpoint")(path)
        if path in self.written:  # a folder saved again: counted once, as the latest
            self.written.remove(path)
        self.written.append(path)

    def _write_checkpoint(self, path: Path) -> None:
        """One try of :meth:`checkpoint`, over :meth:`_collectives` (the world as it is now)."""
        rank, size, comm = self.world.rank, self.world.size, self._collectives()
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / META).unlink(missing_ok=True)
        if comm is not None:  # the folder exists, and vouches for nothing, before any rank writes into it
            comm.bcast(None, root=0)
        state = {
            "version": FORMAT_VERSION,
            "rule": self.rule.state_dict(),
            "step": self.steps,
            "noise_scale": self.noise.state_dict(),
        }
        atomic_save(state, rank_file(path, rank))
        if comm is not None:  # every rank's file is complete before the meta file vouches for them
            comm.allgather(None)
        if rank == 0:
            for stale in path.glob("rank-*.pt"):  # a larger world's, before a rank was lost
                if stale.stem[5:].isdigit() and int(stale.stem[5:]) >= size:
                    stale.unlink(missing_ok=True)
            meta = {"version": FORMAT_VERSION, "rule": self.rule.name, "size": size}
            atomic_save(meta, path / META)

    def _collectives(self) -> Any:
        """The mpi4py communicator the API's own collectives go over (None: one process without MPI): in
        elastic training the members' own, which a loss revokes (:meth:`StepWindow.members`; a survivor
        blocked in the world's would wait on the lost rank, or fail the job), else the world's."""
        return self.window.members(self.world.mpi)

    def restore(self, path: Path) -> None:
        """Load what :meth:`checkpoint` wrote (same rule and rank count) into the running job."""
        self._check_checkpointable("xb.restore")
        meta = safe_load(path / META, "meta file")
        if meta.get("rule") != self.rule.name or meta.get("size") != self.world.size:
            raise CheckpointError(
                f"checkpoint {path} was written by RULE={meta.get('rule')} on {meta.get('size')} rank(s); "
                f"this job runs RULE={self.rule.name} on {self.world.size}"
            )
        state = safe_load(rank_file(path, self.world.rank), "rank file")
        self.rule.load_state_dict(state["rule"])
        assert self.hooks is not None
        self.hooks.step = int(state["step"])
        self.noise.load_state_dict(state.get("noise_scale", {}))

    def _check_checkpointable(self, what: str) -> None:
        if self.finished:
            raise UsageError(f"{what} after xb.finish(): the rule's state is gone; call it before")
        if not self.rule.synchronous:
            raise UsageError(
                f"{what} needs a synchronous rule (every rank at the same step); RULE={self.rule.name} is "
                "asynchronous: save the model after xb.finish() instead"
            )
