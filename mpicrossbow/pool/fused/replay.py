"""Replaying a fused forward: the operators one run of replica 0's ``forward()`` on every replica's values
(:mod:`.replicated_network`) ran on plain tensors, recorded once and compiled into one Python function.

**Why.** Running the template's forward costs Python per operator — the module calls, ``F.*``'s dispatch to
``Replicated.__torch_function__``, each handler's reading of its arguments — while a small network's kernels
take a few µs each (the transformer block's forward, m = 8, b = 4, one thread: 460 µs through the template,
296 µs replayed). A replay runs exactly the operators the template's forward ran — the same functions on the
same arguments in the same order, so the same values bit for bit — without the Python that chose them.
**Needed for speed**: without it the transformer block's fused ÷ bound (benchmarks/pool.py, m = 8, one
thread) falls from 0.97 to 0.86–0.89 at b = 4 (0.76 and 0.99 in two runs at b = 16), and the MNIST-1D
CNN's at b = 16 to 0.89–0.93. Not CPU-only: on a GPU that Python is host time per step which a small
network's kernels cannot hide.

**How.** :class:`OperatorRecorder` is a torch function mode held around one forward. A call on a
``Replicated`` goes to its :class:`~.replicated.OperatorDispatcher` with the mode still on, so each operator
its handler runs on the stacked tensors is recorded with its arguments: an earlier operator's result by
reference, anything else (the parameters' rows, a dtype, a size) as a constant. A recording compiles into a
function of the input (:meth:`OperatorRecorder.compile`), each result released after its last use as the
forward would release it.

**When a recording replays** (:class:`ReplayCache`): for a forward with the same key — input shape, strides,
dtype and device, training mode, grad mode, autocast — once two forwards in a row with that key recorded
the same operators on the same constants (tensors by identity). A choice a handler makes on its first calls,
an index tensor it caches, a tensor made fresh by Python the recorder cannot see: each shows as a
difference, and recording goes on. A forward never replays if it read a tensor's values into Python
(``item()``, ``bool()``), shaped a tensor by its values (``nonzero``, a boolean mask), ran an operator under
a grad mode set out of its sight (a custom autograd Function's forward; ``torch.no_grad()`` is recorded and
replayed) or under autocast switched inside it, drew from Python's or NumPy's random generators, or if the
network has module hooks: it runs through the template every time, as before.

Python side effects of a forward (a counter, a log line) happen only in the forwards that record. The pool
stops replaying at every epoch start (:meth:`ReplayCache.forget`), so a forward whose Python reads the epoch,
or anything set between epochs, is recorded anew; one recording equal to the last epoch's resumes the replay.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .replicated import Replicated

log = logging.getLogger(__name__)

T = torch.Tensor

#: Operators whose result's shape depends on the values: a recorded size after them would be wrong.
_SHAPED_BY_VALUES = frozenset(
    f
    for name in "nonzero argwhere masked_select unique unique_consecutive bincount repeat_interleave".split()
    for f in (getattr(torch, name, None), getattr(T, name, None))
    if f is not None
)
#: Tensor methods and attributes whose Python result is fixed by the key (shapes, dtypes): not recorded.
_METADATA = frozenset(
    "size dim ndimension numel nelement stride storage_offset is_floating_point is_complex is_contiguous "
    "is_signed element_size untyped_storage get_device __len__ shape ndim dtype device requires_grad is_cuda "
    "is_cpu layout is_sparse is_nested is_quantized is_meta is_leaf grad_fn _base is_inference itemsize "
    "nbytes names".split()
)

Key = tuple[Any, ...]


def replay_key(x: torch.Tensor, training: bool) -> Key:
    """What a recording of a forward on ``x`` holds for: a forward with another key records anew."""
    return (
        tuple(x.shape),
        x.stride(),
        x.dtype,
        x.device,
        training,
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        _autocast(),
    )


def _autocast() -> tuple[bool, bool]:
    """Whether autocast is on for the CPU and for CUDA (it changes what every operator computes)."""
    return torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")


def _name(func: Any) -> str:
    """An operator's name; an attribute's for a getter (``Tensor.shape.__get__`` → ``shape``)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` is or contains a tensor (or a Replicated)."""
    return any(isinstance(leaf, (torch.Tensor, Replicated)) for leaf in pytree.tree_leaves(value))


def _same(a: Any, b: Any) -> bool:
    """Two recordings' constants are the same: one tensor (identity), else equal values of one type."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # a value without a plain equality
        return False


def _random_state() -> tuple[Any, ...]:
    """Python's and NumPy's global generator states: a forward drawing from them must not replay."""
    numpy = np.random.get_state()
    return random.getstate(), numpy[1].tobytes(), numpy[2:]


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule has hooks, or global module hooks exist (a replay skips them)."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    found = any(getattr(sub, kind, None) for sub in module.modules() for kind in kinds)
    globals_ = nn.modules.module
    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    return found or any(getattr(globals_, name, None) for name in names)


class OperatorRecorder(TorchFunctionMode):
    """While active, records every torch operator a forward runs on plain tensors (see the module's text);
    ``why`` says why this forward cannot replay (None while it can)."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.consts: list[Any] = []
        self.why: str | None = None
        self.output: str | None = None
        self._names: dict[int, str] = {id(x): "x"}
        self._steps: list[tuple[list[str], set[str]]] = []  # each line's targets and the names it reads
        self._const_at: dict[int, int] = {}
        self._keep: list[Any] = [x]  # every recorded value alive, so no id() is reused while recording
        self._grad = torch.is_grad_enabled()
        self._autocast = _autocast()
        self._random = _random_state()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """A call on a Replicated: its handler runs with recording on. Any other: run, then recorded."""
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            for leaf in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(leaf, Replicated):
                    with self:
                        return leaf.ctx.call(func, args, kwargs)
        result = func(*args, **kwargs)
        if self.why is None:
            try:
                self._note(func, args, kwargs, result)
            except Exception as exc:  # a recording is only a speed-up: the forward itself goes on
                self.why = f"{_name(func)} could not be recorded ({type(exc).__name__}: {exc})"
        return result

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """One operator's line, or why the forward cannot replay."""
        name = _name(func)
        if func is torch._C._set_grad_enabled:  # torch.no_grad() and its kind: replayed as they ran
            self._line(func, args, kwargs, [])
            self._grad = bool(args[0])
        elif torch.is_grad_enabled() != self._grad:
            self.why = f"{name} ran under a grad mode set out of sight (an autograd Function's forward)"
        elif _autocast() != self._autocast:
            self.why = f"{name} ran under autocast switched inside the forward"
        elif func in _SHAPED_BY_VALUES or (func is T.__getitem__ and _bool_index(args[1])):
            self.why = f"{name} shapes its result by the values"
        elif isinstance(result, torch.Tensor):
            self._line(func, args, kwargs, [result], single=True)
        elif isinstance(result, (tuple, list)) and result and all(isinstance(r, T) for r in result):
            self._line(func, args, kwargs, list(result))
        elif name not in _METADATA:
            self.why = f"{name} hands {type(result).__name__} to Python"

    def _line(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        results: list[Any],
        single: bool = False,
    ) -> None:
        """``v7 = K[3](v5, 1, K[4])`` (``v7, v8, = …`` for several results, no target for none)."""
        uses: set[str] = set()
        try:
            parts = [self._source(a, uses) for a in args]
            parts += [f"{key}={self._source(v, uses)}" for key, v in kwargs.items()]
        except _Opaque as exc:
            self.why = f"{_name(func)} takes {exc.args[0]}"
            return
        targets = []
        for value in results:
            target = f"v{len(self._keep)}"
            self._keep.append(value)
            self._names[id(value)] = target
            targets.append(target)
        call = f"{self._const(func)}({', '.join(parts)})"
        left = targets[0] if single else "".join(f"{t}, " for t in targets)
        self.lines.append(f"{left} = {call}" if targets else call)
        self._steps.append((targets, uses))

    def _source(self, value: Any, uses: set[str]) -> str:
        """``value`` as source: a recorded result's name, a literal, a list/tuple display, or a constant."""
        if isinstance(value, torch.Tensor):
            name = self._names.get(id(value))
            if name is not None:
                uses.add(name)
                return name
            return self._const(value)
        kind = type(value)
        if value is None or kind in (bool, int, str) or (kind is float and math.isfinite(value)):
            return repr(value)
        if kind in (list, tuple) and _holds_tensor(value):
            inner = "".join(f"{self._source(v, uses)}, " for v in value)
            return f"[{inner}]" if kind is list else f"({inner})"
        if _holds_tensor(value):
            raise _Opaque(f"tensors inside a {kind.__name__}")
        return self._const(value)

    def _const(self, value: Any) -> str:
        """``K[i]``: ``value`` passed to the replay as it is."""
        at = self._const_at.get(id(value))
        if at is None:
            at = self._const_at[id(value)] = len(self.consts)
            self.consts.append(value)
        return f"K[{at}]"

    def finish(self, output: torch.Tensor) -> None:
        """The forward's output, once it returned: a recording needs it to be a recorded result."""
        if self.why is None and _random_state() != self._random:
            self.why = "the forward draws from Python's or NumPy's random generator"
        self.output = self._names.get(id(output))
        if self.why is None and self.output is None:
            self.why = "the output is not computed by a recorded operator"
        self._keep.clear()  # the forward's values, free to go (the recording holds names and constants)
        self._names.clear()

    def same_as(self, other: OperatorRecorder) -> bool:
        """Whether two recordings ran the same operators on the same constants."""
        return (
            self.lines == other.lines
            and self.output == other.output
            and len(self.consts) == len(other.consts)
            and all(_same(a, b) for a, b in zip(self.consts, other.consts, strict=True))
        )

    def compile(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The recording as one function of the input; a result is deleted after its last use."""
        assert self.why is None and self.output is not None
        last: dict[str, int] = {"x": -1}
        for i, (targets, uses) in enumerate(self._steps):
            for name in (*targets, *uses):
                last[name] = i
        dead: dict[int, list[str]] = {}
        for name, i in last.items():
            if name != self.output:
                dead.setdefault(i, []).append(name)
        body = [f"del {', '.join(dead[-1])}"] if -1 in dead else []
        for i, line in enumerate(self.lines):
            body.append(line)
            if i in dead:
                body.append(f"del {', '.join(dead[i])}")
        body.append(f"return {self.output}")
        if any(not targets for targets, _ in self._steps):  # grad mode set: restored however the call ends
            body = ["grad = is_grad_enabled()", "try:", *(f"    {b}" for b in body)]
            body += ["finally:", "    set_grad_enabled(grad)"]
        source = "def replay(x):\n" + "".join(f"    {line}\n" for line in body)
        scope: dict[str, Any] = {
            "K": self.consts,
            "is_grad_enabled": torch.is_grad_enabled,
            "set_grad_enabled": torch._C._set_grad_enabled,
        }
        exec(compile(source, "<fused forward replay>", "exec"), scope)
        return scope["replay"]


class _Opaque(Exception):
    """An argument the recording cannot pass on (tensors inside a structure it does not open)."""


def _bool_index(index: Any) -> bool:
    """Whether an index holds a boolean tensor (a mask: the result's shape depends on the values)."""
    leaves = pytree.tree_leaves(index)
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.bool, torch.uint8) for v in leaves)


class ReplayCache:
    """One network's recordings by key: recording while two in a row differ, then the compiled replay.

    A key whose first :attr:`ATTEMPTS` recordings never agree twice in a row stops recording (a recorded
    forward costs about 2.5 times a plain one: measured on the transformer block) until :meth:`forget`.
    """

    #: Recordings per key before its forward is taken to change from one call to the next.
    ATTEMPTS = 4

    def __init__(self) -> None:
        self._ready: dict[Key, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._compiled: dict[Key, OperatorRecorder] = {}  # the recording behind each replay
        self._last: dict[Key, OperatorRecorder] = {}
        self._attempts: dict[Key, int] = {}
        self._never: dict[Key, str] = {}
        self._told: set[str] = set()
        #: Forwards replayed so far.
        self.replayed = 0

    def run(self, key: Key, x: torch.Tensor) -> torch.Tensor | None:
        """The forward on ``x`` replayed, once ``key`` has a replay; else None."""
        replay = self._ready.get(key)
        if replay is None:
            return None
        self.replayed += 1
        return replay(x)

    def recorder(self, key: Key, x: torch.Tensor, template: nn.Module) -> OperatorRecorder | None:
        """A recorder for the next forward with ``key``; None when forwards with it never replay."""
        if key in self._never:
            return None
        if has_hooks(template):
            self._refuse(key, "the network has module hooks")
            return None
        return OperatorRecorder(x)

    def offer(self, key: Key, recorder: OperatorRecorder) -> None:
        """A finished recording: compiled when it equals the one before it with the same key."""
        if recorder.why is not None:
            self._refuse(key, recorder.why)
            return
        before = self._last.pop(key, None)
        if before is not None and before.same_as(recorder):
            self._ready[key] = recorder.compile()
            self._compiled[key] = recorder
            log.debug("fused engine: the forward replays its %d recorded operators", len(recorder.lines))
            return
        self._attempts[key] = self._attempts.get(key, 0) + 1
        if self._attempts[key] >= self.ATTEMPTS:
            self._refuse(key, f"its operators changed in each of {self.ATTEMPTS} forwards in a row")
        else:
            self._last[key] = recorder

    def _refuse(self, key: Key, why: str) -> None:
        """Forwards with ``key`` run through the template from now on (until :meth:`forget`)."""
        self._never[key] = why
        if why in self._told:
            return
        self._told.add(why)
        log.info("fused engine: the forward is not replayed (%s); it runs through its Python each time", why)

    def forget(self) -> None:
        """Replay nothing until recorded anew (an epoch starts). A key that replayed keeps its recording as
        the one before: one forward recording the same operators again makes it replay again."""
        self._last = self._compiled
        self._compiled = {}
        self._ready.clear()
        self._attempts.clear()
        self._never.clear()

    @property
    def ready(self) -> int:
        """How many keys replay."""
        return len(self._ready)
