"""GradScaler: torch's ``GradScaler`` whose skip decisions every rank of a synchronous rule agrees on.

A drop-in for ``torch.amp.GradScaler`` in a loop under ``xb.distribute(..., precision="fp16")``::

    scaler = xb.GradScaler()
    for x, y in loader:
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(optimizer)      # unscale, agree across ranks, then the rule's hooks and the step
        scaler.update()

torch's scaler skips ``optimizer.step()`` on the rank whose gradients overflowed and steps on the others:
the replicas of a synchronous rule part, and the skipping rank's missing collective hangs its peers. After
torch's own unscale this one asks the ranks (:meth:`~.step_hooks.StepHooks.agree_overflow`, one allreduce of
the flag) and writes the agreed flag where torch's ``step`` and ``update`` read it, so every rank skips the
same steps and every rank's scale moves alike. An optimizer that is not distributed (or whose job
finished) gets torch's behaviour unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .step_hooks import HOOKED


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the overflow flag agreed across the distributed ranks (module doc).

    ``device`` defaults to the device type of the rank (``cuda`` when CUDA exists, else ``cpu``); every
    other keyword is torch's (``init_scale``, ``growth_interval``, ...).
    """

    def __init__(self, device: str | None = None, **kwargs: Any) -> None:
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's unscale, then the flag of every rank's overflow in place of this rank's own."""
        super().unscale_(optimizer)
        hooks = HOOKED.get(optimizer)
        if hooks is None or not self.is_enabled():
            return
        # torch keeps the flags per optimizer and device (private, read by step() and update()).
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = any(bool(flag.item()) for flag in found.values())
        agreed = hooks.agree_overflow(local)
        if agreed and not found:  # no gradient here, but a peer overflowed: step() must skip too
            found[torch.device(self._device)] = torch.ones(1, device=self._device)
        for flag in found.values():
            flag.fill_(1.0 if agreed else 0.0)
