"""Virtual streams, events and the timeline of a simulated device.

A :class:`VStream` is a queue on a virtual clock: ``t`` is when the last op queued on it ends. An op
queued on a stream starts once the stream is free *and* the engine it needs is free: compute ops
share one compute engine (the SMs), comm ops share one link. Engines keep their busy intervals, so
an op that becomes ready early fills an idle gap left by one issued before it (two streams on a
real GPU run whichever kernel is ready). A :class:`VEvent` recorded on a stream captures that
stream's ``t``; a wait makes the stream's next op start no earlier.

Times are seconds from the start of the run. The clock never sleeps and takes no CPU time beyond
the bookkeeping: the CPU runs each op for real and the clock says how long it would take.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Engine", "Span", "Timeline", "VEvent", "VStream"]

_ids = itertools.count(1)


@dataclass(eq=False)
class VStream:
    """A virtual stream. ``t``: when its queued work ends."""

    name: str
    id: int = field(default_factory=lambda: next(_ids))
    t: float = 0.0

    def __repr__(self) -> str:
        return f"<VStream {self.name} t={self.t * 1e6:.1f}us>"


@dataclass(eq=False)
class VEvent:
    """A virtual event. ``t`` and ``clock`` (the race checker's vector clock) are set by record."""

    id: int = field(default_factory=lambda: next(_ids))
    recorded: bool = False
    t: float = 0.0
    clock: dict[int, int] = field(default_factory=dict)
    by: Any = None  # the place that recorded it (a races.Site), for reports
    stream_id: int = 0  # the stream it was recorded on
    # (other ubatch, end of this ubatch's own work) when the record covers the other's later work
    covers_foreign: tuple[int, float] | None = None

    def __repr__(self) -> str:
        return f"<VEvent {self.id} {'recorded t=%.1fus' % (self.t * 1e6) if self.recorded else 'never recorded'}>"


class Engine:
    """A resource that runs one op at a time (the compute engine, a link direction)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._starts: list[float] = []
        self._ends: list[float] = []
        self.busy_s = 0.0

    def reserve(self, ready: float, dur: float) -> float:
        """Book ``dur`` seconds at the earliest idle gap starting no earlier than ``ready``;
        return the start time."""
        if dur <= 0:
            return ready
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(ends, ready)  # first interval ending after `ready`
        t = ready
        while i < len(starts):
            if starts[i] >= t + dur:
                break
            t = max(t, ends[i])
            i += 1
        starts.insert(i, t)
        ends.insert(i, t + dur)
        self.busy_s += dur
        return t


@dataclass(frozen=True)
class Span:
    """One op (or a run of ops) on the timeline."""

    stream: str
    kind: str  # "compute" or "comm"
    name: str
    start: float
    end: float
    ubatch: int | None
    tag: str | None


class Timeline:
    """Spans in issue order; adjacent ops of one ubatch on one stream at one yield point merge, so a
    layer gives a readable handful of spans instead of one per elementwise op."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._last: dict[str, int] = {}

    def add(self, span: Span) -> None:
        j = self._last.get(span.stream)
        if j is not None:
            prev = self.spans[j]
            if (
                prev.kind == span.kind == "compute"
                and prev.ubatch == span.ubatch
                and prev.tag == span.tag
                and abs(prev.end - span.start) < 1e-12
            ):
                self.spans[j] = Span(prev.stream, prev.kind, prev.name, prev.start, span.end, prev.ubatch, prev.tag)
                return
        self._last[span.stream] = len(self.spans)
        self.spans.append(span)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)
