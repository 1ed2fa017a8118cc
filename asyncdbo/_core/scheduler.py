"""The DBO loop: a round-robin driver of N ubatch coroutines on one OS thread.

Invariants (each has a test in tests/test_scheduler.py):

1. Exactly one ubatch runs at a time. Runnable ubatches run in strict round-robin order (a ubatch
   that yields goes to the back of the ring), so the same program gives the same interleaving on
   every run.
2. Only :func:`~asyncdbo._core.traps.trap` suspends a ubatch to the scheduler, and every resume
   goes through ``_step``: it installs the ubatch's stream (if it differs from the installed one)
   and runs ``coro.send`` inside the ubatch's own context. Nothing else restores state.
3. A ubatch parked on a foreign awaitable or a :class:`Signal` is skipped until it completes. When
   every live ubatch is parked, the scheduler awaits one asyncio future that the first completion
   resolves: the event loop stays free for other tasks and nothing spins.
4. When every live ubatch is parked on something no one can produce (a signal that only another
   ubatch could set), the run raises :class:`DeadlockError` with each ubatch's await chain.
5. An exception in one ubatch cancels the others at their suspension point and propagates with its
   coroutine traceback and a note naming the ubatch and its last yield.
6. Runs share nothing: two runs in two asyncio tasks never see each other's ubatches.

The fast path of a yield (``SWITCH``) never touches the event loop: it is one ``ctx.run(send)``,
a deque pop and push, and a counter. See benchmarks/switch_cost.py.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from .context import DONE, PARKED, READY, UBatch
from .errors import DeadlockError, NoOverlapWarning, WatchdogTimeout
from .stacks import format_run
from .traps import SWITCH, Signal

__all__ = ["LIVE_RUNS", "DBORun", "Fanout", "Instrument"]

log = logging.getLogger("asyncdbo")

LIVE_RUNS: weakref.WeakSet[DBORun] = weakref.WeakSet()
"""Runs being driven right now, in any task of this process (what ``asyncdbo.dump_stacks`` shows).
Held weakly: a run that is dropped disappears without bookkeeping."""


class Instrument:
    """Hooks a tool can subscribe to. The scheduler calls them only when an instrument is set, so
    an unused instrument costs one ``is not None`` branch per yield."""

    def run_started(self, run: DBORun) -> None:
        """Before the first ubatch step."""

    def resuming(self, ub: UBatch) -> None:
        """Just before ``ub`` is resumed (its stream is already installed)."""

    def stepped(self, ub: UBatch, request: object) -> None:
        """After each step of ``ub``; ``request`` is SWITCH, what it parked on, or None if done."""

    def sleeping(self, run: DBORun) -> None:
        """Every live ubatch is parked; the scheduler is about to await a completion."""

    def woke(self, run: DBORun) -> None:
        """The scheduler resumed after sleeping."""

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        """After the last ubatch finished (or the run failed with ``exc``)."""


class Fanout(Instrument):
    """Several instruments as one (a tracer and the yield checker, say)."""

    def __init__(self, *instruments: Instrument) -> None:
        self.instruments = tuple(instruments)

    def run_started(self, run: DBORun) -> None:
        for i in self.instruments:
            i.run_started(run)

    def resuming(self, ub: UBatch) -> None:
        for i in self.instruments:
            i.resuming(ub)

    def stepped(self, ub: UBatch, request: object) -> None:
        for i in self.instruments:
            i.stepped(ub, request)

    def sleeping(self, run: DBORun) -> None:
        for i in self.instruments:
            i.sleeping(run)

    def woke(self, run: DBORun) -> None:
        for i in self.instruments:
            i.woke(run)

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        for i in self.instruments:
            i.run_finished(run, exc)


class DBORun:
    """One DBO run: N ubatch coroutines driven round-robin until all finish."""

    _ids = itertools.count()

    def __init__(
        self,
        coros: list[Coroutine[Any, Any, Any]],
        *,
        install_stream: Callable[[object], None] | None = None,
        instrument: Instrument | None = None,
        watchdog_s: float | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name or f"dbo-run-{next(self._ids)}"
        self.ubatches = [UBatch(i, self, c) for i, c in enumerate(coros)]
        self.instrument = instrument
        self.watchdog_s = watchdog_s
        self.num_parks = 0
        self.num_switches = 0
        self._num_parked = 0
        self.time_asleep_s = 0.0
        self.backend: Any = None  # the StreamBackend, set by its attach()
        self.data: dict[Any, Any] = {}  # run-scoped scratch for backends and tools
        self._install = install_stream
        self._installed: object = None
        self._ready: deque[UBatch] = deque(self.ubatches)
        self._woken: deque[UBatch] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._sleeping = False
        self._wakeup: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live = len(self.ubatches)

    # ------------------------------------------------------------------ services for backends
    def install_stream(self, stream: object) -> None:
        """Make ``stream`` the device's current stream (called on resume and on role switches)."""
        if stream is not self._installed:
            self._installed = stream
            if self._install is not None:
                self._install(stream)

    def call_at(self, deadline: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the scheduler's thread once ``time.perf_counter() >= deadline``.

        Checked between ubatch steps and while sleeping, so it fires even while other ubatches
        keep the CPU busy (a loop timer would wait until they all park)."""
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), fn))

    def wake(self, ub: UBatch) -> None:
        """Make a parked ubatch runnable. Safe from any thread."""
        self._woken.append(ub)
        if self._sleeping and self._loop is not None:
            self._loop.call_soon_threadsafe(self._poke)

    # ------------------------------------------------------------------ the loop
    async def drive(self) -> list[Any]:
        """Run every ubatch to completion; return their results in ubatch order."""
        self._loop = asyncio.get_running_loop()
        inst = self.instrument
        if inst is not None:
            inst.run_started(self)
        LIVE_RUNS.add(self)
        try:
            await self._loop_until_done()
        except BaseException as exc:
            self._cancel_all(exc)
            if inst is not None:
                inst.run_finished(self, exc)
            raise
        finally:
            LIVE_RUNS.discard(self)
        if inst is not None:
            inst.run_finished(self, None)
        if len(self.ubatches) >= 2 and self.num_switches == 0 and self.num_parks == 0:
            warnings.warn(
                NoOverlapWarning(
                    f"{len(self.ubatches)} ubatches ran without a single yield, so nothing could overlap; "
                    "put `await dbo_yield()` (or a switch primitive) where one ubatch should hand over"
                ),
                stacklevel=3,
            )
        return [ub.result for ub in self.ubatches]

    async def _loop_until_done(self) -> None:
        ready, woken, timers = self._ready, self._woken, self._timers
        inst = self.instrument
        while self._live:
            if timers or woken:
                self._drain()
            if not ready:
                await self._sleep()
                continue
            # ---- fast path. Ubatches that keep switching stay in this loop until one parks or
            # finishes. Completions and timers only matter for parked ubatches, so they are checked
            # only while some ubatch is parked (a wake can only target a parked ubatch). Bound
            # methods are cached on the UBatch; the switch count is a local until the loop exits.
            watch = self._num_parked > 0 or bool(timers)
            streams = self._install is not None  # a host has no device stream to install
            n = 0
            switch, pop, push = SWITCH, ready.popleft, ready.append
            try:
                while ready:
                    ub = pop()
                    if streams and ub.stream is not self._installed:
                        self.install_stream(ub.stream)
                    if inst is not None:
                        inst.resuming(ub)
                    try:
                        request = ub.resume()
                    except BaseException as exc:
                        self._stopped(ub, exc)
                        break
                    if request is switch:
                        n += 1
                        if watch and (woken or timers):
                            self._drain()  # woken during this step: they were runnable first
                        push(ub)
                        if inst is not None:
                            ub.num_yields += 1
                            inst.stepped(ub, request)
                    else:
                        self._park(ub, request)
                        if inst is not None:
                            inst.stepped(ub, request)
                        break
            finally:
                self.num_switches += n

    def _stopped(self, ub: UBatch, exc: BaseException) -> None:
        """``ub`` left its coroutine: finished (StopIteration) or failed (re-raised with a note)."""
        if isinstance(exc, StopIteration):
            self._finish(ub, exc.value)
            return
        ub.state = DONE
        self._live -= 1
        self._annotate(ub, exc)
        raise exc

    def _finish(self, ub: UBatch, result: object) -> None:
        ub.state = DONE
        ub.result = result
        ub.parked_on = None
        self._live -= 1
        hook, ub.recv_hook = ub.recv_hook, None
        if hook is not None:  # vLLM: a ubatch's exit launches its pending recv before handing over
            try:
                ub.ctx.run(hook)
            except BaseException as exc:
                self._annotate(ub, exc, where="in the recv hook it ran at exit")
                raise
        if self.instrument is not None:
            self.instrument.stepped(ub, None)

    def _park(self, ub: UBatch, request: object) -> None:
        hook, ub.recv_hook = ub.recv_hook, None
        if hook is not None:
            # A parked ubatch cannot launch the receive another ubatch left with it until it wakes,
            # and that ubatch may be waiting for exactly this receive: launch it now.
            try:
                ub.ctx_run(hook)
            except BaseException as exc:
                ub.state = DONE
                self._live -= 1
                self._annotate(ub, exc, where="in the recv hook it ran before parking")
                raise
        ub.state = PARKED
        ub.parked_on = request
        self.num_parks += 1
        self._num_parked += 1
        if isinstance(request, Signal):
            request.add_waiter(lambda: self.wake(ub))
        elif request is None:  # a bare `yield` (asyncio.sleep(0)): let the loop run once
            ub.parked_on = "asyncio.sleep(0)"
            self._loop.call_soon(self.wake, ub)  # type: ignore[union-attr]
        elif getattr(request, "_asyncio_future_blocking", None) is not None:
            request._asyncio_future_blocking = False  # type: ignore[attr-defined]
            request.add_done_callback(lambda _f: self.wake(ub))  # type: ignore[attr-defined]
        else:  # not ours, not asyncio's: raise it inside the ubatch, at the await that yielded it
            ub.parked_on = None
            ub.state = READY
            self.num_parks -= 1
            self._num_parked -= 1
            error = TypeError(
                f"ubatch {ub.id} awaited something that yielded {request!r}; asyncdbo can park a ubatch "
                "on asyncdbo primitives and on asyncio awaitables (futures, tasks, asyncio.sleep) only. "
                "Wrap other event loops' objects in an asyncio future first."
            )
            try:
                request = ub.ctx_run(ub.coro.throw, error)
            except BaseException as exc:
                self._stopped(ub, exc)
                return
            if request is SWITCH:
                self.num_switches += 1
                self._ready.append(ub)
            else:
                self._park(ub, request)

    def _drain(self) -> None:
        """Fire due timers, then move woken ubatches to the back of the ready ring."""
        if self._timers:
            self._fire_timers()
        woken = self._woken
        while woken:
            ub = woken.popleft()
            if ub.state == PARKED:
                ub.state = READY
                ub.parked_on = None
                self._num_parked -= 1
                self._ready.append(ub)

    def _fire_timers(self) -> None:
        now = time.perf_counter()
        timers = self._timers
        while timers and timers[0][0] <= now:
            heapq.heappop(timers)[2]()

    def _poke(self) -> None:
        fut = self._wakeup
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _sleep(self) -> None:
        """Every live ubatch is parked: await the first completion (or a timer, or the watchdog)."""
        if not self._timers:
            self._check_deadlock()
        loop = self._loop
        assert loop is not None
        self._wakeup = fut = loop.create_future()
        self._sleeping = True
        handles = []
        if self._woken:  # a completion raced in before _sleeping was visible
            fut.set_result(None)
        if self._timers:
            delay = max(0.0, self._timers[0][0] - time.perf_counter())
            handles.append(loop.call_later(delay, self._poke))
        if self.watchdog_s is not None:
            handles.append(loop.call_later(self.watchdog_s, self._watchdog_fire, fut))
        if self.instrument is not None:
            self.instrument.sleeping(self)
        t0 = time.perf_counter()
        try:
            await fut
        finally:
            self._sleeping = False
            self._wakeup = None
            self.time_asleep_s += time.perf_counter() - t0
            for h in handles:
                h.cancel()
        if self.instrument is not None:
            self.instrument.woke(self)

    def _watchdog_fire(self, fut: asyncio.Future[None]) -> None:
        if not fut.done():
            fut.set_exception(
                WatchdogTimeout(
                    format_run(
                        self.ubatches,
                        f"asyncdbo watchdog: run {self.name!r} made no progress for {self.watchdog_s:g} s "
                        "(every ubatch is parked on an outside event). Ubatch stacks:",
                    )
                )
            )

    def _check_deadlock(self) -> None:
        live = [ub for ub in self.ubatches if ub.state != DONE]
        if live and all(isinstance(ub.parked_on, Signal) and not ub.parked_on.external for ub in live):
            raise DeadlockError(
                format_run(
                    self.ubatches,
                    f"asyncdbo deadlock in run {self.name!r}: every live ubatch waits on something only "
                    "another ubatch could produce, and none can run. Ubatch stacks:",
                )
            )

    # ------------------------------------------------------------------ failure
    def _annotate(self, ub: UBatch, exc: BaseException, where: str = "") -> None:
        if isinstance(exc, asyncio.CancelledError):
            return
        exc.add_note(
            f"asyncdbo: raised in ubatch {ub.id} of {len(self.ubatches)} {where or 'while running'} "
            f"(last yield point {ub.tag!r}); the other ubatches were cancelled"
        )

    def _cancel_all(self, cause: BaseException) -> None:
        """Cancel every live ubatch at its suspension point (like Task.cancel), then close it."""
        for ub in self.ubatches:
            if ub.state == DONE:
                continue
            parked = ub.parked_on
            if ub.state == PARKED:
                self._num_parked -= 1
            ub.state = DONE
            ub.parked_on = None
            self._live -= 1
            if getattr(parked, "_asyncio_future_blocking", None) is not None and not parked.done():
                parked.cancel()
            if inspect.getcoroutinestate(ub.coro) != inspect.CORO_SUSPENDED:
                ub.coro.close()  # never started: closing it also avoids a "never awaited" warning
                continue
            try:
                ub.ctx.run(ub.coro.throw, asyncio.CancelledError(f"asyncdbo: sibling ubatch failed: {cause!r}"))
            except (asyncio.CancelledError, StopIteration):
                pass
            except BaseException as exc:  # noqa: BLE001 - cleanup of an already failing run
                log.debug("ubatch %d raised while being cancelled: %r", ub.id, exc)
            else:
                log.debug("ubatch %d ignored its cancellation; closing it", ub.id)
            ub.coro.close()
