"""The fused engine's last path: m replicas run as one vectorised call of ``torch.func.vmap``.

A network whose forward :mod:`.replicated_network` cannot follow (a tensor computed from a parameter
outside any operator on the input) takes this path: replica 0's module is the template, and
``vmap(functional_call(template, …))`` runs it over the replica dimension with every replica's parameters
and buffers, so each operator runs once for all m replicas through PyTorch's batching rules (a convolution
becomes one grouped convolution, a matmul one batched matmul), and operators without a batching rule are
looped over the replicas by PyTorch itself.

**State.** The parameters handed to ``vmap`` are the pool's strided ``(m, *shape)`` views of its 2-D buffers
(:class:`~mpicrossbow.pool.fused_network.FlatSlots`), their gradients views of the gradient buffer, exactly as
in the layer-by-layer path; float buffers (batch-norm running statistics) are ``(m, *shape)`` views too and
are updated under ``vmap`` in contiguous copies, written back after each training forward. Integer buffers
(``num_batches_tracked``) are kept per replica here and are not part of the exchanged or checkpointed state
(they matter only to a batch norm with ``momentum=None``). Dropout draws a different mask per replica
(``randomness="different"``).
"""

from __future__ import annotations

import copy
import logging
import re
import warnings
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from .fused_network import FlatSlots

log = logging.getLogger(__name__)

#: PyTorch's warning for an operator without a batching rule (vmap then loops over the replicas).
_NO_RULE = re.compile(r"batching rule for (\S+)\.")


class VmappedNetwork(nn.Module):
    """Every replica's forward in one ``vmap``: ``(m, N, *sample)`` in, ``(m, N, *output)`` out."""

    def __init__(self, root: nn.Module, slots: FlatSlots) -> None:
        super().__init__()
        self.m = slots.m
        # The template's own tensors are never used; keeping it out of the module tree keeps them out of
        # parameters() and state_dict().
        object.__setattr__(self, "template", copy.deepcopy(root))
        self.fused = nn.ParameterDict({_key(name): slots.param(p) for name, p in root.named_parameters()})
        self._names = {_key(name): name for name, _ in root.named_parameters()}
        #: Operators PyTorch ran once per replica (no batching rule), as reported.
        self.looped: set[str] = set()
        self._float_buffers: dict[str, torch.Tensor] = {}
        self._other_buffers: dict[str, torch.Tensor] = {}
        for name, buffer in root.named_buffers():
            if buffer.is_floating_point():
                view = slots.buffer(buffer)
                assert view is not None
                self._float_buffers[name] = view
            else:
                self._other_buffers[name] = buffer.detach().clone().expand(self.m, *buffer.shape).clone()

    def train(self, mode: bool = True) -> VmappedNetwork:
        """Set training mode here and on the template (dropout, batch norm)."""
        self.template.train(mode)
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's output on its own batch, ``x`` being ``(m, N, *sample)``."""
        params = {self._names[key]: p for key, p in self.fused.items()}

        def one(tensors: dict[str, torch.Tensor], inputs: torch.Tensor) -> Any:
            return functional_call(self.template, tensors, (inputs,))

        # Batch norm updates its running statistics in place only in contiguous tensors: in training they go
        # in as contiguous copies of the strided rows and are written back after the forward.
        scratch = {n: b.contiguous() for n, b in self._float_buffers.items()} if self.training else {}
        tensors = {**params, **self._float_buffers, **scratch, **self._other_buffers}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = vmap(one, randomness="different")(tensors, x)
        self._report_fallbacks(caught)
        for name, copy_ in scratch.items():
            if copy_.data_ptr() != self._float_buffers[name].data_ptr():
                self._float_buffers[name].copy_(copy_)
        return out

    def _report_fallbacks(self, caught: list[warnings.WarningMessage]) -> None:
        """Log once per operator that PyTorch ran once per replica (no batching rule); re-issue the rest."""
        for warning in caught:
            found = _NO_RULE.search(str(warning.message))
            if found is None:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            elif found[1] not in self.looped:
                self.looped.add(found[1])
                log.info("fused engine: %s has no batching rule, so it runs once per replica", found[1])


def _key(name: str) -> str:
    """A parameter name as a ParameterDict key (dots are not allowed there)."""
    return name.replace(".", "__")
