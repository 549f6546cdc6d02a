"""``broadcast_state``: one rank's ``state_dict`` (any picklable structure of tensors and plain values) to
every rank of a communicator, through the communicator's own tensor broadcast.

Who sends what to whom: ``root`` serialises the structure with ``torch.save`` (tensors moved to the host),
broadcasts its length (one int64) and then its bytes (one uint8 tensor); every other rank loads it back onto
the host. The structure may differ from what the receivers hold (an optimizer that has not stepped yet has
no momentum buffers), which a tensor-by-tensor broadcast could not carry. It exists for the rare transfers
of a whole state between live peers (elastic training's heal from a peer that holds a later step), not for
a step's exchange: it copies the state twice on each side.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .base import Communicator


def broadcast_state(comm: Communicator, state: Any, root: int) -> Any:
    """``state`` as ``root`` holds it, on every rank (``state`` is ignored elsewhere); tensors on the host.
    Collective over ``comm``."""
    if comm.rank == root:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    comm.broadcast(length, root).wait()
    if comm.rank != root:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    comm.broadcast(payload, root).wait()
    if comm.rank == root:
        return state
    # A peer of the same job wrote it (as a replacement's handover does): not an untrusted file.
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=False)
