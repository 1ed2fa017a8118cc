"""The only functions that ever yield a ubatch back to the kernel, and what it can wait on.

A ubatch coroutine leaves the CPU in exactly three ways:

* :func:`switch` (what ``await dbo_yield()`` awaits): hand the CPU to the next runnable ubatch.
  The fast path: no event loop, no allocation beyond the generator ``await`` needs;
* :func:`trap` with a :class:`Signal` (``await signal``, or ``await trap(signal)``): park until
  the signal is set (an event another ubatch records, a recv hook that must run first, a comm
  work that must complete); ``trap(SWITCH)`` is a switch with no tag change;
* awaiting a foreign asyncio awaitable (``asyncio.sleep``, a future completed by another thread):
  asyncio's own protocol yields the future through the await chain, and the kernel parks the
  ubatch on it exactly like an asyncio Task would.

Every ``yield`` of asyncdbo that reaches the kernel is in this module; everything else awaits
these. Keeping suspension here keeps the resume side in one place too: the kernel installs the
ubatch's ``resume_with`` and enters its context before every ``send``, nowhere else.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Generator
from typing import Any

from .ubatch import UBatch

__all__ = ["SWITCH", "Signal", "switch", "trap"]


class _Switch:
    __slots__ = ()

    def __repr__(self) -> str:
        return "SWITCH"


SWITCH = _Switch()
"""Request: give the CPU to the next runnable ubatch, come back at the end of the ring."""


@types.coroutine
def trap(request: object) -> Generator[object, Any, Any]:
    """Suspend the running ubatch with ``request``; return what the kernel sends back."""
    return (yield request)


@types.coroutine
def switch(ub: UBatch) -> Generator[Any, Any, None]:
    """Hand the CPU to the next runnable ubatch (``ub``, the running one, comes back at the end of
    the ring). Clears ``ub.unawaited``: the awaitable that led here was awaited.

    The hottest path in asyncdbo (``await dbo_yield()`` ends here): it yields ``SWITCH`` itself
    instead of delegating to :func:`trap`, one generator frame less per switch (measured in
    benchmarks/switch_cost.py)."""
    ub.unawaited = None
    yield SWITCH


class Signal:
    """A one-shot completion a ubatch can park on.

    ``set()`` may be called from any thread (gloo runs work callbacks on its own thread).
    ``arrivals`` > 1 makes it a countdown: it completes after that many ``set()`` calls (used for
    "the real comm finished *and* the modeled link released it").

    ``external`` says whether something outside the run can complete it. When every live ubatch
    is parked on a non-external signal, nothing can ever wake them, and the run reports a deadlock
    instead of waiting forever.
    """

    __slots__ = ("what", "external", "_lock", "_left", "_exc", "_waiters")

    def __init__(self, what: str, *, external: bool = False, arrivals: int = 1) -> None:
        if arrivals < 1:
            raise ValueError(f"Signal arrivals must be >= 1 (got {arrivals})")
        self.what = what
        self.external = external
        self._lock = threading.Lock()
        self._left = arrivals
        self._exc: BaseException | None = None
        self._waiters: list[Callable[[], None]] = []

    def done(self) -> bool:
        return self._left == 0

    def exception(self) -> BaseException | None:
        return self._exc

    def set(self, exc: BaseException | None = None) -> None:
        """Count one arrival; with ``exc`` the signal completes at once, failed."""
        with self._lock:
            if self._left == 0:
                return
            if exc is not None:
                self._exc = exc
                self._left = 0
            else:
                self._left -= 1
            if self._left:
                return
            waiters, self._waiters = self._waiters, []
        for w in waiters:
            w()

    def add_waiter(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once done (at once, in this thread, if it already is)."""
        with self._lock:
            if self._left:
                self._waiters.append(callback)
                return
        callback()

    def remove_waiter(self, callback: Callable[[], None]) -> None:
        """Forget ``callback`` (a waiter that stopped waiting: its ubatch was cancelled)."""
        with self._lock:
            try:
                self._waiters.remove(callback)
            except ValueError:
                pass

    def __await__(self) -> Generator[object, Any, None]:
        if self._left:
            yield from trap(self)
        if self._exc is not None:
            raise self._exc

    def __repr__(self) -> str:
        state = "done" if self._left == 0 else f"pending({self._left})"
        return f"<Signal {self.what!r} {state}{' external' if self.external else ''}>"
