"""``xb.allreduce``: a metric (a number or a tensor) reduced over the ranks, as Horovod's ``hvd.allreduce``.

Scripts average a validation loss or an accuracy over the ranks at the end of an epoch (Horovod's example
calls it ``metric_average``). This is the small, slow-path collective for that: it pickles nothing, copies
the value to a host buffer, runs ``MPI_Allreduce`` on a communicator the embedded API keeps apart from the
rules' own traffic, and hands back a new value of the input's kind (a tensor of the same dtype and device, or
a Python number). It is not the gradient path: the rule exchanges parameters and gradients itself.

Who takes part: while a job runs under a rule that keeps some ranks out of training (parameter servers, the
asynchronous EASGD centre: they serve inside ``xb.distribute``), the ranks that train, which are the ones
running the script's loop; otherwise every rank.

``op``: ``mean`` (the default, as Horovod's), ``sum``, ``max`` or ``min``. Floats are reduced in float64 and
rounded back to their dtype once, integers in int64 (a mean of integers comes back as a float: a Python
float, or a tensor of torch's default float dtype). To average a
per-rank mean weighted by the ranks' sample counts, reduce the sums and the counts with ``op="sum"`` and
divide, as docs/embedded.md shows.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from ..comm.base import Communicator, ReduceOp
from ..errors import UsageError

#: The reductions ``xb.allreduce`` knows.
OPS = ("mean", "sum", "max", "min")

Op = Literal["mean", "sum", "max", "min"]


def allreduce_value(comm: Any, value: Any, op: str) -> Any:
    """``value`` reduced with ``op`` over mpi4py communicator ``comm`` (see the module doc); collective."""
    from mpi4py import MPI

    if op not in OPS:
        raise UsageError(f"xb.allreduce: op={op!r}: choose one of {', '.join(map(repr, OPS))}")
    mpi_op = {"mean": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    if isinstance(value, torch.Tensor):
        host = value.detach().to("cpu", _wide(value.dtype, op)).contiguous()
        out = np.empty_like(host.numpy())
        comm.Allreduce(host.numpy(), out, op=mpi_op)
        result = torch.from_numpy(out)
        if op == "mean":
            result /= comm.Get_size()
        dtype = value.dtype if value.dtype.is_floating_point or op != "mean" else torch.get_default_dtype()
        return result.to(value.device, dtype)
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise UsageError(
            f"xb.allreduce: value must be a Python number or a tensor, got {type(value).__name__}"
        )
    wide = np.float64 if isinstance(value, float | np.floating) or op == "mean" else np.int64
    out = np.empty(1, dtype=wide)
    comm.Allreduce(np.array([value], dtype=wide), out, op=mpi_op)
    if op == "mean":
        return float(out[0]) / comm.Get_size()
    return float(out[0]) if wide is np.float64 else int(out[0])


def _wide(dtype: torch.dtype, op: str) -> torch.dtype:
    """The host dtype a tensor is reduced in: float64 for any float (or a mean), int64 for integers."""
    if dtype.is_floating_point or op == "mean":
        return torch.float64
    if dtype == torch.bool:
        raise UsageError("xb.allreduce: a bool tensor has no sum or mean; convert it to int first")
    return torch.int64


def reduce_over(comm: Communicator, value: Any, op: str) -> Any:
    """:func:`allreduce_value` over the job's own :class:`~mpicrossbow.comm.base.Communicator` (elastic
    training: over the survivors, inside a committed collective); the same results, as the same kinds."""
    if op not in OPS:
        raise UsageError(f"xb.allreduce: op={op!r}: choose one of {', '.join(map(repr, OPS))}")
    reduce_op = ReduceOp.SUM if op in ("mean", "sum") else ReduceOp(op)
    if isinstance(value, torch.Tensor):
        host = value.detach().to("cpu", _wide(value.dtype, op)).clone().contiguous()
        comm.allreduce(host, reduce_op).wait()
        if op == "mean":
            host /= comm.size
        dtype = value.dtype if value.dtype.is_floating_point or op != "mean" else torch.get_default_dtype()
        return host.to(value.device, dtype)
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise UsageError(
            f"xb.allreduce: value must be a Python number or a tensor, got {type(value).__name__}"
        )
    total = comm.allreduce_scalars([float(value)], reduce_op)[0]
    if op == "mean":
        return total / comm.size
    return total if isinstance(value, float | np.floating) else int(total)
