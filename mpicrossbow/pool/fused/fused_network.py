"""Horizontal fusion: m replicas of one network become one wider module (the idea of HFTA, Wang et al. 2021).

Small per-learner batches leave most of a device idle and spend their time in per-operator overhead. Fusing
the m replicas turns m small operators into one big one:

* ``Linear`` → one batched matmul (``torch.baddbmm``) over the replica dimension;
* ``Conv2d`` → one grouped convolution with ``groups = m × groups``;
* ``BatchNorm1d/2d`` → one batch norm over m × C channels, which normalises each replica's channels with
  that replica's own batch statistics and keeps each replica's running statistics;
* pointwise activations, ``Dropout``, ``Identity`` → applied to the whole tensor;
* ``MaxPool2d``, ``AvgPool2d``, ``AdaptiveAvgPool2d``, ``AdaptiveMaxPool2d`` → per-channel already;
* ``Flatten``, ``Sequential`` and :class:`~mpicrossbow.residual.Residual` → structure, fused child by child.

**Layouts.** The fused network takes the m learners' batches stacked, ``(m, N, *sample)``, and returns
``(m, N, *output)``. Inside it a tensor is in one of two layouts, told apart by its rank: *batched*
``(m, N, F)`` (3-D, for features) or ``(m, N, C, H, W)`` (5-D, for images), and *grouped* ``(N, m·C, H, W)``
(4-D: replica j owns channels ``j·C … (j+1)·C − 1``), which is what grouped convolutions, batch norm and
pooling want. Layers convert as needed; samples are therefore feature vectors or ``(C, H, W)`` images.

**Parameters.** Every fused parameter is a strided view ``(m, *shape)`` of a pool-level 2-D buffer whose row
j is learner j's flat replica, and its ``.grad`` is the matching view of the gradient buffer (see
:class:`FlatSlots`). Batched matmuls read such views directly; a grouped convolution needs its weight as
``(m·out, …)``, which costs one small copy of the weight per forward (autograd routes the gradient back into
the strided view). Running statistics are updated in a contiguous scratch copy and written back, because
``batch_norm`` updates only contiguous buffers in place.

**Unsupported layers are an error**, not a silent fallback: :func:`fuse` raises a ContractError naming the
layer type and the supported ones. Types match exactly (a subclass may override ``forward``, which fusion
could not see); write custom blocks from the supported layers and :class:`Residual`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ContractError
from ...model.residual import Residual


def grouped(x: torch.Tensor, m: int) -> torch.Tensor:
    """Images in the grouped layout ``(N, m·C, H, W)``; a batched ``(m, N, C, H, W)`` tensor is converted.

    The conversion (one copy) stores the result channels-last: oneDNN's grouped convolutions, batch norm and
    pooling then keep that format; forward + backward of a grouped convolution measured 1.1–2.1× faster
    channels-last than NCHW on this project's CPU (benchmarks/results/pool.md).
    """
    if x.ndim == 5:
        _, n, c, h, w = x.shape
        return x.permute(1, 3, 4, 0, 2).reshape(n, h, w, m * c).permute(0, 3, 1, 2)
    return x


def batched(x: torch.Tensor, m: int) -> torch.Tensor:
    """Any fused tensor in the batched layout ``(m, N, …)``; a grouped 4-D tensor is converted."""
    if x.ndim == 4:
        n, mc, h, w = x.shape
        return x.reshape(n, m, mc // m, h, w).transpose(0, 1)
    return x


class FlatSlots:
    """Where each tensor of replica 0 lives in the pool's 2-D buffers, and the fused views of them.

    ``params`` / ``grads`` are ``(m, P)``, ``buffers`` ``(m, B)``; ``offsets`` maps ``id(tensor)`` of
    replica 0's parameters and float buffers to their column offset. Every fused parameter handed out is
    recorded in ``fused_params`` so the pool can build its optimizer over them, in flat order.
    """

    def __init__(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        buffers: torch.Tensor,
        param_offsets: dict[int, int],
        buffer_offsets: dict[int, int],
    ) -> None:
        self.params, self.grads, self.buffers = params, grads, buffers
        self.m = params.shape[0]
        self.param_offsets, self.buffer_offsets = param_offsets, buffer_offsets
        self.fused_params: dict[int, nn.Parameter] = {}

    def param(self, tensor: torch.Tensor) -> nn.Parameter:
        """The fused ``(m, *shape)`` parameter for replica 0's ``tensor``, its grad a view of ``grads``."""
        offset = self.param_offsets[id(tensor)]
        if offset in self.fused_params:  # a parameter shared by two layers: one fused parameter too
            return self.fused_params[offset]
        n = tensor.numel()
        fused = nn.Parameter(self.params[:, offset : offset + n].view(self.m, *tensor.shape))
        fused.grad = self.grads[:, offset : offset + n].view(self.m, *tensor.shape)
        self.fused_params[offset] = fused
        return fused

    def buffer(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The ``(m, *shape)`` view of ``buffers`` holding every replica's copy of replica 0's ``tensor``."""
        if tensor is None:
            return None
        offset = self.buffer_offsets[id(tensor)]
        return self.buffers[:, offset : offset + tensor.numel()].view(self.m, *tensor.shape)

    def ordered_params(self) -> list[nn.Parameter]:
        """Every fused parameter handed out, in the order of the flat buffer."""
        return [self.fused_params[k] for k in sorted(self.fused_params)]


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ Wᵀ + b`` for every replica at once: ``x`` ``(m, N, in)``, ``weight`` ``(m, out, in)``."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


class FusedLinear(nn.Module):
    """m ``Linear`` layers as one batched matmul: ``(m, N, in) → (m, N, out)``."""

    def __init__(self, layer: nn.Linear, slots: FlatSlots) -> None:
        super().__init__()
        self.weight = slots.param(layer.weight)  # (m, out, in)
        self.bias = slots.param(layer.bias) if layer.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Wᵀ + b`` for every replica at once."""
        if x.ndim != 3:
            raise ContractError(f"fused Linear expects (m, N, features) inputs, got shape {tuple(x.shape)}")
        return batched_linear(x, self.weight, self.bias)


class FusedConv2d(nn.Module):
    """m ``Conv2d`` layers on the grouped layout as one grouped convolution with m × groups groups.

    The input is made channels-last first (:attr:`form` ``channels_last``): oneDNN's grouped kernels run far
    faster on that layout (forward and backward of LeNet-28's convolutions at m = 8, batch 4, one thread,
    2.3× and 3.1× faster than on NCHW), and its output stays channels-last for the layers after it. A 1-D
    convolution (run as a 2-D one over ``(…, 1, L)``) and a single replica keep NCHW (``grouped``). Which
    form to take was once timed per layer among four (NCHW, channels-last, m convolutions, im2col): a fixed
    channels-last kept fused ÷ bound as high on LeNet-28 and ResNet-20 (m = 8, b = 4 and 16).
    """

    def __init__(self, layer: nn.Conv2d, slots: FlatSlots) -> None:
        super().__init__()
        if layer.padding_mode != "zeros":
            raise ContractError(
                f"fused Conv2d supports padding_mode='zeros' only, got {layer.padding_mode!r}"
            )
        self.m = slots.m
        self.weight = slots.param(layer.weight)  # (m, out, in/groups, kh, kw)
        self.bias = slots.param(layer.bias) if layer.bias is not None else None
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.replica_groups = layer.groups
        #: A 1-D convolution runs as a 2-D one over ``(…, 1, L)`` (its kernel gains an axis).
        self.one_d = self.weight.ndim == 4
        #: The input's layout, for the run's record (see the class docstring).
        self.form = "grouped" if self.one_d or self.m == 1 else "channels_last"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Replica j's filters see only replica j's channels (the weight view is reshaped, one copy)."""
        x = grouped(x, self.m)
        if self.form == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        weight = self.weight.reshape(-1, *self.weight.shape[2:])
        weight = weight.unsqueeze(-2) if self.one_d else weight
        bias = self.bias.reshape(-1) if self.bias is not None else None
        groups = self.replica_groups * self.m
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, groups)  # type: ignore[arg-type]


class FusedBatchNorm(nn.Module):
    """m ``BatchNorm1d`` (on ``(m, N, C)``) or ``BatchNorm2d`` (grouped layout) as one over m × C channels."""

    def __init__(self, layer: nn.BatchNorm1d | nn.BatchNorm2d, slots: FlatSlots) -> None:
        super().__init__()
        self.m, self.two_d = slots.m, isinstance(layer, nn.BatchNorm2d)
        self.eps, self.momentum = layer.eps, layer.momentum
        self.track_running_stats = layer.track_running_stats
        self.weight = slots.param(layer.weight) if layer.weight is not None else None
        self.bias = slots.param(layer.bias) if layer.bias is not None else None
        self.running_mean = slots.buffer(layer.running_mean)  # (m, C) views of the pool's buffers
        self.running_var = slots.buffer(layer.running_var)
        self.batches_tracked = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise each replica's channels with its own statistics; update its own running statistics."""
        factor = 0.0
        if self.training and self.track_running_stats:
            self.batches_tracked += 1
            factor = 1.0 / self.batches_tracked if self.momentum is None else self.momentum
        use_batch = self.training or self.running_mean is None
        if self.two_d:
            inputs = grouped(x, self.m)
        else:
            if x.ndim != 3:
                raise ContractError(f"fused BatchNorm1d expects (m, N, C) inputs, got shape {tuple(x.shape)}")
            inputs = x.transpose(0, 1).reshape(x.shape[1], -1)
        stats = (self.running_mean, self.running_var, self.weight, self.bias)
        out = batch_norm_rows(inputs, *stats, use_batch, factor, self.eps)
        if self.two_d:
            return out
        return out.view(x.shape[1], self.m, -1).transpose(0, 1)


def batch_norm_rows(
    inputs: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    use_batch: bool,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """Batch norm of ``inputs`` ``(N, m·C, …)`` with each replica's ``(m, C)`` rows of statistics and affine.

    The rows are strided views of the pool's buffers; ``batch_norm`` updates running statistics in place
    only in contiguous tensors, so it gets contiguous copies, written back into the rows after training.
    """
    tensors = (running_mean, running_var, weight, bias)
    mean, var, flat_weight, flat_bias = (t.reshape(-1) if t is not None else None for t in tensors)
    out = F.batch_norm(inputs, mean, var, flat_weight, flat_bias, use_batch, momentum, eps)
    scratch = mean is not None and mean._base is None  # reshape copied (m > 1) rather than viewed
    if use_batch and scratch and running_mean is not None and running_var is not None and var is not None:
        with torch.no_grad():  # the scratch copies got the update; write it back into each row
            running_mean.copy_(mean.view_as(running_mean))
            running_var.copy_(var.view_as(running_var))
    return out


class FusedFlatten(nn.Module):
    """``Flatten()`` per replica: grouped ``(N, m·C, H, W)`` or batched ``(m, N, …)`` → ``(m, N, F)``.

    A channels-last input gets its gradient channels-last (a hook); the reshape's is NCHW, and the pooling
    before would copy its gradient and indices to NCHW and back (LeNet-28, m = 8, b = 4, one thread: ~170 µs
    of a ~4 ms step; fused ÷ bound 0.98 → 1.02–1.03 quiet, same under load). GPU pooling wants one layout.
    """

    def __init__(self, layer: nn.Flatten, slots: FlatSlots) -> None:
        super().__init__()
        if layer.start_dim != 1 or layer.end_dim != -1:
            raise ContractError("fused Flatten supports start_dim=1, end_dim=-1 only")
        self.m = slots.m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each replica's samples flattened to feature vectors."""
        if x.ndim == 4:
            if x.requires_grad and x.is_contiguous(memory_format=torch.channels_last):  # see the docstring
                x.register_hook(lambda grad: grad.contiguous(memory_format=torch.channels_last))
            return x.reshape(x.shape[0], self.m, -1).transpose(0, 1)
        return x.flatten(2)


class FusedImageOp(nn.Module):
    """A per-channel image operator (pooling) applied once to the grouped layout, channels-last.

    CPU max pooling of NCHW is an order of magnitude slower than of channels-last (measured on a
    ``(4, 48, 28, 28)`` input, one thread: 787 µs against 49 µs forward), so an NCHW input (a batched image,
    a single replica's convolution) is converted first (one copy).
    """

    def __init__(self, layer: nn.Module, slots: FlatSlots) -> None:
        super().__init__()
        if getattr(layer, "return_indices", False):
            raise ContractError(f"fused {type(layer).__name__} does not support return_indices=True")
        self.op, self.m = copy.deepcopy(layer), slots.m
        #: Pointwise layers that came just before the operator, run after the conversion (see :meth:`absorb`).
        self.before = nn.Sequential()

    def absorb(self, pointwise: list[nn.Module]) -> None:
        """Run ``pointwise`` (the activations between a convolution and this operator) channels-last too.

        Otherwise the activation's backward meets the pooling's channels-last gradient and its own NCHW
        output: an elementwise kernel over two layouts, measured 198 µs against 19 µs for LeNet's ReLU on
        ``(4, 48, 28, 28)``, one thread. Elementwise layers give the same values in either layout.
        """
        self.before = nn.Sequential(*pointwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The operator on every replica's channels at once."""
        return self.op(self.before(grouped(x, self.m).contiguous(memory_format=torch.channels_last)))


class FusedResidual(nn.Module):
    """:class:`Residual` with both paths fused."""

    def __init__(self, layer: Residual, slots: FlatSlots) -> None:
        super().__init__()
        self.m = slots.m
        self.body = fuse(layer.body, slots)
        self.shortcut = fuse(layer.shortcut, slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the fused paths; a batched image path is first put in the grouped layout of the other."""
        out, skip = self.body(x), self.shortcut(x)
        if out.ndim != skip.ndim:
            out, skip = grouped(out, self.m), grouped(skip, self.m)
        return out + skip


def _sequential(layer: nn.Sequential, slots: FlatSlots) -> nn.Module:
    """The children fused in order; the pointwise layers just before an image operator move into it."""
    fused: list[nn.Module] = []
    for child in layer:
        node = fuse(child, slots)
        if isinstance(node, FusedImageOp):
            start = len(fused)
            while start and type(fused[start - 1]) in _POINTWISE:
                start -= 1
            node.absorb(fused[start:])
            del fused[start:]
        fused.append(node)
    return nn.Sequential(*fused)


def _stateless(layer: nn.Module, slots: FlatSlots) -> nn.Module:
    return copy.deepcopy(layer)


_POINTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Dropout,
    nn.Identity,
)
_IMAGE_OPS: tuple[type[nn.Module], ...] = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
)

#: Exact layer type → how to fuse it.
FUSERS: dict[type[nn.Module], Callable[[nn.Module, FlatSlots], nn.Module]] = {
    nn.Linear: FusedLinear,  # type: ignore[dict-item]
    nn.Conv2d: FusedConv2d,  # type: ignore[dict-item]
    nn.BatchNorm1d: FusedBatchNorm,  # type: ignore[dict-item]
    nn.BatchNorm2d: FusedBatchNorm,  # type: ignore[dict-item]
    nn.Flatten: FusedFlatten,  # type: ignore[dict-item]
    nn.Sequential: _sequential,  # type: ignore[dict-item]
    Residual: FusedResidual,  # type: ignore[dict-item]
    **dict.fromkeys(_POINTWISE, _stateless),
    **dict.fromkeys(_IMAGE_OPS, FusedImageOp),
}


def supported_layers() -> list[str]:
    """Names of the layer types :func:`fuse` accepts, sorted."""
    return sorted(t.__name__ for t in FUSERS)


def fuse(layer: nn.Module, slots: FlatSlots) -> nn.Module:
    """The fused counterpart of replica 0's ``layer`` (every replica's weights come from ``slots``)."""
    fuser = FUSERS.get(type(layer))
    if fuser is None:
        raise ContractError(
            f"the fused engine cannot fuse layer type {type(layer).__name__}; supported layer types: "
            f"{', '.join(supported_layers())} (use engine = serial for this model)"
        )
    return fuser(layer, slots)


class FusedNetwork(nn.Module):
    """The whole fused network: ``(m, N, *sample)`` in, ``(m, N, *output)`` out."""

    def __init__(self, root: nn.Module, slots: FlatSlots) -> None:
        super().__init__()
        self.m = slots.m
        self.body = fuse(root, slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every replica's output on its own batch."""
        return batched(self.body(x), self.m)
