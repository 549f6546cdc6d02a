"""POSTLOCALSGD — post-local SGD: BSP for a warm-up, then SMA, LOCALSGD or EASGD (Lin et al., ICLR 2020,
"Don't use large mini-batches, use local SGD"; PyTorch's ``PostLocalSGDOptimizer`` with
``PostLocalSGDState(start_localSGD_iter=...)``).

Who sends what to whom, and when:

* **Before the switch** the rule is BSP with BSP's own keys written ``bsp_<key>``: every step one allreduce
  of the summed gradients (``bsp_mode = grad``) or of the weights after the local step (``avg``); every
  replica of every rank stays the same.
* **The switch** comes after the exchange of the last BSP step: with ``switch = epoch`` once
  ``round(switch_epoch × steps per epoch)`` steps have run; with ``switch = lr_drop`` after the first step
  whose learning rate is lower than the one before (the step of the drop still averages gradients). Both
  are functions of the step count and of the schedule, the same on every rank; one allreduce of four numbers
  checks it (a rank at another step is a RuntimeError) and compares checksums of the replicas (a difference
  is logged). Then BSP stops watching backward, the BatchNorm statistics become the mean over every learner
  (exact), and the later rule is bound: its ``bind`` broadcasts rank 0's learner 0, which every replica
  already equals. Rank 0 logs the step and epoch once.
* **After the switch** the later rule runs exactly as it does on its own, with its keys written
  ``then_<key>`` (``then_alpha``, ``then_period``, ...): SMA's one allreduce per step, LOCALSGD's mean every
  H steps, EASGD's elastic average every τ steps.

The rule holds a BSP and the later rule (composition) and forwards every hook to the active one. Both must be
synchronous: ``then`` names one of :data:`LATER`, and an asynchronous choice (``then = ASGD``, or EASGD with
``then_mode = async``) is a ConfigError. Checkpoints hold the phase, the switch step and the active rule's
state; a checkpoint taken after the switch binds the later rule when it is loaded and keeps the replicas it
restored, so a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..comm.base import Communicator
from ..config.fields import setting
from ..errors import ConfigError
from .base import Rule
from .bsp import BSP
from .easgd import EASGD
from .localsgd import LocalSGD
from .registry import RULES
from .sma import SMA
from .switching import SwitchingRule

if TYPE_CHECKING:
    from ..pool.replica_view import ReplicaView

log = logging.getLogger(__name__)

#: The rules post-local SGD switches to, by registry name: synchronous, and each averaging models.
LATER: dict[str, type[Rule]] = {"SMA": SMA, "LOCALSGD": LocalSGD, "EASGD": EASGD}
#: The prefix of BSP's keys in ``[rule]`` (``bsp_mode``) and of the later rule's (``then_alpha``).
BEFORE, AFTER = "bsp_", "then_"


@RULES.register("POSTLOCALSGD")
class PostLocalSGD(SwitchingRule):
    """Post-local SGD: BSP until an epoch or the first learning-rate drop, then SMA, LOCALSGD or EASGD."""

    @dataclass(frozen=True)
    class Config:
        """POSTLOCALSGD hyper-parameters. BSP's keys are written ``bsp_<key>`` (``bsp_mode``,
        ``bsp_bucket_mb``) and the later rule's ``then_<key>`` (SMA: ``then_alpha``, ``then_momentum``;
        LOCALSGD: ``then_period``, ``then_inner_period``; EASGD: ``then_alpha``, ``then_tau``,
        ``then_momentum``), each with that rule's meaning and default."""

        then: str = setting(
            "LOCALSGD", "the rule after the switch: SMA, LOCALSGD or EASGD (synchronous: EASGD's mode = sync)"
        )
        switch: Literal["epoch", "lr_drop"] = setting(
            "epoch",
            "epoch: switch after switch_epoch epochs of BSP; lr_drop: after the first step at a lower "
            "learning rate (Lin et al.'s choice; switch_epoch is not used)",
        )
        switch_epoch: float = setting(
            1.0,
            "switch = epoch: epochs of BSP before the switch (fractions round to whole steps); must come "
            "before the run ends",
            gt=0,
        )

    name = "POSTLOCALSGD"

    def __init__(self, **hyper: Any) -> None:
        parts: dict[str, dict[str, Any]] = {"": {}, BEFORE: {}, AFTER: {}}
        for key, value in hyper.items():
            name = key.strip().lower().replace("-", "_")
            prefix = next((p for p in (BEFORE, AFTER) if name.startswith(p)), "")
            parts[prefix][name[len(prefix) :] if prefix else key] = value
        super().__init__(**parts[""])
        later = later_rule(self.hyper.then)
        self.bsp = inner_rule(BSP, parts[BEFORE], BEFORE)
        self.later = inner_rule(later, parts[AFTER], AFTER)
        if self.bsp.hyper.mode == "swap":
            raise ConfigError(
                "[rule] bsp_mode = swap leaves the replicas apart, and post-local SGD starts from mini-batch "
                "SGD: use bsp_mode = grad, avg or auto"
            )
        if not self.later.synchronous:
            raise ConfigError(asynchronous(later.name, f"{AFTER}mode = async"))
        own = {**dataclasses.asdict(self.hyper), "then": later.name}
        mine = {BEFORE + k: v for k, v in dataclasses.asdict(self.bsp.hyper).items()}
        theirs = {AFTER + k: v for k, v in dataclasses.asdict(self.later.hyper).items()}
        #: Every key, resolved: what session.cfg records and ``Rule(**hyper)`` builds this rule again from.
        self.hyper: Any = resolved_config(later)(**own, **mine, **theirs)
        self.switched_at: int | None = None
        self._dropped = False  # switch = lr_drop: the rate went down; switch after this step
        self._next = 0  # the step after the last exchange
        self._origin = (0, 0.0)  # (step, epochs done) where steps per epoch last changed
        self._per_epoch = 1
        self._warned = False

    # ------------------------------------------------------------ the whole
    @property
    def needs_gradients(self) -> bool:
        """True when either phase exchanges gradients (``bsp_mode = grad``): the model must expose them."""
        return self.bsp.needs_gradients or self.later.needs_gradients

    @property
    def needs_mpi_threads(self) -> bool:
        """True when either phase talks MPI from a second thread (none of the rules it allows does)."""
        return self.bsp.needs_mpi_threads or self.later.needs_mpi_threads

    def check_run(self, epochs: float) -> None:
        """``switch = epoch``: the switch must come before the run of ``epochs`` epochs ends."""
        if self.hyper.switch == "epoch" and self.hyper.switch_epoch >= epochs:
            raise ConfigError(
                f"[rule] switch_epoch = {self.hyper.switch_epoch:g} is not before the end of the run "
                f"({epochs:g} epoch(s)): it would be BSP throughout; lower switch_epoch or train longer"
            )

    def check_learners(self, k: int) -> None:
        """Both phases' checks for ``k`` learners in all, before training rather than at the switch; an error
        names the key as written (``then_alpha``)."""
        for rule, prefix in ((self.bsp, BEFORE), (self.later, AFTER)):
            try:
                rule.check_learners(k)
            except ConfigError as exc:
                raise renamed(exc, prefix) from None

    def bind(self, comm: Communicator, pool: ReplicaView) -> Rule:
        """Bind BSP (every learner starts from rank 0's learner 0); the later rule waits for the switch."""
        super().bind(comm, pool)
        self._per_epoch = pool.n_batch_train
        log.info(
            "%s: BSP, then %s %s",
            self.name,
            self.later.name,
            f"from epoch {self.hyper.switch_epoch:g} (step {self.switch_step()})"
            if self.hyper.switch == "epoch"
            else "after the first learning-rate drop",
        )
        return self

    def switch_step(self) -> int:
        """``switch = epoch``: the first step of the later rule, ``round(switch_epoch × steps per epoch)``
        (from where steps per epoch last changed), at least 1."""
        step, epochs = self._origin
        return max(1, step + round((self.hyper.switch_epoch - epochs) * self._per_epoch))

    def _epochs_at(self, step: int) -> float:
        """Epochs done after ``step`` steps (steps per epoch follow ``[pool] learners = auto``)."""
        origin, epochs = self._origin
        return epochs + (step - origin) / self._per_epoch

    # ------------------------------------------------------------------ hooks
    def exchange(self, step: int) -> None:
        """The active rule's exchange; after BSP's last step, the switch."""
        self.active.exchange(step)
        self._next = step + 1
        if self.switched_at is None:
            due = self._dropped if self.hyper.switch == "lr_drop" else self._next >= self.switch_step()
            if due:
                self.switch(self._next)
                if self.comm is not None and self.comm.rank == 0:
                    log.info(
                        "%s: switched from BSP to %s at step %d (epoch %.4g)",
                        self.name,
                        self.later.name,
                        self._next,
                        self._epochs_at(self._next),
                    )

    def on_lr_change(self, old: float, new: float) -> None:
        """The active rule's; with ``switch = lr_drop`` the first drop makes this step BSP's last."""
        self.active.on_lr_change(old, new)
        if self.switched_at is None and new < old:
            self._dropped = True

    def on_resize(self) -> None:
        """The active rule's; before the switch, the switch step follows the new steps per epoch (the
        auto-tuner resizes between epochs)."""
        assert self.pool is not None
        if self.switched_at is None:
            self._origin = (self._next, self._epochs_at(self._next))
            self._per_epoch = self.pool.n_batch_train
        self.active.on_resize()

    def finish(self) -> None:
        """The active rule's; rank 0 warns once when ``switch = lr_drop`` never came."""
        self.active.finish()
        never = self.switched_at is None and self.hyper.switch == "lr_drop" and not self._warned
        if never and self.comm is not None and self.comm.rank == 0:
            log.warning("%s: the learning rate never stepped down, so the whole run was BSP", self.name)
            self._warned = True

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The phase (the switch step, or None), a pending lr drop, the step reached and the active rule's
        state."""
        return {**super().state_dict(), "dropped": self._dropped, "next": self._next, **self.phase_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the phase and the active rule's state (:meth:`~.switching.SwitchingRule.load_phase`)."""
        self._dropped = bool(state.get("dropped", False))
        self._next = int(state.get("next", self._next))
        self.load_phase(state)


def later_rule(name: str) -> type[Rule]:
    """The rule class ``then = name`` names: one of :data:`LATER` (any case), else a ConfigError saying
    why — not a rule, an asynchronous one, or one post-local SGD does not switch to."""
    key = name.strip().upper()
    if key in LATER:
        return LATER[key]
    valid = ", ".join(LATER)
    if key in RULES:
        try:
            probe: Rule | None = RULES.get(key)()
        except ConfigError:
            probe = None
        if probe is not None and not probe.synchronous:
            raise ConfigError(asynchronous(key, f"then = {key}"))
    raise ConfigError(f"[rule] then = {name.strip()}: post-local SGD switches to one of {valid}")


def asynchronous(rule: str, setting_text: str) -> str:
    """The message refusing an asynchronous later rule."""
    return (
        f"[rule] {setting_text}: {rule} is asynchronous, and post-local SGD switches every rank at the same "
        f"step from BSP to a synchronous rule: {', '.join(LATER)} (EASGD with then_mode = sync)"
    )


def inner_rule(cls: type[Rule], values: Mapping[str, Any], prefix: str) -> Rule:
    """``cls`` built from the ``[rule]`` keys written ``prefix<key>``; each error names the key as written."""
    valid = [f.name for f in dataclasses.fields(cls.Config) if f.init]  # type: ignore[arg-type]
    for key in values:
        if key not in valid:
            names = ", ".join(prefix + name for name in valid) or "(none)"
            raise ConfigError(f"[rule] unknown key '{prefix}{key}' for {cls.name}; valid keys: {names}")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise renamed(exc, prefix) from None


def renamed(error: ConfigError, prefix: str) -> ConfigError:
    """An inner rule's ``[rule] <key>...`` error with the key as a POSTLOCALSGD cfg writes it."""
    return ConfigError(re.sub(r"^\[rule\] (?=\w)", f"[rule] {prefix}", str(error), count=1))


@functools.cache
def resolved_config(later: type[Rule]) -> type:
    """The frozen dataclass of a POSTLOCALSGD's resolved keys when it switches to ``later``: its own, then
    BSP's as ``bsp_<key>``, then ``later``'s as ``then_<key>``, each with its type, default and bounds."""
    fields: list[tuple[str, Any, Any]] = []
    for prefix, config in (("", PostLocalSGD.Config), (BEFORE, BSP.Config), (AFTER, later.Config)):
        hints = typing.get_type_hints(config)
        for f in dataclasses.fields(config):  # type: ignore[arg-type]
            field = dataclasses.field(default=f.default, metadata=f.metadata)
            fields.append((prefix + f.name, hints[f.name], field))
    made = dataclasses.make_dataclass(f"PostLocalSGD{later.__name__}Config", fields, frozen=True)
    made.__module__ = __name__
    made.__doc__ = f"POSTLOCALSGD's resolved keys when it switches to {later.name}."
    return made
