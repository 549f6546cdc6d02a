"""``Replicated``: every replica's value of one tensor, stacked, seen by replica code as a single tensor.

The fused engine's path for any network (:class:`~mpicrossbow.pool.replicated_network.ReplicatedNetwork`)
runs replica 0's own ``forward()`` — its Python, its control flow on shapes, its submodules — on a
``Replicated`` input. A ``Replicated`` holds ``data`` of shape ``(m, *shape)`` and answers ``shape``,
``dim()``, ``size()`` as one replica's tensor would; every torch function, tensor method and operator applied
to it reaches :meth:`OperatorDispatcher.call` (PyTorch's ``__torch_function__`` protocol), which runs the
operator once for all m replicas (:mod:`.replicated_ops`) or, for an operator it does not know, once per
replica on its slice — correct always, and logged. Replica 0's parameters and buffers met there are swapped
for the pool's ``(m, *shape)`` views of every replica's copy, so one convolution call convolves every replica
with its own weights.

What it cannot see — arithmetic on a parameter outside any torch call on a ``Replicated``, control flow on a
tensor's values, in-place writes into a ``Replicated`` — raises a ContractError; the network then falls back
to ``torch.func.vmap``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...errors import ContractError

log = logging.getLogger(__name__)

OperatorHandler = Callable[["OperatorDispatcher", Any, tuple[Any, ...], dict[str, Any]], Any]


class Replicated:
    """m replicas' values of one tensor on a leading dimension: ``data`` is ``(m, *shape)``."""

    __slots__ = ("ctx", "data")

    def __init__(self, data: torch.Tensor, ctx: OperatorDispatcher) -> None:
        self.data, self.ctx = data, ctx

    # What one replica's tensor would answer.
    @property
    def shape(self) -> torch.Size:
        """One replica's shape."""
        return self.data.shape[1:]

    def size(self, dim: int | None = None) -> Any:
        """One replica's size (of dimension ``dim``)."""
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        """One replica's number of dimensions."""
        return self.data.dim() - 1

    @property
    def ndim(self) -> int:
        """One replica's number of dimensions."""
        return self.data.dim() - 1

    def numel(self) -> int:
        """One replica's number of elements."""
        return self.data.numel() // self.data.shape[0]

    def __len__(self) -> int:
        """One replica's first dimension."""
        return self.data.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The element type."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        """Where the values live."""
        return self.data.device

    @property
    def is_nested(self) -> bool:
        """Never nested."""
        return False

    @property
    def requires_grad(self) -> bool:
        """Whether autograd tracks the values."""
        return self.data.requires_grad

    @property
    def is_cuda(self) -> bool:
        """Whether the values are on a CUDA device."""
        return self.data.is_cuda

    @property
    def layout(self) -> torch.layout:
        """The values' layout (strided)."""
        return self.data.layout

    @property
    def mT(self) -> Any:
        """The last two dimensions swapped."""
        return self.ctx.call(torch.Tensor.transpose, (self, -2, -1), {})

    @property
    def T(self) -> Any:
        """A 2-D replica tensor transposed."""
        return self.ctx.call(torch.Tensor.t, (self,), {})

    def __bool__(self) -> bool:
        """Control flow on tensor values cannot run once for every replica."""
        raise ContractError("the forward branches on a tensor's values")

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Every torch function that meets a Replicated runs through its OperatorDispatcher."""
        for value in (*args, *(kwargs or {}).values()):
            for leaf in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(leaf, Replicated):
                    return leaf.ctx.call(func, args, kwargs or {})
        return NotImplemented

    def __getattr__(self, name: str) -> Any:
        """A tensor method, bound to this value: runs through the OperatorDispatcher."""
        method = getattr(torch.Tensor, name)
        if not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.ctx.call(method, (self, *args), kwargs)

    def __getitem__(self, index: Any) -> Any:
        """Indexing a replica's tensor."""
        return self.ctx.call(torch.Tensor.__getitem__, (self, index), {})

    def __setitem__(self, index: Any, value: Any) -> None:
        """In-place writes cannot be followed for every replica."""
        raise ContractError("the forward writes into a tensor in place (item assignment)")


def _binary(name: str) -> Callable[..., Any]:
    """An operator method of Replicated that runs ``torch.Tensor.<name>`` through the OperatorDispatcher."""
    method = getattr(torch.Tensor, name)

    def op(self: Replicated, *args: Any) -> Any:
        return self.ctx.call(method, (self, *args), {})

    op.__name__ = name
    op.__doc__ = f"``torch.Tensor.{name}`` for every replica."
    return op


_OPERATORS = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __matmul__ __rmatmul__ "
    "__neg__ __pow__ __rpow__ __floordiv__ __mod__ __lt__ __le__ __gt__ __ge__ __eq__ __ne__ __and__ "
    "__or__ __invert__ __abs__"
).split()
for _name in _OPERATORS:
    setattr(Replicated, _name, _binary(_name))
# In-place operators become out-of-place ones: ``out += identity`` rebinds ``out`` to the sum.
for _name, _plain in (
    ("__iadd__", "__add__"),
    ("__isub__", "__sub__"),
    ("__imul__", "__mul__"),
    ("__itruediv__", "__truediv__"),
):
    setattr(Replicated, _name, _binary(_plain))
Replicated.__hash__ = object.__hash__  # type: ignore[method-assign]  # __eq__ above is elementwise


class OperatorDispatcher:
    """How one fused network's operators run for all m replicas: the replica tensors it swaps, the handlers.

    ``params`` maps ``id()`` of each of the template's parameters and float buffers to the pool's
    ``(m, *shape)`` view of every replica's copy; ``handlers`` maps a torch function (or ``torch.Tensor``
    method) to how it runs for every replica at once.
    """

    def __init__(self, m: int, params: dict[int, torch.Tensor], handlers: dict[Any, OperatorHandler]) -> None:
        self.m, self.params, self.handlers = m, params, handlers
        #: Per call site state of handlers (a convolution's chosen form), keyed by the handler's choice.
        self.state: dict[Any, Any] = {}
        #: Operators that ran once per replica (no handler), as logged.
        self.looped: set[str] = set()
        self._guarded: set[int] = set()

    def guard(self, owned: list[torch.Tensor]) -> None:
        """Remember the storage of the template's own tensors: a derived tensor reaching an operator is an
        error (it would carry replica 0's values to every replica)."""
        self._guarded = {t.untyped_storage().data_ptr() for t in owned}

    def wrap(self, data: torch.Tensor) -> Replicated:
        """``data`` ``(m, *shape)`` as a Replicated."""
        return Replicated(data, self)

    def rows(self, value: Any) -> torch.Tensor | None:
        """The ``(m, *shape)`` rows of a template parameter or buffer; None for anything else."""
        return self.params.get(id(value)) if isinstance(value, torch.Tensor) else None

    def plain(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor the replicas share (a constant): checked not to derive from the template's state."""
        if value.requires_grad or value.untyped_storage().data_ptr() in self._guarded:
            raise ContractError("a tensor computed from a parameter outside any operator on the input")
        return value

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` for every replica: by its handler when it has one, else once per replica."""
        handler = self.handlers.get(func)
        if handler is not None:
            result = handler(self, func, args, kwargs)
            if result is not NotImplemented:
                return result
        return self.per_replica(func, args, kwargs)

    def per_replica(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` once per replica on its slice (and its own parameters), the results stacked."""
        name = getattr(func, "__name__", None) or repr(func)
        if name.endswith("_") and not name.endswith("__"):
            raise ContractError(f"the forward calls the in-place {name}")
        if name not in self.looped:
            self.looped.add(name)
            log.info("fused engine: %s has no fused form here, so it runs once per replica", name)

        def pick(j: int) -> Callable[[Any], Any]:
            def one(value: Any) -> Any:
                if isinstance(value, Replicated):
                    return value.data[j]
                rows = self.rows(value)
                if rows is not None:
                    return rows[j]
                return self.plain(value) if isinstance(value, torch.Tensor) else value

            return one

        outs = [func(*pytree.tree_map(pick(j), args), **kwargs_of(pick(j), kwargs)) for j in range(self.m)]
        leaves, spec = pytree.tree_flatten(outs[0])
        columns = [pytree.tree_flatten(out)[0] for out in outs]
        stacked = [
            self.wrap(torch.stack([col[i] for col in columns])) if isinstance(leaf, torch.Tensor) else leaf
            for i, leaf in enumerate(leaves)
        ]
        return pytree.tree_unflatten(stacked, spec)


def kwargs_of(pick: Callable[[Any], Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every value mapped by ``pick``."""
    return {key: pytree.tree_map(pick, value) for key, value in kwargs.items()}
