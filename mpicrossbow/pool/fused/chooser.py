"""The fused engine's one chooser: which path runs the replicas, which form a step takes, and every timing.

**Paths.** The fused engine runs its m replicas' forward on the first of these paths that can run the network:

* ``layers`` — the layer-by-layer fuser (:mod:`.fused_network`): every layer one the fuser widens; refused (a
  ContractError) when building it meets another layer, or when its first forward meets an input layout its
  layers do not take;
* ``replicated`` — replica 0's own ``forward()`` on every replica's values (:mod:`.replicated_network`);
  refused by a ContractError in its first forward (control flow on values, arithmetic on a parameter outside
  any operator on the input, an in-place write into the input);
* ``vmapped`` — ``torch.func.vmap`` (:mod:`.vmapped`); refused by vmap's own RuntimeError, whose message
  starts with ``vmap:`` (data-dependent control flow, ``.item()``);
* ``unfused`` — the replicas one after another on the same rows, which runs anything.

Only those refusals move the choice on; any other exception is a real error and is raised. A ``layers``
network refused at its first forward trains ``unfused``: its chains are already wired to the gradient
watchers. Running state a refused first forward moved (batch norm) is restored by the pool.

**Forms.** On a fused path, ``auto`` then times the fused step against the unfused one over the first training
steps (one untimed warm-up step each, then ``rounds`` timed steps each in the order ABBA…; load from other
processes only adds time, so the fastest step is the steadiest estimate): fusing pays for small batches and
can lose for large ones (0.77–0.86× at batch 128 on ResNet-20 and LeNet, benchmarks/results/pool.md). Both
forms compute every replica's own step on the same storage, so the trial steps are real training steps.
**Needed**: without it (``fuse = always``) ResNet-20 at m = 8, b = 128 trained at 0.58× the serial engine
(benchmarks/pool.py's method, one thread), where the trial picks the unfused form; the same trade-off (one
wide kernel against m narrow ones) exists on a GPU, not measured there.

**The setting**, ``[pool] fuse``: ``auto`` (the first path that runs, then the timed trial), ``always`` (that
path, untimed), ``layers`` / ``replicated`` / ``vmapped`` (pin that path: its refusal is an error naming it),
``never`` (unfused). **The record**: each decision is logged as it is made, and :meth:`Chooser.record` holds
the path, the paths refused and why, the step forms' times and each convolution's forms and times, for the
run's metrics.h5 (attribute ``fused_choice``, JSON).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ...errors import ContractError

log = logging.getLogger(__name__)

FUSED, UNFUSED = "fused", "unfused"
#: The fused paths, in the order ``auto`` and ``always`` try them.
PATHS = ("layers", "replicated", "vmapped")
#: ``[pool] fuse``'s values.
SETTINGS = ("auto", "always", "never", *PATHS)


class Chooser:
    """One fused pool's path and step form, decided by ``setting`` (see the module docstring).

    ``builders`` makes each path's network for a pool of ``learners`` (one learner has nothing to fuse:
    ``auto`` runs it as the plain replica it is, without a trial); :meth:`network` builds the first allowed,
    :meth:`refuses` / :meth:`next_network` move on after a refusal at the first step, and :meth:`form`,
    :attr:`timing`, :meth:`record_step` run the timed trial between the fused and the unfused step.
    """

    def __init__(
        self,
        setting: str,
        builders: Mapping[str, Callable[[], nn.Module]],
        learners: int = 2,
        rounds: int = 4,
    ) -> None:
        if setting not in SETTINGS:
            raise ValueError(f"[pool] fuse = {setting!r}: choose one of {', '.join(SETTINGS)}")
        self.setting, self.builders, self.rounds = setting, builders, rounds
        if setting == "auto" and learners == 1:
            setting = "never"
        self._paths = list(PATHS) if setting in ("auto", "always", "never") else [setting]
        #: The fused path built now (``unfused`` once none runs the network).
        self.path = self._paths[0]
        #: Why each refused path was refused.
        self.refused: dict[str, str] = {}
        #: The step form every later step runs; None while ``auto`` is still timing.
        self.chosen: str | None = None if setting == "auto" else UNFUSED if setting == "never" else FUSED
        #: Whether the step form is timed (``auto``, more than one learner).
        self.trial = self.chosen is None
        if self.chosen == UNFUSED:
            log.info(
                "fused engine: the %d replica(s) run one after another ([pool] fuse = %s)",
                learners,
                self.setting,
            )
        #: Timed seconds per step form (the trial's record).
        self.times: dict[str, list[float]] = {FUSED: [], UNFUSED: []}
        self._schedule: list[tuple[str, bool]] = []
        if self.chosen is None:
            self._schedule = [(FUSED, False), (UNFUSED, False)]
            for r in range(rounds):
                self._schedule += [(form, True) for form in ((FUSED, UNFUSED), (UNFUSED, FUSED))[r % 2]]
        #: Each convolution's form, by site (filled once the path has run).
        self.conv_forms: dict[str, dict[str, Any]] = {}

    def network(self) -> nn.Module:
        """The network of the first path whose building is not refused (under ``never`` too: its parameters
        are the optimizer's)."""
        while True:
            try:
                return self.builders[self.path]()
            except ContractError as exc:
                self._refuse(str(exc), at_first_step=False)

    def refuses(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by the current path's first step, is that path's refusal (see above)."""
        if self.path == "vmapped":
            return isinstance(exc, RuntimeError) and str(exc).startswith("vmap:")
        return isinstance(exc, ContractError)

    def next_network(self, exc: BaseException) -> nn.Module | None:
        """After the current path refused its first step with ``exc``: the next path's network, or None
        (unfused from now on). A pinned path's refusal is an error naming it."""
        self._refuse(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, at_first_step=True)
        return self.network() if self._paths else None

    def _refuse(self, reason: str, at_first_step: bool) -> None:
        """The current path cannot run the network: note why, move to the next (see the module docstring)."""
        path = self.path
        if self.setting == path:
            raise ContractError(f"[pool] fuse = {path}: the {path} path cannot run this network: {reason}")
        self.refused[path] = reason = reason.split(";")[0]  # the fuser's list of layers stays in the error
        self._paths = [] if at_first_step and path == "layers" else self._paths[1:]
        self.path = self._paths[0] if self._paths else UNFUSED
        log.info("fused engine: the %s path cannot run this network (%s); next: %s", path, reason, self.path)
        if not self._paths:
            self.chosen, self._schedule = UNFUSED, []

    def ran(self, network: nn.Module) -> None:
        """The current path ran its first step: note each convolution's form, log the path."""
        for site, module in _form_sites(network):
            form = getattr(module, "form", None)  # a convolution's; a 1-D one's inner 2-D layer is not apart
            if isinstance(form, str) and not any(site.startswith(f"{s}.") for s in self.conv_forms):
                self.conv_forms[site] = {"form": form}
        forms = ", ".join(f"{site} {c['form']}" for site, c in self.conv_forms.items())
        log.info("fused engine: runs the %s path%s", self.path, f"; convolutions: {forms}" if forms else "")

    def form(self) -> str:
        """The step form to run next (``fused`` or ``unfused``)."""
        return self.chosen or self._schedule[0][0]

    @property
    def timing(self) -> bool:
        """Whether the next step should be timed (and :meth:`record_step` given its time)."""
        return self.chosen is None and self._schedule[0][1]

    @property
    def steps_to_decide(self) -> int:
        """Training steps left before the step form is chosen (0 once chosen)."""
        return len(self._schedule) if self.chosen is None else 0

    def record_step(self, seconds: float | None) -> None:
        """The step in :meth:`form` is done (``seconds``: its time when :attr:`timing`); the last decides."""
        if self.chosen is not None:
            return
        form, timed = self._schedule.pop(0)
        if timed and seconds is not None:
            self.times[form].append(seconds)
        if not self._schedule:
            fastest = {f: min(t) for f, t in self.times.items()}
            self.chosen = min(fastest, key=fastest.__getitem__)  # a tie keeps the fused form
            log.info(
                "fused engine: a step takes %.3f ms fused (%s path), %.3f ms unfused; runs %s from now on",
                fastest[FUSED] * 1e3,
                self.path,
                fastest[UNFUSED] * 1e3,
                self.chosen,
            )

    def record(self) -> dict[str, Any]:
        """The decisions and their measurements, for the run's record (metrics.h5 attributes)."""
        best = {form: min(times) * 1e3 for form, times in self.times.items() if times}
        choice = {
            "setting": self.setting,
            "path": self.path if self.chosen != UNFUSED else UNFUSED,
            "refused": self.refused,
            "form": self.chosen,
            "form_ms": best,
            "conv_forms": self.conv_forms,
        }
        return {"fused_path": choice["path"], "fused_choice": json.dumps(choice)}

    def state_dict(self) -> dict[str, Any]:
        """Where the trial stands (or what it chose), for a checkpoint: a resumed run keeps the same forms."""
        return {"chosen": self.chosen, "times": self.times, "schedule": self._schedule}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` where the form is timed; any other setting stays as configured."""
        if self.trial:
            self.chosen = state["chosen"]
            self.times = {form: list(times) for form, times in state["times"].items()}
            self._schedule = [(form, bool(timed)) for form, timed in state["schedule"]]


def _form_sites(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``network`` by name, and the call-site modules of a replicated forward."""
    sites = list(network.named_modules())
    dispatcher = getattr(network, "dispatcher", None)
    for i, layer in enumerate(getattr(dispatcher, "state", {}).values()):
        if isinstance(layer, nn.Module):
            sites += list(layer.named_modules(prefix=f"call{i}"))
    return sites


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timing measures them (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
