"""PrecisionForward: a user's model whose forward runs under the job's autocast (``xb.distribute(...,
precision="bf16" | "fp16")``), the way Lightning Fabric's mixed precision wraps a module.

The module's ``forward`` is replaced on the instance (the class is untouched) by one that enters
:meth:`~mpicrossbow.pool.precision.Precision.autocast` around the original and casts every floating tensor
it returns to float32, so the user's loss, metrics and anything else outside the model see fp32 as they did
before. The weights stay fp32 (autocast casts them inside each operator) and so does everything the rule
and the optimizer read. :meth:`remove` (``xb.finish``) restores the original forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..pool.precision import Precision


def _to_float32(value: Any) -> Any:
    """``value`` as float32 where it is a 16-bit floating tensor, else as it is."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


class PrecisionForward:
    """``module.forward`` under ``precision``'s autocast, outputs back in float32, until :meth:`remove`."""

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        self.module, self.precision = module, precision
        self._own = "forward" in module.__dict__  # the user set a forward on the instance already
        self._original = module.forward
        if precision.dtype is None:
            return
        original = self._original

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with precision.autocast():
                output = original(*args, **kwargs)
            return tree_map(_to_float32, output)

        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        """Give the module its own forward back."""
        if self.precision.dtype is None:
            return
        if self._own:
            self.module.forward = self._original  # type: ignore[method-assign]
        else:
            del self.module.forward
