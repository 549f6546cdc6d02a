"""The fused engine's path for any network: replica 0's own ``forward()`` run once on every replica's values.

The layer-by-layer fuser (:mod:`.fused_network`) rebuilds an ``nn.Sequential`` of known layers. Everything
else — a ``Conv1d``, a ``LayerNorm``, an embedding, attention, a residual ``forward()`` written the usual way
— runs here: a copy of replica 0's module is called with a :class:`~mpicrossbow.pool.replicated.Replicated`
input holding the m learners' batches, so its Python (shape checks, branches on shapes, submodules, hooks)
runs once, and every operator it reaches runs once for all m replicas with each replica's own weights
(:mod:`.replicated_ops`); an operator without a fused form runs once per replica on its slice, and the
log names it. Measured against ``torch.func.vmap`` on the same networks (benchmarks/results/pool.md): it
avoids vmap's per-operator batching overhead. Once two forwards in a row ran the same operators, later
ones replay them without the forward's Python (:mod:`.replay`).

What this path cannot follow (control flow on tensor values, arithmetic on a parameter outside any operator
on the input, in-place writes into the input) shows in the first training forward as a ContractError: the
path's refusal, on which the chooser (:mod:`.chooser`) moves on to ``torch.func.vmap`` (:mod:`.vmapped`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...errors import ContractError
from .fused_network import FlatSlots
from .replay import ReplayCache, replay_key
from .replicated import OperatorDispatcher, Replicated
from .replicated_ops import OPERATOR_HANDLERS


class ReplicatedNetwork(nn.Module):
    """Every replica's forward as one call of replica 0's ``forward()``: ``(m, N, *sample)`` in and out."""

    def __init__(self, root: nn.Module, slots: FlatSlots) -> None:
        super().__init__()
        self.m = slots.m
        # The template runs the Python of the forward; its own tensors are swapped for the pool's rows in
        # every operator, and are kept out of parameters() and state_dict().
        template = copy.deepcopy(root)
        object.__setattr__(self, "template", template)
        rows: dict[int, torch.Tensor] = {}
        for name, param in root.named_parameters():
            rows[id(template.get_parameter(name))] = slots.param(param)
        for name, buffer in root.named_buffers():
            if buffer.is_floating_point():
                view = slots.buffer(buffer)
                assert view is not None
                rows[id(template.get_buffer(name))] = view
        self.dispatcher = OperatorDispatcher(self.m, rows, OPERATOR_HANDLERS)
        self.dispatcher.guard([*template.parameters(), *template.buffers()])
        #: The forward's recorded operators, replayed without its Python once they repeat (:mod:`.replay`).
        self.replays = ReplayCache()

    def train(self, mode: bool = True) -> ReplicatedNetwork:
        """Set training mode here and on the template (dropout, batch norm)."""
        self.template.train(mode)
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's output on its own batch, ``x`` being ``(m, N, *sample)``: the template's forward
        on the replicated input, replayed where it was recorded, else run (and recorded, while it may yet
        replay)."""
        key = replay_key(x, self.training)
        out = self.replays.run(key, x)
        if out is not None:
            return out
        if self.template.training != self.training:
            self.template.train(self.training)
        recorder = self.replays.recorder(key, x, self.template)
        if recorder is None:
            return self._template_run(x)
        with recorder:
            out = self._template_run(x)
        recorder.finish(out)
        self.replays.offer(key, recorder)
        return out

    def _template_run(self, x: torch.Tensor) -> torch.Tensor:
        """The template's forward on ``x`` wrapped as a Replicated; its output's stacked values."""
        out = self.template(self.dispatcher.wrap(x))
        if not isinstance(out, Replicated):
            raise ContractError("the network's output is not a tensor computed from its input")
        return out.data

    def forget_replays(self) -> None:
        """Record the forward anew from the next call (an epoch starts: Python state may have changed)."""
        self.replays.forget()

    @property
    def looped(self) -> set[str]:
        """Operators that ran once per replica (no fused form), as logged."""
        return self.dispatcher.looped
