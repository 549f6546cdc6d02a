"""The streams engine: each learner runs forward and backward on its own CUDA stream (Crossbow's design).

With small batches one learner's kernels leave most of a GPU idle; issuing the m learners' kernels on m
streams lets the GPU overlap them. Ordering is kept with events only, never a host synchronisation in the
loop:

* before learner j starts, its stream waits for an event recorded on the current (default) stream, so it
  sees the weights the previous step's optimizer and the rule wrote there;
* after its backward, learner j records an event on its stream, and the current stream waits for all m
  events before the rule reads the gradients (``on_gradients``) and the optimizers step.

Input batches are copied host → device on the learner's own stream (``non_blocking``), and the tensors
allocated there are marked with ``record_stream`` semantics by PyTorch's caching allocator when they are
used on another stream. Only CUDA devices can run this engine; any other device is a ConfigError.

**With CUDA graphs** (``[pool] cuda_graphs``, :mod:`.cuda_graphs`): launching a step's kernels from one
Python thread costs more than small kernels take, so m streams fed one launch at a time barely overlap (the
streams engine measured 0.88–1.07× the serial one on an H100). Captured, learner j's step is one graph
launch, replayed on stream j: the host queues all m in microseconds and the GPU runs them side by side. Each
learner's graph is captured on its own stream (its own cuBLAS workspace, its own memory pool: graphs that
run at the same time must not share either) and its batch is copied into its static inputs on that stream;
the events order it exactly as above.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError
from .base import next_batch
from .serial import SerialPool
from .spec import PoolSpec


class StreamsPool(SerialPool):
    """SerialPool's learners and data, with every learner's forward and backward on its own CUDA stream."""

    def __init__(self, model: Any, spec: PoolSpec) -> None:
        if spec.device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(
                f"[pool] engine = streams needs a CUDA device (DEVICES=cudaN), this rank has {spec.device}; "
                "use engine = serial or fused"
            )
        super().__init__(model, spec)

    def _wire_graphs(self) -> None:
        """One stream and one completion event per learner (again after a resize), then the graphs."""
        if len(getattr(self, "streams", [])) != len(self.learners):
            self.streams = [torch.cuda.Stream(device=self.learners[0].device) for _ in self.learners]
            self.events = [torch.cuda.Event() for _ in self.learners]
        super()._wire_graphs()

    def _learner_stream(self, j: int) -> torch.cuda.Stream | None:
        """Learner j's graph is captured (and replayed) on learner j's stream."""
        return self.streams[j]

    def grad_layout(self) -> list[tuple[int, int]] | None:
        """None: gradients come from m streams whose order a host-side hook cannot see, so BSP keeps its
        one allreduce after the current stream has waited for every learner."""
        return None

    def compute(self, count: int) -> None:
        """Every learner's forward and backward on its own stream (its graph replayed there where the pool
        captures); the current stream waits for all."""
        main = torch.cuda.current_stream(self.learners[0].device)
        ready = torch.cuda.Event()
        ready.record(main)
        for learner, batches, stream, done in zip(
            self.learners, self._iters, self.streams, self.events, strict=True
        ):
            inputs, targets = next_batch(batches, count, self.n_batch_train)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                learner.forward_backward(inputs, targets)
                done.record(stream)
        for done in self.events:
            main.wait_event(done)
