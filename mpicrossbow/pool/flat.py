"""Flat buffers: one contiguous tensor that a module's parameters (or gradients, or buffers) are views of.

Rules exchange whole models with one collective on one buffer instead of one call per tensor, and with the
tensors re-pointed into the buffer there is no packing copy at all (the idea of Apex's flat master weights
and of PyTorch's model-averaging ``utils``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
    flat = torch.empty(sum(t.numel() for t in tensors), device=device, dtype=dtype)
    offset = 0
    for t in tensors:
        n = t.numel()
        view = flat[offset : offset + n].view_as(t)
        view.copy_(t.detach())
        t.data = view
        offset += n
    return flat


def attach_flat_grads(params: Sequence[torch.nn.Parameter], flat_params: torch.Tensor) -> torch.Tensor:
    """Give every parameter a ``.grad`` that is a view of one zeroed flat buffer shaped like ``flat_params``.

    Autograd accumulates into an existing ``.grad`` in place, so after ``backward()`` the flat buffer holds
    every gradient, ready for a single allreduce. Never set these grads to None (``zero_grad(set_to_none=
    True)``): zero the flat buffer instead.
    """
    grads = torch.zeros_like(flat_params)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = grads[offset : offset + n].view_as(p)
        offset += n
    return grads
