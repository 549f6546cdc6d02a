"""The timeline's recorder: spans and instants from anywhere in a rank, off unless a Timeline turns it on.

Instrumented places (the training step, the data wait, BSP's buckets, the asynchronous rules' messages)
call :func:`span`, :func:`complete` or :func:`instant`. With the recorder off each call is one attribute
test; with it on an event is a tuple appended to a list — the same cost as the counters the loop keeps
anyway. :class:`~mpicrossbow.training.reporting.timeline.Timeline` turns it on for its window of steps and
turns the events into a Chrome trace. Times are ``time.perf_counter()`` seconds of this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

#: Tracks (Chrome-trace thread ids) of a rank, in display order, and their names.
TRACKS = {"step": 0, "data": 1, "buckets": 2, "messages": 3}


class Recorder:
    """Events ``(phase, name, category, track, start, duration, args)``; at most ``limit`` of them."""

    def __init__(self) -> None:
        self.on = False
        self.limit = 0
        self.events: list[tuple[str, str, str, str, float, float, dict[str, Any]]] = []

    def add(self, phase: str, name: str, cat: str, track: str, start: float, dur: float, args: Any) -> None:
        """Keep one event (a span ``X`` or an instant ``i``) while on and under the limit."""
        if self.on and len(self.events) < self.limit:
            self.events.append((phase, name, cat, track, start, dur, args))

    def start(self, limit: int) -> None:
        """Record from now on, at most ``limit`` events (a server's messages are not bounded by steps)."""
        self.on, self.limit = True, limit

    def stop(self) -> None:
        """Stop recording; the events stay until taken."""
        self.on = False

    def take(self) -> list[tuple[str, str, str, str, float, float, dict[str, Any]]]:
        """The events recorded so far, emptied."""
        events, self.events = self.events, []
        return events


RECORDER = Recorder()
_OFF = nullcontext()


@contextmanager
def _span(name: str, cat: str, track: str, args: dict[str, Any]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        RECORDER.add("X", name, cat, track, start, time.perf_counter() - start, args)


def span(name: str, cat: str, track: str = "step", **args: Any) -> AbstractContextManager[None]:
    """A context manager that records the block as a span (nothing when the recorder is off)."""
    return _span(name, cat, track, args) if RECORDER.on else _OFF


def complete(name: str, cat: str, start: float, end: float, track: str = "step", **args: Any) -> None:
    """A span timed by the caller (``perf_counter`` seconds)."""
    if RECORDER.on:
        RECORDER.add("X", name, cat, track, start, end - start, args)


def instant(name: str, cat: str, track: str = "messages", **args: Any) -> None:
    """A moment: a message sent or merged."""
    if RECORDER.on:
        RECORDER.add("i", name, cat, track, time.perf_counter(), 0.0, args)
