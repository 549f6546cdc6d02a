"""The same network on every rank: a collective check before any weight is broadcast or exchanged."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import ContractError
from ..launch.world import World


def check_same_shapes(world: World, shapes: Sequence[tuple[int, ...]]) -> None:
    """Collective: every rank's parameter ``shapes`` are rank 0's, else one ContractError on every rank
    naming the first rank that differs (a rank that built another network would corrupt every exchange)."""
    everyone = world.allgather([tuple(s) for s in shapes])
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            count = sum(math.prod(s) for s in theirs)
            first = sum(math.prod(s) for s in everyone[0])
            raise ContractError(
                f"the model differs across ranks: rank 0 has {len(everyone[0])} parameter tensors "
                f"({first:,} values), rank {rank} has {len(theirs)} ({count:,} values); "
                "every rank must build the same network"
            )
