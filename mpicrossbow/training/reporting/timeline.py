"""``[session] timeline = STEPS``: a Chrome trace of every rank's steps, written to ``<run>/timeline.json``.

The first step is warm-up (allocations, first-touch page faults); the recorder (:mod:`mpicrossbow.trace`)
runs for the next STEPS steps of each training rank, and on a serving rank (a parameter server) from the
start for as many events as the workers' window can cause. What it shows, one process per rank and one
track each for the step, the data wait, BSP's buckets and the messages of asynchronous rules: spans for
forward+backward, the rule's ``on_gradients`` and ``exchange`` (category ``exchange``), the optimizer step,
validation and checkpoints, each bucket's allreduce from start to completion, and instants for gossip,
pushes and replies.

Clocks: every rank takes its zero right after one barrier at the start, so the ranks' times line up to the
barrier's exit skew (microseconds within a node). After the run (collective, also for asynchronous rules:
after ``finish``) rank 0 gathers the events and writes the file, and logs the exchange seconds the loop
itself measured over the window on rank 0, which the trace's exchange spans sum to.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ...launch.world import World
from ...trace import RECORDER, TRACKS

log = logging.getLogger(__name__)

#: Steps before the window: warm-up.
WARM_UP = 1
#: Events a rank keeps at most per step of the window (a step has a handful; buckets and messages add).
EVENTS_PER_STEP = 200


class Timeline:
    """This rank's part of the timeline (see the module doc); ``steps`` is the window's length."""

    def __init__(self, world: World, steps: int, path: Path) -> None:
        self.world, self.steps, self.path = world, steps, path
        #: Exchange seconds of the window's steps, as the loop measures them for its own figures.
        self.exchange_s = 0.0
        if world.mpi is not None:
            world.mpi.Barrier()
        self.zero = time.perf_counter()

    @property
    def recording(self) -> bool:
        """Whether the recorder is on (a step of the window is running)."""
        return RECORDER.on

    def before_step(self, step: int) -> None:
        """A training rank is about to take ``step`` (from 0 over the run): open or close the window."""
        if step == WARM_UP:
            RECORDER.start(self.steps * EVENTS_PER_STEP)
        elif step == WARM_UP + self.steps:
            RECORDER.stop()

    def serving(self) -> None:
        """A serving rank records its messages from the start (bounded like the workers' window)."""
        RECORDER.start(self.steps * EVENTS_PER_STEP * max(1, self.world.size - 1))

    def finish(self, world: World) -> None:
        """Collective over ``world``, the run's live one: gather every rank's events; rank 0 writes the Chrome
        trace and says what it holds. Not the world this timeline started in: after an elastic loss that one
        holds a dead rank, and its gather fails on every survivor after training."""
        RECORDER.stop()
        mine = [
            {
                "ph": phase,
                "name": name,
                "cat": cat,
                "tid": TRACKS[track],
                "ts": (start - self.zero) * 1e6,
                **({"dur": dur * 1e6} if phase == "X" else {"s": "t"}),
                "args": args,
            }
            for phase, name, cat, track, start, dur, args in RECORDER.take()
        ]
        everyone = world.allgather(mine)
        if world.rank != 0:
            return
        events: list[dict[str, Any]] = []
        for rank, theirs in enumerate(everyone):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            for track, tid in TRACKS.items():
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}}
                )
            events += [{**event, "pid": rank} for event in theirs]
        self.path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")
        log.info(
            "timeline of steps %d-%d on %d rank(s): %s (%d events); exchange %.4f s in those steps on rank 0",
            WARM_UP,
            WARM_UP + self.steps - 1,
            world.size,
            self.path,
            sum(len(t) for t in everyone),
            self.exchange_s,
        )
