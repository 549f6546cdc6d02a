"""Pair swapping: Theano-MPI's ``swap`` exchange (its BSP ``sync_type = 'swap'``, written for GAN training).

Who sends what to whom, and when: at every step the ranks are put in random pairs — a permutation of
``0..size-1`` drawn from a generator seeded with (``SEED``, step), so every rank draws the same pairs without
talking; with an odd size the last rank of the permutation sits the step out — and the two ranks of a pair
exchange their replicas whole: learner j of one rank takes learner j's weights of the other. Nothing is
averaged; each set of weights wanders between the ranks' data. Theano-MPI drew the permutation on rank 0 and
broadcast it; the shared seed gives every rank the same one for free.
"""

from __future__ import annotations

import numpy as np
import torch

from ..comm.base import Communicator

#: Seed of the pairing, with the step.
SEED = 1234
#: Point-to-point tag of the swapped replicas.
SWAP_TAG = 5301


def partner(rank: int, size: int, step: int) -> int | None:
    """The rank ``rank`` swaps with at ``step``, or None (it sits this step out)."""
    order = np.random.default_rng([SEED, step]).permutation(size).tolist()
    at = order.index(rank)
    if at == size - 1 and size % 2:
        return None
    return order[at + 1] if at % 2 == 0 else order[at - 1]


class PairSwap:
    """Swaps ``flats`` (one flat tensor per learner of this rank) with this step's partner rank."""

    def __init__(self, comm: Communicator, flats: list[torch.Tensor]) -> None:
        self.comm, self.flats = comm, flats
        self.inbox = [torch.empty_like(flat) for flat in flats]

    def swap(self, step: int) -> int | None:
        """Exchange every learner's flat with the partner's same learner; the partner (None: no swap)."""
        other = partner(self.comm.rank, self.comm.size, step)
        if other is None:
            return None
        recvs = [self.comm.irecv(box, other, SWAP_TAG) for box in self.inbox]
        sends = [self.comm.isend(flat, other, SWAP_TAG) for flat in self.flats]
        for handle in recvs + sends:
            handle.wait()
        for flat, box in zip(self.flats, self.inbox, strict=True):
            flat.copy_(box)
        return other
