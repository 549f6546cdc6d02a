"""Flat buffers: one contiguous tensor that a module's parameters (or gradients, or buffers) are views of.

Rules exchange whole models with one collective on one buffer instead of one call per tensor, and with the
tensors re-pointed into the buffer there is no packing copy at all (the idea of Apex's flat master weights
and of PyTorch's model-averaging ``utils``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def empty_flat(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D buffer for exchanges.

    On the CPU it is allocated by numpy, which advises the kernel to back large arrays with transparent huge
    pages; torch's allocator does not, and MPI's shared-memory copies were measured ~8% faster on huge
    pages (benchmarks/results/exchange.md). The tensor shares numpy's memory (zero-copy).
    """
    if device.type == "cpu" and dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.empty(numel, dtype=_NUMPY_DTYPES[dtype]))
    return torch.empty(numel, device=device, dtype=dtype)


def flatten_into_buffer(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` into one new flat buffer and re-point each tensor's ``.data`` at its slice.

    All tensors must share device and dtype. Returns the buffer (empty if ``tensors`` is empty). Optimizers
    and modules keep working because the tensor objects are unchanged; only their storage moved.
    """
    if not tensors:
        return torch.zeros(0)
    device, dtype = tensors[0].device, tensors[0].dtype
    if any(t.device != device or t.dtype != dtype for t in tensors):
        raise ValueError("flat buffers need tensors of one device and dtype")
    flat = empty_flat(sum(t.numel() for t in tensors), device, dtype)
    point_into(tensors, flat)
    return flat


def point_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``tensors`` one after another into the 1-D contiguous ``flat`` and re-point their ``.data`` there.

    ``flat`` may be a row of a larger 2-D buffer (the fused engine keeps learner j's replica in row j); it
    must hold exactly the tensors' total size.
    """
    if flat.numel() != sum(t.numel() for t in tensors):
        raise ValueError(f"flat holds {flat.numel()} elements, the tensors {sum(t.numel() for t in tensors)}")
    offset = 0
    for t in tensors:
        n = t.numel()
        view = flat[offset : offset + n].view_as(t)
        view.copy_(t.detach())
        t.data = view
        offset += n


def point_grads_into(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Give every parameter a ``.grad``: its slice of the 1-D ``flat``, in order (as :func:`point_into`).

    The fused engine's replicas thus accumulate their gradients straight into their row of the pool's
    gradient buffer when they run one after another.
    """
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p)
        offset += n


def attach_flat_grads(params: Sequence[torch.nn.Parameter], flat_params: torch.Tensor) -> torch.Tensor:
    """Give every parameter a ``.grad`` that is a view of one zeroed flat buffer shaped like ``flat_params``.

    Autograd accumulates into an existing ``.grad`` in place, so after ``backward()`` the flat buffer holds
    every gradient, ready for a single allreduce. Never set these grads to None (``zero_grad(set_to_none=
    True)``): zero the flat buffer instead.
    """
    grads = empty_flat(flat_params.numel(), flat_params.device, flat_params.dtype).zero_()
    point_grads_into(params, grads)
    return grads
