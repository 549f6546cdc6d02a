"""Name → class registries for pluggable components (rules today; engines and communicators later).

Built-in classes register themselves with a decorator; users plug in their own with ``module:Class`` in the
cfg (``RULE=mypkg.rules:MyRule``). An unknown name is a :class:`~mpicrossbow.errors.ConfigError` that lists
every valid name, so a typo is fixed in one try.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A case-insensitive mapping from names to subclasses of ``base``."""

    def __init__(self, kind: str, base: type[T]) -> None:
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: make ``cls`` available under ``name``."""

        def deco(cls: type[T]) -> type[T]:
            key = name.upper()
            if key in self._classes and self._classes[key] is not cls:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._classes[key] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._classes)

    def __iter__(self) -> Iterator[str]:
        """The registered names, sorted (``list(RULES)``)."""
        return iter(self.names())

    def __len__(self) -> int:
        """How many names are registered."""
        return len(self._classes)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` (any case) is registered."""
        return isinstance(name, str) and name.strip().upper() in self._classes

    def __repr__(self) -> str:
        """``Registry('rule': ASGD, BSP, ...)``: what ``print(RULES)`` shows."""
        return f"Registry({self.kind!r}: {', '.join(self.names())})"

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``, or the class ``module:Class`` names."""
        if ":" in name:
            return self._load(name)
        try:
            return self._classes[name.strip().upper()]
        except KeyError:
            valid = ", ".join(self.names())
            raise ConfigError(
                f"unknown {self.kind} '{name}'; valid: {valid}, or module:Class for your own"
            ) from None

    def _load(self, spec: str) -> type[T]:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"{self.kind} '{spec}': cannot import module '{module_name}': {exc}") from None
        cls = getattr(module, attr, None)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ConfigError(
                f"{self.kind} '{spec}': '{attr}' in {module_name} is not a subclass of {self.base.__name__}"
            )
        return cls
