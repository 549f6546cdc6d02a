"""m ``Conv1d`` call sites as one: every replica's convolution along the length, channels last.

The fused engine's 2-D form (:class:`~mpicrossbow.pool.fused_network.FusedConv2d`) runs a 1-D convolution as
a 2-D one over ``(…, 1, L)`` in the grouped layout ``(N, m·C, 1, L)``: every call converts the replicas'
values into that layout and back (a copy each way), and the pointwise layers between two convolutions then
work on a transposed view (ReLU's backward measured 5× slower there). The *lengthwise* form keeps the values
channels last, ``(m, N, L, C)``, which is what a batched matmul wants: pad the length, unfold it into
windows (a view), gather them once (im2col, ``(m, N·L_out, C·k)``) and multiply by every replica's kernel
in one ``baddbmm``. Its output ``(m, N, L_out, out)`` is handed on as the ``(m, N, out, L_out)`` view the
replica code expects; the next lengthwise convolution reads it back channels last without a copy.

**Needed for speed** (benchmarks/pool.py, m = 8, one thread): with the 2-D form alone the MNIST-1D CNN's
fused ÷ bound falls from 1.13 to 0.77 at b = 4 and from 1.06 to 0.63–0.78 at b = 16. Not CPU-only: on a GPU
it saves the same two layout copies per call and keeps one kernel (a batched matmul) per convolution.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from .fused_network import FusedConv2d, batched


class FusedConv1d(nn.Module):
    """m ``Conv1d`` on ``(m, N, C, L)`` values → ``(m, N, out, L_out)``: lengthwise where it serves (an
    ungrouped convolution with numeric padding), else the 2-D form (:attr:`form`).

    ``spec`` carries the call's ``weight``, ``bias``, ``stride``, ``padding``, ``dilation``, ``groups`` as
    1-D values (ints or 1-tuples, or a padding string); ``slots.param`` maps a template tensor to its
    ``(m, *shape)`` rows.
    """

    def __init__(self, spec: Any, slots: Any) -> None:
        super().__init__()
        self.m = slots.m
        self.weight = slots.param(spec.weight)  # (m, out, C/groups, k)
        self.bias = slots.param(spec.bias) if spec.bias is not None else None
        (self.stride,), (self.dilation,) = _one(spec.stride), _one(spec.dilation)
        self.kernel = self.weight.shape[-1]
        self.two_d_layer = FusedConv2d(_as_two_d(spec), slots)
        self.padding = None if isinstance(spec.padding, str) or spec.groups != 1 else _one(spec.padding)[0]
        #: ``lengthwise`` or ``two_d``, for the run's record.
        self.form = "two_d" if self.padding is None else "lengthwise"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's convolution of its own ``(N, C, L)`` values with its own kernel."""
        return self.two_d(x) if self.padding is None else self.lengthwise(x)

    def lengthwise(self, x: torch.Tensor) -> torch.Tensor:
        """Channels last: the windows gathered once, one batched matmul with every replica's kernel."""
        m, n = x.shape[:2]
        out = self.weight.shape[1]
        cols = windows(x.transpose(2, 3), self.kernel, self.stride, self.dilation, self.padding)
        length = cols.shape[1] // n
        # (m, k·C, out): the (out, C, k) kernels reordered tap major, as the windows are (one small copy).
        kernels = self.weight.transpose(2, 3).reshape(m, out, -1).transpose(1, 2)
        if self.bias is None:
            y = torch.bmm(cols, kernels)
        else:
            y = torch.baddbmm(self.bias.unsqueeze(1), cols, kernels)
        return y.view(m, n, length, out).transpose(2, 3)

    def two_d(self, x: torch.Tensor) -> torch.Tensor:
        """The 2-D form over ``(…, 1, L)``, grouped layout; the output is handed on channels last, as
        :meth:`lengthwise` hands it, so the next layers see one layout whichever form ran."""
        y = batched(self.two_d_layer(x.unsqueeze(-2)), self.m).squeeze(-2)
        return y.transpose(2, 3).contiguous().transpose(2, 3)


def _one(value: Any) -> tuple[Any, ...]:
    """A 1-D convolution argument as a 1-tuple (an int, or a string padding, stays one value)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _as_two_d(spec: Any) -> Any:
    """The call's arguments for a 2-D convolution over ``(…, 1, L)`` (the kernel gains a unit axis)."""

    def pair(value: Any, fill: int) -> Any:
        return value if isinstance(value, str) else (fill, *_one(value))

    return SimpleNamespace(
        weight=spec.weight,
        bias=spec.bias,
        stride=pair(spec.stride, 1),
        padding=pair(spec.padding, 0),
        dilation=pair(spec.dilation, 1),
        groups=spec.groups,
        padding_mode="zeros",
    )


def windows(x: torch.Tensor, kernel: int, stride: int, dilation: int, padding: int) -> torch.Tensor:
    """Every window of ``x`` ``(m, N, L, C)`` as a row, ``(m, N·L_out, k·C)`` (:class:`_Windows`); one
    operator to a torch function mode (a forward's recording, :mod:`.replay`): it must not see inside."""
    if has_torch_function((x,)):
        return handle_torch_function(windows, (x,), x, kernel, stride, dilation, padding)
    return _Windows.apply(x, kernel, stride, dilation, padding)


class _Windows(torch.autograd.Function):
    """im2col along the length, channels last: ``(m, N, L, C)`` → ``(m, N·L_out, k·C)`` (tap major, channel
    minor, so every tap's channels are copied as one contiguous run; the kernel is flattened to match), zero
    padding included. Measured on MNIST-1D's second convolution (m = 8, batch 16, one thread): the gather
    took 57 µs channel-major (runs of one value, the taps C apart) and 17 µs tap-major.

    Autograd's own backward of ``unfold`` scatters element by element (155 µs a call on MNIST-1D's second
    convolution, m = 8, batch 16, one thread); here it is k strided adds, one per kernel tap: that layer's
    forward and backward measured 844 → 672 µs.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, kernel: int, stride: int, dilation: int, padding: int
    ) -> torch.Tensor:
        """Every window of every sample of every replica, one row each."""
        m, n, _, channels = x.shape
        padded = F.pad(x, (0, 0, padding, padding)).contiguous()
        span = padded.shape[2]
        windows = (span - (kernel - 1) * dilation - 1) // stride + 1
        # Window w, tap j, channel c reads padded[…, w·stride + j·dilation, c]: a view, then one copy whose
        # innermost run is a tap's C contiguous channels (as a (out, k, C) kernel flattens).
        view = padded.as_strided(
            (m, n, windows, kernel, channels),
            (n * span * channels, span * channels, stride * channels, dilation * channels, 1),
            padded.storage_offset(),
        )
        ctx.geometry = (x.shape, kernel, stride, dilation, padding, windows)
        return view.reshape(m, n * windows, kernel * channels)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Each tap's gradient added back at the positions it read; the padding cut off."""
        (m, n, length, channels), kernel, stride, dilation, padding, windows = ctx.geometry
        taps = grad.view(m, n, windows, kernel, channels)
        padded = grad.new_zeros(m, n, length + 2 * padding, channels)
        for j in range(kernel):
            start = j * dilation
            padded[:, :, start : start + stride * (windows - 1) + 1 : stride] += taps[..., j, :]
        return padded[:, :, padding : padding + length], None, None, None, None
