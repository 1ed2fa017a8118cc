"""The kernel: a round-robin driver of N ubatch coroutines on one OS thread.

It knows coroutines, signals, asyncio futures, timers and a clock; nothing about streams, events,
comm or models (curio's rule: new features go outside the kernel). The layer above talks to it
through three narrow seams: ``UBatch.resume_with`` plus an ``install`` callable (what to make
current before a resume: a device stream), ``before_park``/``at_exit`` callables (where vLLM's
recv hooks run), and the opaque ``ext`` slots on the run and each ubatch.

Invariants (each has a test in tests/core/):

1. Exactly one ubatch runs at a time. Runnable ubatches run in strict round-robin order (a ubatch
   that yields goes to the back of the ring), so the same program gives the same interleaving on
   every run.
2. Only the functions in :mod:`asyncdbo._core.traps` (and asyncio futures, by asyncio's own
   protocol) suspend a ubatch to the kernel, and every resume goes through the loop below: it
   installs the ubatch's ``resume_with`` (if it differs from the installed one) and runs
   ``coro.send`` inside the ubatch's own context. Nothing else restores state.
3. A ubatch parked on a foreign awaitable or a :class:`Signal` is skipped until it completes. When
   every live ubatch is parked, the scheduler awaits one asyncio future that the first completion
   resolves: the event loop stays free for other tasks and nothing spins.
4. When every live ubatch is parked on something no one can produce (a signal that only another
   ubatch could set), the run raises :class:`DeadlockError` with each ubatch's await chain.
5. An exception in one ubatch cancels the others at their suspension point (in their own context,
   with their stream installed, a bounded number of times: :mod:`asyncdbo._core.cancel`) and
   propagates with its coroutine traceback and a note naming the ubatch and its last yield.
6. Runs share nothing: two runs in two asyncio tasks never see each other's ubatches.
7. Inside a ubatch asyncio behaves as in a task of its own (:mod:`asyncdbo._core.tasks`): a ubatch
   parked on the event loop (a sleep, a future, an executor) wakes within about ``loop_poll_s``
   even while others keep switching, since the kernel then lets the loop run every
   ``loop_poll_s``; ``asyncio.timeout`` cancels that ubatch only; a task created from a ubatch is
   not part of the run.
8. A finished run frees itself: it drops every ubatch's coroutine, context and state, so results
   and device memory go as soon as the caller drops them, with no cycle collection.

The fast path of a yield (``SWITCH``) never touches the event loop: it is one ``ctx.run(send)``,
a deque pop and push, and a counter. Where the optional C extension was built
(``asyncdbo/_core/_spin.c``) that loop runs in C while no instrument or event-loop wait is
involved, and hands everything else back to the Python loop below, which stays the reference
(``ASYNCDBO_PURE_PYTHON=1`` runs it alone). See benchmarks/switch_cost.py.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import sys
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

from .cancel import cancel_all, cancel_now, throw_at_next_resume
from .clock import Clock, MonotonicClock
from .errors import DeadlockError, NoOverlapWarning, WatchdogTimeout
from .extensions import load_extension
from .instrument import Instrument
from .stacks import format_run
from .tasks import (
    UBatchTaskView,
    attach_task_factory,
    detach_task_factory,
    enter_view,
    leave_view,
)
from .traps import SWITCH, Signal
from .ubatch import UBatch, UBatchState

__all__ = ["LIVE_RUNS", "LOOP_POLL_S", "DBORun"]

READY, PARKED, DONE = UBatchState.READY, UBatchState.PARKED, UBatchState.DONE


def _load_spin() -> ModuleType | None:
    """The C fast loop (``asyncdbo/_core/_spin.c``), or None where it was not built (no compiler at
    install time) or ``ASYNCDBO_PURE_PYTHON=1`` is set: the Python loop below then does it all."""
    spin = load_extension("asyncdbo._core._spin")
    if spin is not None:
        spin.configure(UBatch)
    return spin


_spin = _load_spin()
_SWITCHED, _PARKED, _FINISHED, _FAILED = 0, 1, 2, 3  # what _spin.spin reports (its enum)
_MONOTONIC = MonotonicClock()
_now = time.perf_counter

#: Default for how often the kernel lets the event loop run while a ubatch waits on it and others
#: keep switching (seconds of real time).
LOOP_POLL_S = 0.001

#: How long a poll hands the GIL away once a ubatch has waited on the loop for longer than the
#: interpreter's switch interval. A thread that needs the GIL (an executor job) is only granted it
#: by force when its holder kept it for a whole switch interval (5 ms): the loop's own poll releases
#: and retakes it every ``loop_poll_s``, which restarts that wait, so a job behind a ubatch that
#: keeps switching was starved for up to seconds. Measured on the default asyncio loop, one
#: ubatch awaiting an executor job that sleeps 1 ms while the other keeps switching, 6 runs each:
#: the job ended 2 ms to 2.2 s after it started (median 0.8 s) without this sleep, 5.5-5.7 ms with it.
#: The sleep itself took 170-210 us (p10-p90 of 300, median 189 us: the OS's timer slack), so while
#: such a wait lasts the switching ubatches lose about 16% of the CPU (189 us of every ~1.2 ms).
GIL_HANDOFF_S = 0.0001

log = logging.getLogger("asyncdbo")

LIVE_RUNS: weakref.WeakSet[DBORun] = weakref.WeakSet()
"""Runs being driven right now, in any task of this process (what ``asyncdbo.dump_stacks`` shows).
Held weakly: a run that is dropped disappears without bookkeeping."""


class _LoopTurn:
    """What a ubatch that yielded bare (``asyncio.sleep(0)``) is parked on: one turn of the loop."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "asyncio.sleep(0)"


def _is_future(obj: object) -> bool:
    return getattr(obj, "_asyncio_future_blocking", None) is not None


class DBORun:
    """One DBO run: N ubatch coroutines driven round-robin until all finish."""

    _ids = itertools.count()

    def __init__(
        self,
        coros: list[Coroutine[Any, Any, Any]],
        *,
        install: Callable[[object], None] | None = None,
        before_park: Callable[[UBatch], None] | None = None,
        at_exit: Callable[[UBatch], None] | None = None,
        instrument: Instrument | None = None,
        watchdog_s: float | None = None,
        clock: Clock | None = None,
        loop_poll_s: float = LOOP_POLL_S,
        name: str | None = None,
    ) -> None:
        """``install(obj)`` makes a ubatch's ``resume_with`` current before it resumes (None: the
        layer above has nothing to install). ``before_park(ub)`` runs when ``ub`` is about to park,
        ``at_exit(ub)`` when it returned; either may raise, which fails that ubatch."""
        self.name = name or f"dbo-run-{next(self._ids)}"
        self.ubatches = [UBatch(i, self, c) for i, c in enumerate(coros)]
        self.instrument = instrument
        self.watchdog_s = watchdog_s
        self.clock: Clock = _MONOTONIC if clock is None else clock
        self.loop_poll_s = loop_poll_s
        self.num_parks = 0
        self.num_switches = 0
        self._num_parked = 0
        self._loop_waits = 0  # ubatches parked on the event loop (futures, sleeps, bare yields)
        self._poll_at = 0.0
        self._poll_due = False
        self._loop_wait_since = 0.0
        self.time_asleep_s = 0.0
        self.ext: Any = None  # the layer above's per-run state; the kernel never reads it
        self._install = install
        self.installs = install is not None  # whether install() has anything to do (a host: no)
        self._before_park = before_park
        self._at_exit = at_exit
        self._installed: object = None
        self._ready: deque[UBatch] = deque(self.ubatches)
        self._woken: deque[tuple[UBatch, object]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._sleeping = False
        self._wakeup: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._view: UBatchTaskView | None = None
        self._live = len(self.ubatches)

    # ------------------------------------------------------------------ services for the layer above
    def install(self, obj: object) -> None:
        """Make ``obj`` current now (a role switch inside a step), as a resume would."""
        if obj is not self._installed:
            self._installed = obj
            if self._install is not None:
                self._install(obj)

    def call_at(self, deadline: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the kernel's thread once ``self.clock.now() >= deadline``.

        Checked between ubatch steps and while sleeping, so it fires even while other ubatches
        keep the CPU busy (a loop timer would wait until they all park)."""
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), fn))

    def wake(self, ub: UBatch, token: object) -> None:
        """Make ``ub`` runnable if it is still parked on ``token`` (a stale wake, from something it
        stopped waiting for, is ignored). Safe from any thread."""
        self._woken.append((ub, token))
        if self._sleeping and self._loop is not None:
            self._loop.call_soon_threadsafe(self._poke)

    def cancel_ubatch(self, ub: UBatch, msg: Any = None) -> bool:
        """Cancel one ubatch the way ``Task.cancel`` cancels a task: ``CancelledError`` is raised at
        its suspension point when it next runs (at once if it waits on an asyncio future). The run
        goes on; what happens next is the ubatch's business (``asyncio.timeout`` turns it into
        ``TimeoutError``). False if it already finished."""
        if ub.state is DONE:
            return False
        ub.cancels += 1
        parked = ub.parked_on
        if ub.state is PARKED and _is_future(parked) and not parked.done():
            parked.cancel(msg)  # its done callback wakes the ubatch; its await raises CancelledError
            return True
        throw_at_next_resume(ub, asyncio.CancelledError() if msg is None else asyncio.CancelledError(msg))
        if ub.state is PARKED:
            self.wake(ub, parked)
        return True

    # ------------------------------------------------------------------ the loop
    async def drive(self) -> list[Any]:
        """Run every ubatch to completion; return their results in ubatch order."""
        loop = self._loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task()
        if task is not None:
            self._view = UBatchTaskView(self, task)
        inst = self.instrument
        if inst is not None:
            inst.run_started(self)
        LIVE_RUNS.add(self)
        attach_task_factory(loop)
        try:
            try:
                await self._loop_until_done()
            except BaseException as exc:
                self._enter_view()
                try:
                    for note in cancel_all(self, exc):
                        exc.add_note(note)
                finally:
                    self._leave_view()
                if inst is not None:
                    inst.run_finished(self, exc)
                raise
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
            results = [ub.result for ub in self.ubatches]
        finally:
            LIVE_RUNS.discard(self)
            detach_task_factory(loop)
            self._release()
        return results

    def _enter_view(self) -> None:
        if self._view is not None:
            enter_view(self._loop, self._task, self._view)  # type: ignore[arg-type]

    def _leave_view(self) -> None:
        if self._view is not None:
            leave_view(self._loop, self._task, self._view)  # type: ignore[arg-type]

    async def _loop_until_done(self) -> None:
        ready, woken, timers = self._ready, self._woken, self._timers
        inst = self.instrument
        while self._live:
            if timers or woken:
                self._drain()
            if not ready:
                await self._sleep()
                continue
            if self._poll_due:  # a ubatch waits on the event loop: let it run once
                self._poll_due = False
                if self._loop_waits and _now() - self._loop_wait_since > sys.getswitchinterval():
                    time.sleep(GIL_HANDOFF_S)  # blocking on purpose: see GIL_HANDOFF_S
                self._poll_at = _now() + self.loop_poll_s  # loop_poll_s of switching between polls
                await asyncio.sleep(0)
                continue
            # ---- fast path. Ubatches that keep switching stay in this loop until one parks or
            # finishes. Completions and loop polls only matter for parked ubatches, so they are
            # checked only while some ubatch is parked (a wake can only target a parked one). Timers
            # added during the loop (a modeled link's releases) fire at the next switch once due:
            # the message is then complete before its ubatch awaits it, which does not park.
            # Bound methods are cached on the UBatch; the switch count is a local until the loop exits.
            watch = self._num_parked > 0 or bool(timers)
            installs = self.installs
            n = 0
            switch, pop, push = SWITCH, ready.popleft, ready.append
            self._enter_view()
            try:
                if _spin is not None and inst is None and not self._loop_waits:
                    # The same loop in C (asyncdbo/_core/_spin.c); it hands back what it can't decide.
                    spin_args = (pop, push, woken if watch else None, timers, switch, self.install if installs else None)
                    while ready:
                        k, ub, status, value = _spin.spin(*spin_args)
                        n += k
                        if status == _SWITCHED:  # switched, with timers or wake-ups pending
                            if watch:
                                self._drain()  # woken during this step: they were runnable first
                            else:
                                self._fire_timers()
                            push(ub)
                        elif status == _PARKED:
                            self._park(ub, value)
                            break
                        elif status == _FINISHED:
                            self._finish(ub, value)
                            break
                        elif status == _FAILED:
                            self._failed(ub, value)
                            raise value
                    continue
                while ready:
                    ub = pop()
                    if installs and ub.resume_with is not self._installed:
                        self.install(ub.resume_with)
                    if inst is not None:
                        inst.resuming(ub)
                    try:
                        request = ub.resume()
                    except StopIteration as stop:
                        self._finish(ub, stop.value)
                        break
                    except BaseException as exc:
                        self._failed(ub, exc)
                        raise
                    if request is switch:
                        n += 1
                        if inst is not None:
                            ub.num_yields += 1
                            inst.stepped(ub, request)
                        if watch:
                            if woken or timers:
                                self._drain()  # woken during this step: they were runnable first
                            push(ub)
                            if self._loop_waits and not n & 63 and _now() >= self._poll_at:
                                self._poll_due = True
                                break
                        else:
                            if timers:  # set during this loop (a modeled link's release): due ones
                                self._fire_timers()  # complete now, so nobody parks on them later
                            push(ub)
                    else:
                        self._park(ub, request)
                        if inst is not None:
                            inst.stepped(ub, request)
                        break
            finally:
                self.num_switches += n
                self._leave_view()

    def _failed(self, ub: UBatch, exc: BaseException) -> None:
        """``ub`` raised: it is done, and its error gets a note (the caller re-raises it)."""
        ub.state = DONE
        self._live -= 1
        self._annotate(ub, exc)

    def _finish(self, ub: UBatch, result: object) -> None:
        ub.state = DONE
        ub.result = result
        ub.parked_on = None
        self._live -= 1
        if self._at_exit is not None:
            try:
                ub.ctx_run(self._at_exit, ub)
            except BaseException as exc:
                self._annotate(ub, exc, where="at its exit")
                raise
        if self.instrument is not None:
            self.instrument.stepped(ub, None)

    def _park(self, ub: UBatch, request: object) -> None:
        if self._before_park is not None:
            try:
                ub.ctx_run(self._before_park, ub)
            except BaseException as exc:
                # It cannot park (what it had to launch failed) and nothing will resume it: cancel
                # it now, so its cleanup runs before the run's error propagates.
                note = cancel_now(self, ub, f"asyncdbo: ubatch {ub.id} failed as it parked: {type(exc).__name__}: {exc}")
                self._annotate(ub, exc, where="as it parked")
                if note is not None:
                    exc.add_note(note)
                raise
        ub.state = PARKED
        self.num_parks += 1
        self._num_parked += 1
        if isinstance(request, Signal):
            ub.parked_on = request
            ub.waker = waker = lambda: self.wake(ub, request)
            request.add_waiter(waker)
            return
        if request is None:  # a bare `yield` (asyncio.sleep(0)): let the loop run once
            ub.parked_on = turn = _LoopTurn()
            self._loop_parked()
            self._loop.call_soon(self.wake, ub, turn)  # type: ignore[union-attr]
            return
        if _is_future(request):
            ub.parked_on = request
            request._asyncio_future_blocking = False  # type: ignore[attr-defined]
            ub.waker = done = lambda _f: self.wake(ub, request)
            request.add_done_callback(done)  # type: ignore[attr-defined]
            self._loop_parked()
            return
        # not ours, not asyncio's: raise it inside the ubatch, at the await that yielded it
        ub.state = READY
        self.num_parks -= 1
        self._num_parked -= 1
        throw_at_next_resume(
            ub,
            TypeError(
                f"ubatch {ub.id} awaited something that yielded {request!r}; asyncdbo can park a ubatch "
                "on asyncdbo primitives and on asyncio awaitables (futures, tasks, asyncio.sleep) only. "
                "Wrap other event loops' objects in an asyncio future first."
            ),
        )
        self._ready.append(ub)

    def _loop_parked(self) -> None:
        if not self._loop_waits:
            self._loop_wait_since = now = _now()
            self._poll_at = now + self.loop_poll_s
        self._loop_waits += 1

    def _unpark(self, ub: UBatch) -> None:
        """``ub`` stops waiting (it is being cancelled): forget its wake-up, cancel its future."""
        parked, waker = ub.parked_on, ub.waker
        ub.parked_on = ub.waker = None
        if ub.state is not PARKED:
            return
        self._num_parked -= 1
        if isinstance(parked, Signal):
            if waker is not None:
                parked.remove_waiter(waker)
            return
        self._loop_waits -= 1
        if _is_future(parked) and not parked.done():
            if waker is not None:
                parked.remove_done_callback(waker)
            parked.cancel()

    def _drain(self) -> None:
        """Fire due timers, then move woken ubatches to the back of the ready ring."""
        if self._timers:
            self._fire_timers()
        woken = self._woken
        while woken:
            ub, token = woken.popleft()
            if ub.state is PARKED and ub.parked_on is token:
                ub.state = READY
                ub.parked_on = ub.waker = None
                self._num_parked -= 1
                if not isinstance(token, Signal):
                    self._loop_waits -= 1
                self._ready.append(ub)

    def _fire_timers(self) -> None:
        now = self.clock.now()
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
        clock = self.clock
        t0 = clock.now()
        timer_due = self._timers[0][0] if self._timers else None
        watchdog_due = None if self.watchdog_s is None else t0 + self.watchdog_s
        # Only the earliest deadline matters: a timer ends this sleep, and the next one re-arms
        # the watchdog (it measures one stretch with every ubatch parked).
        if fut.done():
            pass
        elif watchdog_due is not None and (timer_due is None or watchdog_due < timer_due):
            handles.append(loop.call_later(clock.wait_s(watchdog_due), self._watchdog_fire, fut))
        elif timer_due is not None:
            handles.append(loop.call_later(clock.wait_s(timer_due), self._poke))
        if self.instrument is not None:
            self.instrument.sleeping(self)
        try:
            await fut
        finally:
            self._sleeping = False
            self._wakeup = None
            self.time_asleep_s += clock.now() - t0
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

    # ------------------------------------------------------------------ failure and release
    def _annotate(self, ub: UBatch, exc: BaseException, where: str = "") -> None:
        if isinstance(exc, asyncio.CancelledError):
            return
        exc.add_note(
            f"asyncdbo: raised in ubatch {ub.id} of {len(self.ubatches)} {where or 'while running'} "
            f"(last yield point {ub.tag!r}); the other ubatches were cancelled"
        )

    def _release(self) -> None:
        """Drop everything a ubatch held (coroutine, context, state, the back-reference to this
        run), so a finished run is freed by reference counting alone (invariant 8)."""
        for ub in self.ubatches:
            ub.coro = ub.ctx = ub.ctx_run = ub.send = ub.resume = None  # type: ignore[assignment]
            ub.ext = ub.waker = ub.parked_on = ub.result = ub.resume_with = ub.debug = ub.unawaited = None
            ub.run = None  # type: ignore[assignment]
        self._ready.clear()
        self._woken.clear()
        self._timers.clear()
        self._view = self._task = self._wakeup = None
        self._installed = None
