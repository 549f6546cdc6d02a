"""CUDA graphs for a pool's steps (``[pool] cuda_graphs = auto | on | off``): launch a step's kernels as one.

A learner's step on a small batch is launch-bound on a GPU: the host's Python, autograd and the kernel
launches take longer than the kernels. A CUDA graph records the kernels of one step once and launches all of
them again with one call (``torch.cuda.CUDAGraph.replay``), so the host's share of a step nearly vanishes.

**What is captured, and why as two graphs.** The session drives a step as ``compute()`` (forward, loss and
backward of every learner), the rule's ``on_gradients`` (BSP's allreduce, fp16's agreed unscale: host
decisions and collectives between ranks), ``apply()`` (the optimizer steps) and the rule's ``exchange``. The
rule's hooks sit between backward and the optimizer step and talk to other ranks, so one graph of the whole
step would capture them out of the step (or not at all). Each is captured on its own instead:

* the *learner step* (role :data:`LEARNER_STEP`): zeroing the gradient rows, forward, loss, backward into the
  flat gradient rows, and the loss and hit statistics, on static input buffers. The loader's batch is copied
  into them before each replay (``non_blocking``: asynchronous from page-locked memory, where the loader pins
  its batches); the serial and streams engines capture one graph per learner, the fused engine one for all;
* the *optimizer step* (role :data:`OPTIMIZER_STEP`): every learner's ``optimizer.step()`` in one graph, where
  the optimizer is ``torch.optim.SGD`` (plain tensor operations) or has ``capturable=True`` in every
  parameter group (torch's Adam, AdamW…); other optimizers step eagerly.

The rules see the same flat ``params``, ``grads`` and ``buffers`` as before: a graph reads and writes those
very tensors (their storage never moves), so whatever a rule writes into them between the graphs is what the
next replay computes with.

**When a graph is (re)captured** (:class:`CapturePlan`): a step with a new *key* — the inputs' shapes and
dtypes, and what the step bakes in as constants (fp16's loss scale, the fused engine's form, the optimizer's
learning rate, momentum and other settings) — runs eagerly on a side stream (CUDA's required warm-up) for
:data:`WARMUP` steps in a row, the last of them with torch's synchronisation check on; the step after is
captured and replayed. A batch of another shape (the last, partial batch of an epoch) or a setting changed
for one step runs eagerly and leaves the graph as it is; one that lasts :data:`WARMUP` steps is captured in
its place. So a learning rate that changes every step (a per-step warm-up) keeps the optimizer step eager
until the rate holds still, and fp16's halved loss scale is captured anew after three steps. Warm-up steps
are real training steps (capturing runs no kernel), so a graph costs no step.

**Refusals** (each logged once, in one line naming the reason; under ``on`` each is a ConfigError instead):

* a device that is not CUDA: ``auto`` is off without a word, ``on`` is an error at once;
* an optimizer that cannot be captured (not SGD, ``capturable`` False): its step stays eager;
* a step that synchronises with the host (``.item()``, a tensor made from host values, a data-dependent
  shape), seen by the synchronisation check of the last warm-up step: that role stays eager for the run;
* a capture that fails anyway (an operation CUDA graphs do not allow): that step runs eagerly, and the role
  stays eager for the run;
* a rule that watches each gradient as backward produces it (BSP's buckets overlap the allreduce with the
  backward): the learner step runs eagerly while it watches (``on`` instead reports no gradient layout, and
  BSP makes one allreduce after backward).

What a graph cannot see: Python values the forward reads (a setting changed between epochs) are frozen at
capture; a model whose forward reads such a value should train with ``cuda_graphs = off``. A checkpoint load
copies params, buffers and statistics into the same storage (in place); torch's ``Optimizer.load_state_dict``
replaces the optimizer's state tensors, so a load (and a resize, which makes new learners) drops the graphs
and they are captured again after :data:`WARMUP` steps.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

#: ``[pool] cuda_graphs``'s values.
GRAPH_SETTINGS = ("auto", "on", "off")
#: Forward, loss and backward of a learner (or of the fused network), with the step's statistics.
LEARNER_STEP = "learner step"
#: Every learner's optimizer step.
OPTIMIZER_STEP = "optimizer step"
#: Why the learner step runs eagerly while a rule watches its gradients (:meth:`GraphSwitch.hold`).
WATCHED = "a rule watches each gradient during backward (BSP's buckets overlap the allreduce with it)"
#: Eager steps with the same key before a capture (CUDA's warm-up; the last one checks for host syncs).
WARMUP = 3

#: What :meth:`CapturePlan.next` says a call should do.
Action = Literal["replay", "eager", "probe", "capture"]


def graphs_enabled(setting: str, device: torch.device) -> bool:
    """Whether ``[pool] cuda_graphs = setting`` captures on ``device``: ``off`` never, ``auto`` on CUDA
    devices only (off elsewhere without a word), ``on`` on CUDA devices and a ConfigError elsewhere."""
    if setting not in GRAPH_SETTINGS:
        raise ConfigError(f"[pool] cuda_graphs = {setting!r}: choose one of {', '.join(GRAPH_SETTINGS)}")
    if setting == "off":
        return False
    if device.type != "cuda":
        if setting == "on":
            raise ConfigError(
                f"[pool] cuda_graphs = on needs a CUDA device, this rank has {device}; "
                "use cuda_graphs = auto (off on other devices) or off"
            )
        return False
    return True


def optimizer_refusal(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """Why these optimizers' steps cannot be captured in a CUDA graph, or None when they can: plain
    ``torch.optim.SGD`` (elementwise tensor operations, no host value read), or every parameter group with
    ``capturable=True`` (torch's own flag: its step counters live on the device)."""
    for optimizer in optimizers:
        name = type(optimizer).__name__
        if type(optimizer) is torch.optim.SGD:
            continue
        if all(group.get("capturable", False) for group in optimizer.param_groups):
            continue
        if "capturable" in optimizer.defaults:
            return f"{name}'s parameter groups have capturable=False ({name}(..., capturable=True) allows it)"
        return f"{name} is neither torch.optim.SGD nor built with capturable=True"
    return None


def _hashable(value: Any) -> Hashable:
    """A setting's value as part of a key: tensors by identity, sequences item by item."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def optimizer_settings(optimizers: Sequence[torch.optim.Optimizer]) -> Hashable:
    """The settings an optimizer step bakes into a graph: every parameter group's values (learning rate,
    momentum, weight decay …) and the identity of each optimizer's state (a load replaces it)."""
    return tuple(
        (
            id(optimizer.state),
            tuple(
                tuple((k, _hashable(v)) for k, v in sorted(group.items()) if k != "params")
                for group in optimizer.param_groups
            ),
        )
        for optimizer in optimizers
    )


@dataclass
class CapturePlan:
    """When a graphed call replays, runs eagerly, checks for host syncs or captures (no CUDA needed).

    A call's key is what its graph is valid for. The captured key replays; any other runs eagerly, and one
    seen in ``warmup`` calls in a row (the last of them the ``probe``) is captured at the next call: so a
    passing key (one partial batch) leaves the graph in place, a lasting one replaces it.
    """

    warmup: int = WARMUP
    #: The key of the live graph (None: no graph).
    captured: Hashable | None = None
    #: The key of the eager calls in a row, and how many there were.
    pending: Hashable | None = None
    seen: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {self.warmup}")

    def next(self, key: Hashable) -> Action:
        """What the call with ``key`` does (and count it)."""
        if self.captured is not None and key == self.captured:
            self.pending, self.seen = None, 0
            return "replay"
        if self.pending is None or key != self.pending:
            self.pending, self.seen = key, 0
        if self.seen >= self.warmup:
            return "capture"
        self.seen += 1
        return "probe" if self.seen == self.warmup else "eager"

    def done(self, key: Hashable) -> None:
        """The graph for ``key`` is captured: it replays from now on."""
        self.captured, self.pending, self.seen = key, None, 0

    def reset(self) -> None:
        """No graph: the next calls warm up again."""
        self.captured, self.pending, self.seen = None, None, 0


class GraphSwitch:
    """One pool's ``[pool] cuda_graphs``: whether each role (:data:`LEARNER_STEP`, :data:`OPTIMIZER_STEP`) is
    captured now, why not (each reason logged once), and how often it was captured."""

    def __init__(self, setting: str, device: torch.device) -> None:
        self.setting = setting
        #: ``on``: a refusal is a ConfigError.
        self.strict = setting == "on"
        #: Whether this pool captures at all (a CUDA device and a setting other than off).
        self.enabled = graphs_enabled(setting, device)
        self.device = device
        #: Role → why it runs eagerly for the rest of the run.
        self.refused: dict[str, str] = {}
        #: Role → why it runs eagerly for now (a rule's gradient watchers).
        self.held: dict[str, str] = {}
        #: Role → captures so far.
        self.captures: Counter[str] = Counter()
        self._said: set[str] = set()

    def allows(self, role: str) -> bool:
        """Whether ``role`` may run through its graph now."""
        return self.enabled and role not in self.refused and role not in self.held

    def refuse(self, role: str, reason: str, level: int = logging.WARNING) -> None:
        """``role`` runs eagerly for the rest of the run, for ``reason`` (logged once); a ConfigError under
        ``on``."""
        if not self.enabled or role in self.refused:
            return
        if self.strict:
            raise ConfigError(
                f"[pool] cuda_graphs = on: the {role} cannot be captured in a CUDA graph: {reason}; "
                "use cuda_graphs = auto (eager where it cannot) or off"
            )
        self.refused[role] = reason
        log.log(level, "cuda_graphs: the %s runs eagerly for the rest of this run: %s", role, reason)

    def hold(self, role: str, reason: str) -> None:
        """``role`` runs eagerly until :meth:`release` (logged once per reason); a ConfigError under
        ``on``."""
        if not self.enabled:
            return
        if self.strict:
            raise ConfigError(
                f"[pool] cuda_graphs = on: the {role} cannot be captured in a CUDA graph: {reason}; "
                "use cuda_graphs = auto (eager where it cannot) or off"
            )
        self.held[role] = reason
        if reason not in self._said:
            self._said.add(reason)
            log.info(
                "cuda_graphs: the %s runs eagerly while %s; with cuda_graphs = on it is captured and the "
                "pool reports no gradients during backward (BSP then allreduces once after it)",
                role,
                reason,
            )

    def release(self, role: str) -> None:
        """End :meth:`hold` for ``role``."""
        self.held.pop(role, None)

    def check_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Refuse the optimizer step where :func:`optimizer_refusal` gives a reason (logged at INFO)."""
        if not self.enabled:
            return
        reason = optimizer_refusal(optimizers)
        if reason is not None:
            self.refuse(OPTIMIZER_STEP, reason, level=logging.INFO)

    def step(
        self, role: str, fn: Callable[..., Any], stream: torch.cuda.Stream | None = None
    ) -> GraphedStep | None:
        """``fn`` as a :class:`GraphedStep` of ``role``, or None where this pool does not capture."""
        if not self.enabled or role in self.refused:
            return None
        return GraphedStep(fn, self, role, stream)

    def captured(self, role: str) -> None:
        """Count a capture of ``role``; the first of the run is logged."""
        self.captures[role] += 1
        if self.captures[role] == 1:
            log.info("cuda_graphs: the %s is captured in a CUDA graph and replayed", role)
        else:
            log.debug("cuda_graphs: the %s captured again (%d captures)", role, self.captures[role])

    def record(self) -> dict[str, Any]:
        """What ran through graphs and why not, for the run's metrics.h5 (attribute ``cuda_graphs``, JSON);
        nothing on a device that never captures."""
        if self.device.type != "cuda":
            return {}
        state = {
            "setting": self.setting,
            "captures": dict(self.captures),
            "refused": self.refused,
            "held": self.held,
        }
        return {"cuda_graphs": json.dumps(state)}


def _sync_sites(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` with torch's synchronisation check on (``set_sync_debug_mode("warn")``): its result and where
    it synchronised with the host (file:line of each warning); other warnings are passed on."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites = []
    for warning in caught:
        if "synchronizing CUDA operation" in str(warning.message):
            sites.append(f"{Path(warning.filename).name}:{warning.lineno}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result, sites


class GraphedStep:
    """``fn(*tensors)`` run through a CUDA graph once its key holds still (:class:`CapturePlan`).

    ``fn`` does device work only and returns its outputs (tensors it allocated, or None); a replay returns
    the graph's static outputs, overwritten by each replay. ``stream``: where warm-up steps run and the graph
    is captured (default: a side stream of its own; the streams engine passes each learner's stream, so each
    graph has its own workspaces and can replay beside the others).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        switch: GraphSwitch,
        role: str,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.fn, self.switch, self.role = fn, switch, role
        self.device = switch.device
        self.plan = CapturePlan()
        self._stream = stream
        self._graph: torch.cuda.CUDAGraph | None = None
        self._statics: tuple[torch.Tensor, ...] = ()
        self._outputs: Any = None

    @property
    def stream(self) -> torch.cuda.Stream:
        """The stream warm-ups and captures run on."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def buffer(self, index: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """The graph's static input ``index`` when it has ``shape`` and ``dtype`` (the batch may be copied
        straight into it, and :meth:`__call__` then copies nothing), else None."""
        if self._graph is None or index >= len(self._statics) or not self.switch.allows(self.role):
            return None
        static = self._statics[index]
        return static if static.shape == torch.Size(shape) and static.dtype == dtype else None

    def __call__(self, *args: torch.Tensor, setting: Hashable = None) -> Any:
        """``fn(*args)``: replayed where the graph's key is ``args``' shapes and dtypes with ``setting``, else
        eagerly (warming up, or a passing key), or captured then replayed (see :class:`CapturePlan`)."""
        if not self.switch.allows(self.role):
            return self.fn(*args)
        key = (tuple((tuple(a.shape), a.dtype) for a in args), setting)
        action = self.plan.next(key)
        if action == "replay":
            for static, arg in zip(self._statics, args, strict=True):
                if arg is not static:
                    static.copy_(arg, non_blocking=True)
            assert self._graph is not None
            self._graph.replay()
            return self._outputs
        if action == "capture":
            return self._capture(key, args)
        return self._eager(args, probe=action == "probe")

    def reset(self) -> None:
        """Drop the graph (the state it points at was replaced): the next calls warm up and capture anew."""
        self._graph, self._statics, self._outputs = None, (), None
        self.plan.reset()

    def _eager(self, args: Sequence[torch.Tensor], probe: bool) -> Any:
        """A warm-up step on :attr:`stream`; with ``probe``, torch's synchronisation check on (a step that
        synchronises with the host cannot be captured: the role is refused)."""
        current = torch.cuda.current_stream(self.device)
        side = self.stream
        if probe:  # the batch's own copy is not the step's: it is made before the check
            args = [a.to(self.device, non_blocking=True) for a in args]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            if probe:
                result, sites = _sync_sites(lambda: self.fn(*args))
            else:
                result, sites = self.fn(*args), []
        current.wait_stream(side)
        if sites:
            where = ", ".join(dict.fromkeys(sites))
            self.switch.refuse(self.role, f"it synchronizes with the host ({where})")
        return result

    def _capture(self, key: Hashable, args: Sequence[torch.Tensor]) -> Any:
        """Capture ``fn`` on static copies of ``args`` and replay it; a failed capture runs ``fn`` eagerly and
        refuses the role (under ``on``: a ConfigError)."""
        current = torch.cuda.current_stream(self.device)
        old = self._statics
        statics = tuple(
            a if any(a is s for s in old) else torch.empty(a.shape, dtype=a.dtype, device=self.device)
            for a in args
        )
        for static, arg in zip(statics, args, strict=True):
            if static is not arg:
                static.copy_(arg, non_blocking=True)
        self._graph, self._statics, self._outputs = None, (), None
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(current)
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                outputs = self.fn(*statics)
        except Exception as exc:  # any failure to capture falls back to eager
            torch.cuda.set_stream(current)  # a failed capture_end leaves the capture stream current
            self.plan.reset()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.switch.refuse(self.role, f"capturing it failed ({type(exc).__name__}: {first})")
            return self.fn(*args)
        self._graph, self._statics, self._outputs = graph, statics, outputs
        self.plan.done(key)
        self.switch.captured(self.role)
        graph.replay()
        return outputs
