"""How each operator runs once for all m replicas on :class:`~mpicrossbow.pool.replicated.Replicated` values.

A replica's tensor of shape ``S`` is held as ``data`` of shape ``(m, *S)``. Handlers by kind:

* **elementwise** (arithmetic, activations, dropout, casts): the operator on ``data``; another replica
  value of lower rank, or a parameter's ``(m, *s)`` rows, gains singleton axes after ``m`` so broadcasting
  lines up as in one replica; dropout draws its own mask per replica (one mask over all of ``data``);
* **dimension arguments** (``flatten``, ``softmax``, ``mean``, ``transpose``, ``cat`` …): a non-negative
  dimension moves up by one; a reduction over everything (no ``dim``) runs once per replica instead;
* **shapes** (``view``, ``reshape``, ``expand``, ``permute``, indexing): ``m`` goes in front;
* **layers with weights**: ``linear`` → one batched matmul; ``conv1d`` → lengthwise, channels last;
  ``conv2d``, ``conv3d`` → one grouped convolution; batch norm,
  group norm → one call over m × C channels with each replica's statistics; layer norm → one call, then
  each replica's affine; embedding → one lookup in the m tables stacked; self-attention
  (``multi_head_attention_forward`` without masks) → batched projections and one
  ``scaled_dot_product_attention``; pooling → on the grouped, channels-last layout.

A handler returns ``NotImplemented`` when its case is not covered (an unusual argument); the operator then
runs once per replica (:meth:`~mpicrossbow.pool.replicated.OperatorDispatcher.per_replica`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from .fused_conv1d import FusedConv1d
from .fused_network import FusedConv2d, batch_norm_rows, batched, batched_linear, grouped
from .replicated import OperatorDispatcher, OperatorHandler, Replicated

T = torch.Tensor


class _Loop(Exception):
    """This case has no fused form: run the operator once per replica."""


def align(ctx: OperatorDispatcher, value: Any, rank: int) -> Any:
    """``value`` as an operand of an operator whose replica values have ``rank`` dimensions."""
    if isinstance(value, Replicated):
        data = value.data
        return data if data.ndim == rank + 1 else data[(slice(None),) + (None,) * (rank + 1 - data.ndim)]
    if not isinstance(value, torch.Tensor):
        return value
    rows = ctx.rows(value)
    if rows is not None:
        if rows.ndim - 1 > rank:
            raise _Loop
        return rows[(slice(None),) + (None,) * (rank - rows.ndim + 1)]
    if ctx.plain(value).ndim > rank:
        raise _Loop
    return value


def out(ctx: OperatorDispatcher, result: Any) -> Any:
    """Wrap every tensor of an operator's result as a Replicated (a named tuple becomes a tuple)."""
    if isinstance(result, torch.Tensor):
        return ctx.wrap(result)
    if isinstance(result, (tuple, list)):
        wrapped = [out(ctx, r) for r in result]
        return wrapped if isinstance(result, list) else tuple(wrapped)
    return result


def _values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments, with one level of lists and tuples opened (``torch.cat``'s tensors)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            found.extend(value)
        else:
            found.append(value)
    return found


def _mapped(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``fn`` applied to every argument, one level into lists and tuples."""

    def one(value: Any) -> Any:
        return type(value)(fn(v) for v in value) if isinstance(value, (list, tuple)) else fn(value)

    return [one(v) for v in args], {key: one(v) for key, v in kwargs.items()}


def replica_rank(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The highest replica rank among the Replicated arguments."""
    return max(v.ndim for v in _values(args, kwargs) if isinstance(v, Replicated))


def aligned(
    ctx: OperatorDispatcher, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]] | None:
    """Every argument as an operand at the highest replica rank among them (:func:`align`); None where one
    cannot be (the operator then runs once per replica)."""
    rank = replica_rank(args, kwargs)
    try:
        return _mapped(lambda v: align(ctx, v, rank), args, kwargs)
    except _Loop:
        return None


def elementwise(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An elementwise operator on the stacked values; an in-place one returns its (same) first operand."""
    first = args[0] if args else None
    plain = not any(isinstance(v, (torch.Tensor, Replicated)) for v in _values(args[1:], kwargs))
    if isinstance(first, Replicated) and plain:
        result = func(first.data, *args[1:], **kwargs)  # one operand, the rest plain values: nothing to align
        return first if result is first.data else out(ctx, result)
    operands = aligned(ctx, args, kwargs)
    if operands is None:
        return NotImplemented
    a, k = operands
    result = func(*a, **k)
    if isinstance(args[0], Replicated) and result is a[0]:
        return args[0]
    return out(ctx, result)


def _shift(value: Any) -> Any:
    """A dimension (or several) of a replica tensor as a dimension of the stacked data."""
    if isinstance(value, (tuple, list)):
        return type(value)(_shift(v) for v in value)
    return value + 1 if isinstance(value, int) and value >= 0 else value


def dims(*specs: tuple[int, str, Any], required: bool = True) -> OperatorHandler:
    """A handler for an operator whose ``specs`` arguments ``(position, name, default)`` are dimensions.

    With ``required``, a dimension left at None (a reduction over everything) runs once per replica.
    """

    def handler(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a, k = list(args), dict(kwargs)
        for position, name, default in specs:
            value = a[position] if position < len(a) else k.get(name, default)
            if value is None:
                if required:
                    return NotImplemented
                continue
            if position < len(a):
                a[position] = _shift(value)
            else:
                k[name] = _shift(value)
        return elementwise(ctx, func, tuple(a), k)

    return handler


def reshaped(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``view`` / ``reshape`` / ``expand``: the replica's shape with ``m`` in front."""
    x, sizes = args[0], args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    if not isinstance(x, Replicated) or kwargs or not all(isinstance(s, int) for s in sizes):
        return NotImplemented
    if func in (T.expand, T.expand_as):
        return ctx.wrap(x.data.expand(x.data.shape[0], *sizes))
    return ctx.wrap(x.data.reshape(x.data.shape[0], *sizes))


def permuted(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``permute``: the replica dimensions, shifted, after ``m``."""
    x, order = args[0], args[1:] or (kwargs.get("dims"),)
    if len(order) == 1 and isinstance(order[0], (tuple, list)):
        order = tuple(order[0])
    if not isinstance(x, Replicated) or not all(isinstance(d, int) for d in order):
        return NotImplemented
    return ctx.wrap(x.data.permute(0, *(d % x.ndim + 1 for d in order)))


def transposed_2d(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t()``: the last two dimensions of a 2-D replica tensor swapped."""
    x = args[0]
    if not isinstance(x, Replicated) or x.ndim > 2:
        return NotImplemented
    return x if x.ndim < 2 else ctx.wrap(x.data.transpose(1, 2))


def indexed(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Basic indexing (ints, slices, None, Ellipsis) with ``m`` kept in front; tensor indices loop."""
    x, index = args
    parts = index if isinstance(index, tuple) else (index,)
    if not isinstance(x, Replicated) or any(isinstance(p, (torch.Tensor, Replicated, list)) for p in parts):
        return NotImplemented
    return ctx.wrap(x.data[(slice(None), *parts)])


def matmul(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A matrix product of replica values or parameters (both at least 2-D): one broadcast matmul."""
    a, b = args[:2]
    if func is T.__rmatmul__:
        a, b = b, a
    ranks = [v.ndim for v in (a, b) if isinstance(v, Replicated)] + [
        r.ndim - 1 for r in (ctx.rows(a), ctx.rows(b)) if r is not None
    ]
    if kwargs or min(ranks) < 2 or any(isinstance(v, torch.Tensor) and v.ndim < 2 for v in (a, b)):
        return NotImplemented
    rank = max(ranks)
    try:
        return ctx.wrap(torch.matmul(align(ctx, a, rank), align(ctx, b, rank)))
    except _Loop:
        return NotImplemented


def arguments(names: str, args: tuple[Any, ...], kwargs: dict[str, Any], defaults: dict[str, Any]) -> Any:
    """The named arguments of a call, positional or keyword, with defaults, as a namespace."""
    values = dict(zip(names.split(), args, strict=False))
    return SimpleNamespace(**{**defaults, **values, **kwargs})


def linear(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.linear`` with a replica's weight: one batched matmul ``(m, rows, in) @ (m, in, out)``."""
    call = arguments("input weight bias", args, kwargs, {"bias": None})
    x, weight, bias = call.input, ctx.rows(call.weight), ctx.rows(call.bias)
    if not isinstance(x, Replicated) or weight is None or (call.bias is not None and bias is None):
        return NotImplemented
    flat = x.data.reshape(x.data.shape[0], -1, x.shape[-1])
    y = batched_linear(flat, weight, bias)
    return ctx.wrap(y.view(*x.data.shape[:-1], y.shape[-1]))


def conv_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The arguments of ``F.conv1d`` / ``conv2d`` / ``conv3d``, with their defaults, as a namespace."""
    defaults = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    return arguments("input weight bias stride padding dilation groups", args, kwargs, defaults)


def conv(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.conv1d`` / ``F.conv2d`` with a replica's kernel, one module per call site
    (:class:`~mpicrossbow.pool.fused_conv1d.FusedConv1d`,
    :class:`~mpicrossbow.pool.fused_network.FusedConv2d`)."""
    call = conv_arguments(args, kwargs)
    x, weight = call.input, ctx.rows(call.weight)
    one_d = func is F.conv1d
    if not isinstance(x, Replicated) or weight is None or x.ndim != (3 if one_d else 4):
        return NotImplemented
    if call.bias is not None and ctx.rows(call.bias) is None:
        return NotImplemented
    key = ("conv", id(call.weight))
    layer = ctx.state.get(key)
    slots = SimpleNamespace(m=ctx.m, param=ctx.rows)
    if layer is None and one_d:
        layer = ctx.state[key] = FusedConv1d(call, slots)
    elif layer is None:

        def pair(v: Any) -> Any:
            return v if isinstance(v, str) else (v, v) if isinstance(v, int) else tuple(v)

        spec = SimpleNamespace(
            weight=call.weight,
            bias=call.bias,
            stride=pair(call.stride),
            padding=pair(call.padding),
            dilation=pair(call.dilation),
            groups=call.groups,
            padding_mode="zeros",
        )
        layer = ctx.state[key] = FusedConv2d(spec, slots)  # type: ignore[arg-type]
    if one_d:
        return ctx.wrap(layer(x.data))
    return ctx.wrap(batched(layer(x.data), ctx.m))


def conv3d(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.conv3d`` with a replica's kernel: one grouped convolution over m × C channels."""
    call = conv_arguments(args, kwargs)
    x, weight, bias = call.input, ctx.rows(call.weight), ctx.rows(call.bias)
    if not isinstance(x, Replicated) or weight is None or x.ndim != 5:
        return NotImplemented
    if call.bias is not None and bias is None:
        return NotImplemented
    m = ctx.m
    flat_bias = bias.reshape(-1) if bias is not None else None
    y = F.conv3d(
        _channels_together(x.data),
        weight.reshape(-1, *weight.shape[2:]),
        flat_bias,
        call.stride,
        call.padding,
        call.dilation,
        call.groups * m,
    )
    return ctx.wrap(_channels_apart(y, m))


def _channels_together(data: torch.Tensor) -> torch.Tensor:
    """``(m, N, C, *S)`` as ``(N, m·C, *S)`` (replica j's channels j·C …): one layout for norms over C."""
    if data.ndim == 5:
        return grouped(data, data.shape[0])
    m, n = data.shape[:2]
    return data.transpose(0, 1).reshape(n, m * data.shape[2], *data.shape[3:])


def _channels_apart(y: torch.Tensor, m: int) -> torch.Tensor:
    """The inverse of :func:`_channels_together`."""
    if y.ndim == 4:
        return batched(y, m)
    n = y.shape[0]
    return y.view(n, m, y.shape[1] // m, *y.shape[2:]).transpose(0, 1)


def batch_norm(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.batch_norm``: one call over m × C channels, each replica's own statistics and running stats."""
    call = arguments(
        "input running_mean running_var weight bias training momentum eps",
        args,
        kwargs,
        {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
    )
    x = call.input
    tensors = (call.running_mean, call.running_var, call.weight, call.bias)
    rows = [ctx.rows(t) for t in tensors]
    if (
        not isinstance(x, Replicated)
        or x.ndim < 2
        or any(t is not None and r is None for t, r in zip(tensors, rows, strict=True))
    ):
        return NotImplemented
    y = batch_norm_rows(_channels_together(x.data), *rows, call.training, call.momentum, call.eps)
    return ctx.wrap(_channels_apart(y, ctx.m))


def group_norm(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.group_norm``: one call with m × groups groups over m × C channels."""
    call = arguments(
        "input num_groups weight bias eps", args, kwargs, {"weight": None, "bias": None, "eps": 1e-5}
    )
    x, weight, bias = call.input, ctx.rows(call.weight), ctx.rows(call.bias)
    if not isinstance(x, Replicated) or x.ndim < 2 or (call.weight is not None and weight is None):
        return NotImplemented
    if call.bias is not None and bias is None:
        return NotImplemented
    flat_w, flat_b = (t.reshape(-1) if t is not None else None for t in (weight, bias))
    y = F.group_norm(_channels_together(x.data), ctx.m * call.num_groups, flat_w, flat_b, call.eps)
    return ctx.wrap(_channels_apart(y, ctx.m))


def layer_norm(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.layer_norm``: one normalisation of every replica's values, then each replica's affine."""
    call = arguments(
        "input normalized_shape weight bias eps", args, kwargs, {"weight": None, "bias": None, "eps": 1e-5}
    )
    x = call.input
    if not isinstance(x, Replicated):
        return NotImplemented
    try:
        weight = align(ctx, call.weight, x.ndim) if call.weight is not None else None
        bias = align(ctx, call.bias, x.ndim) if call.bias is not None else None
    except _Loop:
        return NotImplemented
    y = F.layer_norm(x.data, call.normalized_shape, None, None, call.eps)
    if weight is not None and bias is not None:
        return ctx.wrap(torch.addcmul(bias, y, weight))  # one pass for the affine
    if weight is not None:
        y = y * weight
    return ctx.wrap(y + bias if bias is not None else y)


def embedding(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.embedding``: replica j's indices looked up in its own table, ``table[j, index]``, for every replica
    in one indexing of the ``(m, rows, dim)`` rows (no copy of the tables: measured 30 against 46 µs forward
    and backward for 8 tables of 32 × 16 and 48 indices each, one thread, against offset indices into the
    tables copied to one ``(m·rows, dim)`` table)."""
    call = arguments(
        "input weight padding_idx max_norm norm_type scale_grad_by_freq sparse",
        args,
        kwargs,
        {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False, "sparse": False},
    )
    x, table = call.input, ctx.rows(call.weight)
    if not isinstance(x, Replicated) or table is None or call.padding_idx is not None or call.max_norm:
        return NotImplemented
    if call.sparse or call.scale_grad_by_freq:
        return NotImplemented
    key = ("embedding replicas", x.device, x.ndim)
    replicas = ctx.state.get(key)
    if replicas is None:
        replicas = ctx.state[key] = torch.arange(ctx.m, device=x.device).view(ctx.m, *(1,) * x.ndim)
    # A negative index is out of range for F.embedding; indexing would count it from the end instead.
    index = torch.where(x.data < 0, table.shape[1], x.data)
    return ctx.wrap(table[replicas, index])


def attention(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.scaled_dot_product_attention`` over the stacked values (it takes any leading dimensions)."""
    operands = aligned(ctx, args, kwargs)
    if operands is None:
        return NotImplemented
    a, k = operands
    q = a[0]
    merge = len(a) == 3 and k.get("attn_mask") is None and q.ndim >= 4
    if merge and all(t.shape[:2] == q.shape[:2] for t in a):
        # m and the first batch dimension merged: CPU attention kernels take 4-D inputs fastest.
        y = func(*(t.reshape(-1, *t.shape[2:]) for t in a), **k)
        return ctx.wrap(y.view(*q.shape[:2], *y.shape[1:]))
    return ctx.wrap(func(*a, **k))


_MHA = (
    "query key value embed_dim_to_check num_heads in_proj_weight in_proj_bias bias_k bias_v add_zero_attn "
    "dropout_p out_proj_weight out_proj_bias training key_padding_mask need_weights attn_mask "
    "use_separate_proj_weight q_proj_weight k_proj_weight v_proj_weight static_k static_v "
    "average_attn_weights is_causal"
)


def multi_head_attention(
    ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Self-attention of ``nn.MultiheadAttention`` (no masks, no attention weights returned): batched input
    and output projections around one ``scaled_dot_product_attention`` for every replica and head."""
    c = arguments(
        _MHA,
        args,
        kwargs,
        {
            "training": True,
            "key_padding_mask": None,
            "need_weights": True,
            "attn_mask": None,
            "use_separate_proj_weight": False,
            "static_k": None,
            "static_v": None,
            "is_causal": False,
        },
    )
    x = c.query
    w_in, b_in = ctx.rows(c.in_proj_weight), ctx.rows(c.in_proj_bias)
    w_out, b_out = ctx.rows(c.out_proj_weight), ctx.rows(c.out_proj_bias)
    plain = c.bias_k is None and c.bias_v is None and not c.add_zero_attn and not c.use_separate_proj_weight
    no_masks = c.key_padding_mask is None and c.attn_mask is None and not c.is_causal and not c.need_weights
    if not (isinstance(x, Replicated) and x is c.key is c.value and x.ndim == 3 and plain and no_masks):
        return NotImplemented
    if w_in is None or w_out is None or (c.in_proj_bias is not None and b_in is None):
        return NotImplemented
    if c.out_proj_bias is not None and b_out is None:
        return NotImplemented
    m, (length, n, embed) = ctx.m, x.shape
    heads = c.num_heads
    # Rows in (sample, position) order: a batch-first module hands the (length, N) view of an (N, length)
    # tensor, read here without a copy; the output goes back the same way, so it leaves contiguous.
    qkv = batched_linear(x.data.transpose(1, 2).reshape(m, n * length, embed), w_in, b_in)
    # (3, m·N, heads, length, head size): CPU attention kernels take 4-D inputs fastest (5-D: ~3× slower).
    qkv = qkv.view(m, n, length, 3, heads, embed // heads).permute(3, 0, 1, 4, 2, 5)
    q, k, v = qkv.reshape(3, m * n, heads, length, embed // heads).unbind(0)
    o = F.scaled_dot_product_attention(q, k, v, dropout_p=c.dropout_p if c.training else 0.0)
    o = o.transpose(1, 2).reshape(m, n * length, embed)
    y = batched_linear(o, w_out, b_out).view(m, n, length, embed).transpose(1, 2)
    return ctx.wrap(y), None


def image_pool(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """2-D pooling on the grouped, channels-last layout (one call for every replica's channels)."""
    x = args[0]
    at = {F.max_pool2d: 6, F.adaptive_max_pool2d: 2}.get(func)
    indices = kwargs.get("return_indices") or (at is not None and len(args) > at and args[at])
    if not isinstance(x, Replicated) or x.ndim != 4 or indices:
        return NotImplemented
    if any(isinstance(v, torch.Tensor) for v in args[1:]):
        return NotImplemented
    data = grouped(x.data, ctx.m).contiguous(memory_format=torch.channels_last)
    return ctx.wrap(batched(func(data, *args[1:], **kwargs), ctx.m))


def sample_op(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An operator that treats samples independently (1-D pooling): the replicas folded into the batch."""
    x = args[0]
    if not isinstance(x, Replicated) or x.ndim < 2 or kwargs.get("return_indices"):
        return NotImplemented
    if any(isinstance(v, (torch.Tensor, Replicated)) for v in args[1:]):
        return NotImplemented
    m, n = x.data.shape[:2]
    y = func(x.data.reshape(m * n, *x.shape[1:]), *args[1:], **kwargs)
    return ctx.wrap(y.view(m, n, *y.shape[1:]))


_ELEMENTWISE = [
    *(
        getattr(T, name)
        for name in (
            "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __neg__ __pow__ "
            "__rpow__ __floordiv__ __mod__ __lt__ __le__ __gt__ __ge__ __eq__ __ne__ __and__ __or__ "
            "__invert__ __abs__ add sub mul div true_divide pow neg abs exp log sqrt rsqrt sigmoid tanh "
            "relu clamp masked_fill float double half bfloat16 to type_as contiguous clone detach add_ "
            "sub_ mul_ div_ relu_ clamp_ sigmoid_ tanh_ masked_fill_ square erf sin cos"
        ).split()
    ),
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.true_divide,
    torch.pow,
    torch.neg,
    torch.abs,
    torch.exp,
    torch.log,
    torch.sqrt,
    torch.rsqrt,
    torch.sigmoid,
    torch.tanh,
    torch.relu,
    torch.clamp,
    torch.where,
    torch.maximum,
    torch.minimum,
    torch.erf,
    torch.square,
    torch.sin,
    torch.cos,
    F.relu,
    F.relu6,
    F.elu,
    F.selu,
    F.celu,
    F.leaky_relu,
    F.gelu,
    F.silu,
    F.mish,
    F.hardtanh,
    F.hardswish,
    F.hardsigmoid,
    F.sigmoid,
    F.tanh,
    F.softplus,
    F.softsign,
    F.logsigmoid,
    F.threshold,
    F.dropout,
    F.alpha_dropout,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.empty_like,
    torch.rand_like,
    torch.randn_like,
]


def padded(ctx: OperatorDispatcher, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.pad`` with constant padding: it pads the last dimensions, the same in the stacked values."""
    call = arguments("input pad mode value", args, kwargs, {"mode": "constant", "value": None})
    x = call.input
    if not isinstance(x, Replicated) or call.mode != "constant" or len(call.pad) > 2 * x.ndim:
        return NotImplemented
    return ctx.wrap(F.pad(x.data, call.pad, "constant", call.value))


#: Operator → its handler for every replica at once; anything else runs once per replica.
OPERATOR_HANDLERS: dict[Any, OperatorHandler] = {
    **dict.fromkeys(_ELEMENTWISE, elementwise),
    **dict.fromkeys((torch.flatten, T.flatten), dims((1, "start_dim", 0), (2, "end_dim", -1))),
    **dict.fromkeys((torch.unflatten, T.unflatten), dims((1, "dim", None))),
    **dict.fromkeys(
        (
            F.softmax,
            F.log_softmax,
            torch.softmax,
            torch.log_softmax,
            T.softmax,
            T.log_softmax,
            torch.cumsum,
            T.cumsum,
            T.unsqueeze,
            torch.unsqueeze,
            T.squeeze,
            torch.squeeze,
            T.select,
            torch.select,
            T.narrow,
            torch.narrow,
        ),
        dims((1, "dim", None)),
    ),
    **dict.fromkeys(
        (
            T.sum,
            T.mean,
            T.amax,
            T.amin,
            T.std,
            T.var,
            T.logsumexp,
            torch.sum,
            torch.mean,
            torch.amax,
            torch.amin,
            torch.logsumexp,
            T.argmax,
            T.argmin,
            torch.argmax,
            torch.argmin,
        ),
        dims((1, "dim", None)),
    ),
    **dict.fromkeys(
        (T.transpose, torch.transpose, T.swapaxes, torch.swapaxes), dims((1, "dim0", None), (2, "dim1", None))
    ),
    **dict.fromkeys((T.movedim, torch.movedim), dims((1, "source", None), (2, "destination", None))),
    **dict.fromkeys((T.chunk, torch.chunk, T.split, torch.split), dims((2, "dim", 0))),
    **dict.fromkeys((torch.cat, torch.concat, torch.stack), dims((1, "dim", 0))),
    F.normalize: dims((2, "dim", 1)),
    F.pad: padded,
    **dict.fromkeys((T.view, T.reshape, torch.reshape, T.expand), reshaped),
    **dict.fromkeys((T.permute, torch.permute), permuted),
    T.t: transposed_2d,
    T.__getitem__: indexed,
    **dict.fromkeys((T.__matmul__, T.__rmatmul__, torch.matmul, T.matmul, torch.bmm, T.bmm), matmul),
    F.linear: linear,
    F.conv1d: conv,
    F.conv2d: conv,
    F.conv3d: conv3d,
    F.batch_norm: batch_norm,
    F.group_norm: group_norm,
    F.layer_norm: layer_norm,
    F.embedding: embedding,
    F.scaled_dot_product_attention: attention,
    F.multi_head_attention_forward: multi_head_attention,
    **dict.fromkeys((F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d), image_pool),
    **dict.fromkeys((F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d, F.adaptive_max_pool1d), sample_op),
}
