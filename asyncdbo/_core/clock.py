"""The clock a run reads: real monotonic time, or a virtual clock for tests and the simulator.

The kernel reads the time for three things only: due timers (:meth:`DBORun.call_at`), the
watchdog, and how long it slept. Reading it through a :class:`Clock` lets a test run a schedule
with timers and a watchdog in no wall time and with the same result every run (trio's MockClock
idea): a :class:`VirtualClock` stands still while ubatches run and jumps to the next deadline
when every ubatch is parked.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "VirtualClock"]


class Clock(Protocol):
    """Seconds on some monotonic scale. ``now`` may be called from any thread."""

    def now(self) -> float:
        """The current time."""
        ...

    def wait_s(self, deadline: float) -> float:
        """Real seconds the kernel should sleep for this clock to reach ``deadline`` (a virtual
        clock moves itself there and answers 0)."""
        ...


class MonotonicClock:
    """``time.perf_counter``: one clock for every process on a host, so traces of several ranks
    merge without alignment."""

    now = staticmethod(time.perf_counter)

    def wait_s(self, deadline: float) -> float:
        return max(0.0, deadline - time.perf_counter())

    def __repr__(self) -> str:
        return "MonotonicClock()"


class VirtualClock:
    """A clock that only moves when told to, or when the run it drives is idle.

    ``advance(dt)`` moves it by hand. When every ubatch is parked and a timer or the watchdog is
    due later, the kernel asks :meth:`wait_s` and the clock jumps straight to that deadline (so a
    test of a 5 s watchdog takes no time). Something outside the run (a thread, another task)
    that would have completed a parked ubatch in real time is not waited for: use it for
    schedules whose only waits are timers, signals and the watchdog."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> None:
        if not dt >= 0:
            raise ValueError(f"VirtualClock.advance needs dt >= 0 seconds (got {dt!r})")
        with self._lock:
            self._t += dt

    def wait_s(self, deadline: float) -> float:
        with self._lock:
            self._t = max(self._t, deadline)
        return 0.0

    def __repr__(self) -> str:
        return f"VirtualClock(now={self._t:g})"
