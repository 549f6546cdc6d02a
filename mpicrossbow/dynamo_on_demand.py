"""torch's optimizers import the compiler only when the process compiles.

A ``torch.optim`` optimizer imports ``torch._dynamo``, the whole compiler stack (sympy, FSDP, the
decompositions), the first time it is built and stepped: a few methods (``add_param_group``, ``zero_grad``,
``state_dict``, ``load_state_dict``; some functional steps) are marked ``torch._disable_dynamo``, whose first
call imports the compiler to build its "do not trace this" wrapper, and every ``step`` is wrapped by
``_use_grad_for_differentiable``, which imports it to place graph breaks. That is 0.8-1.3 s of CPU on every
rank here (torch 2.13, ``python -X importtime``), about a third of a rank's start, on a rank that never
compiles anything; on a cluster every rank pays it at once, from a shared file system.

:func:`spare_dynamo` gives both a stand-in that does what torch's does while ``torch._dynamo`` has not been
imported — nothing can be tracing then: "do not trace" and graph breaks have nothing to do — and hands over to
torch's own from the first call after anything imported the compiler (``torch.compile``,
``import torch._dynamo``). A process that compiles behaves as before.

Stand-ins go where torch looks for its wrapper (a decorated function's ``__dynamo_disable``) and in place of
each ``torch.optim`` class's own ``step``, before its first optimizer is built. They are found by the code
object of torch's decorators: where a later torch changes them, nothing is found and nothing changes but the
start time.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Where ``torch._disable_dynamo``'s decorated function caches the wrapper it built (torch 2.x).
CACHE_ATTR = "__dynamo_disable"
#: The modules whose decorated functions and optimizer classes get a stand-in.
PACKAGES = ("torch.optim",)


def spare_dynamo(packages: tuple[str, ...] = PACKAGES) -> int:
    """Give every ``torch._disable_dynamo`` decorated function of ``packages`` (imported modules and their
    submodules), and every optimizer class's own ``step`` there, a stand-in that imports nothing until the
    process compiles; the number of stand-ins given (0 where torch changed, or when called again). Imports
    torch. Never fails a run: where this torch lacks either decorator, it gives none (a slower start)."""
    try:
        import torch._compile

        optimizer_module = importlib.import_module("torch.optim.optimizer")  # torch.optim deletes the name
        disabled = torch._compile._disable_dynamo(_probe).__code__
        stepping = optimizer_module._use_grad_for_differentiable(_probe).__code__
    except (ImportError, AttributeError, TypeError) as exc:  # another torch: its own decorators stay
        log.debug("torch's optimizers keep importing torch._dynamo: %s", exc)
        return 0
    count = 0
    for function in _functions_of(packages):
        if function.__code__ is disabled:
            target, recursive = _closure_value(function, "fn"), _closure_value(function, "recursive")
            if isinstance(target, types.FunctionType) and getattr(target, CACHE_ATTR, None) is None:
                setattr(target, CACHE_ATTR, _disabled_stand_in(target, bool(recursive)))
                count += 1
    for cls in _optimizer_classes(packages):
        step = vars(cls).get("step")
        if isinstance(step, types.FunctionType) and step.__code__ is stepping:  # none built yet (hooked)
            raw = _closure_value(step, "func")
            if isinstance(raw, types.FunctionType):
                cls.step = _step_stand_in(step, raw)
                count += 1
    return count


def _probe() -> None:
    """A function to decorate once, for the decorators' code objects."""


def _disabled_stand_in(fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    """``fn`` itself while ``torch._dynamo`` is not imported; torch's wrapper from then on (kept on fn)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        wrapper = dynamo.disable(fn, recursive, wrapping=False)
        setattr(fn, CACHE_ATTR, wrapper)
        return wrapper(*args, **kwargs)

    return call


def _step_stand_in(wrapped: Callable[..., Any], step: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer's ``step`` as torch's ``_use_grad_for_differentiable`` runs it (autograd on only for a
    differentiable optimizer), without its graph breaks while ``torch._dynamo`` is not imported; torch's
    ``wrapped`` from then on."""
    import torch

    @functools.wraps(step)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in sys.modules:
            return wrapped(*args, **kwargs)
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return step(*args, **kwargs)
        finally:
            torch.set_grad_enabled(previous)

    return call


def _functions_of(packages: tuple[str, ...]) -> Iterator[types.FunctionType]:
    """The functions of ``packages``' modules, of the classes they define, and those held in these
    functions' closures (the functional optimizers' fallbacks hold their decorated step)."""
    seen: set[int] = set()
    for module in _modules(packages):
        for function in _functions(vars(module)):
            for candidate in (function, *_closure_functions(function)):
                if id(candidate) not in seen:
                    seen.add(id(candidate))
                    yield candidate


def _optimizer_classes(packages: tuple[str, ...]) -> list[type]:
    """The ``torch.optim.Optimizer`` subclasses defined in ``packages``' modules, each once."""
    import torch.optim

    found = {
        id(value): value
        for module in _modules(packages)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
    }
    return list(found.values())


def _modules(packages: tuple[str, ...]) -> list[types.ModuleType]:
    """The imported modules of ``packages``."""
    return [
        module
        for name, module in list(sys.modules.items())
        if isinstance(module, types.ModuleType)
        and any(name == p or name.startswith(p + ".") for p in packages)
    ]


def _functions(namespace: dict[str, Any]) -> Iterator[types.FunctionType]:
    """The functions in ``namespace`` and in the classes it defines (static and class methods unwrapped)."""
    for value in list(namespace.values()):
        if isinstance(value, type):
            yield from _functions(dict(vars(value)))
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            yield value


def _closure_functions(function: types.FunctionType) -> Iterator[types.FunctionType]:
    """The functions held in ``function``'s closure cells."""
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.FunctionType):
            yield value


def _closure_value(function: types.FunctionType, name: str) -> Any:
    """The value of the free variable ``name`` in ``function``'s closure (None where it has none)."""
    names = function.__code__.co_freevars
    if name not in names or function.__closure__ is None:
        return None
    return function.__closure__[names.index(name)].cell_contents
