"""Host → device copies of the fused engine's stacked batches: page-locked buffers, no host wait.

A copy from pageable memory makes the host wait for it; from page-locked (pinned) memory it is queued and
overlaps with the kernels already queued. The m learners' batches are stacked straight into one of two
pinned buffers per kind of tensor (inputs, targets) and copied with ``non_blocking=True``; a buffer is
written again only after the copy that last read it has finished (a CUDA event), two steps later, so the
host never overwrites what the device has not read yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Ring:
    """Two pinned buffers of one shape and dtype, the events of the copies that last read them, a turn."""

    buffers: list[torch.Tensor]
    copies: list[torch.cuda.Event | None] = field(default_factory=lambda: [None, None])
    turn: int = 0


class PinnedStaging:
    """Stacks tensors into alternating pinned buffers and queues their copy to ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rings: dict[tuple[str, torch.Size, torch.dtype], _Ring] = {}

    def stacked(
        self, key: str, tensors: Sequence[torch.Tensor], into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``torch.stack(tensors)`` on the device, copied asynchronously from a pinned buffer: into ``into``
        where given (a CUDA graph's static input of that shape and dtype), else a new tensor."""
        shape = torch.Size((len(tensors), *tensors[0].shape))
        index = (key, shape, tensors[0].dtype)
        ring = self._rings.get(index)
        if ring is None:
            pinned = [torch.empty(shape, dtype=tensors[0].dtype, pin_memory=True) for _ in range(2)]
            ring = self._rings[index] = _Ring(pinned)
        slot, ring.turn = ring.turn, 1 - ring.turn
        last_copy = ring.copies[slot]
        if last_copy is not None:
            last_copy.synchronize()
        torch.stack(list(tensors), out=ring.buffers[slot])
        if into is not None and into.shape == shape and into.dtype == tensors[0].dtype:
            on_device = into.copy_(ring.buffers[slot], non_blocking=True)
        else:
            on_device = ring.buffers[slot].to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        ring.copies[slot] = done
        return on_device
