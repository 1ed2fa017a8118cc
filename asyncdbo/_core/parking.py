"""The parked side of a run: what a ubatch waits on, what wakes it, and the run's sleep.

:class:`Parking` is the half of :class:`~asyncdbo._core.kernel.DBORun` that is not the switch
loop: parking a ubatch on a :class:`Signal`, an asyncio future or one turn of the event loop,
moving woken ubatches back into the ring, firing the run's timers, cancelling one ubatch (a parked
one is woken to take it), letting the event loop run one turn while a ubatch waits on it, and
sleeping on one asyncio future while every live ubatch is parked (with the watchdog and the
deadlock check that bound that sleep). The kernel's invariants 3, 4 and 7 live here.
"""

from __future__ import annotations

import asyncio
import heapq
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from .cancel import cancel_now, throw_at_next_resume
from .clock import Clock
from .errors import DeadlockError, WatchdogTimeout
from .stacks import format_run
from .traps import Signal
from .ubatch import UBatch, UBatchState

if TYPE_CHECKING:
    from .instrument import Instrument
    from .kernel import DBORun

__all__ = ["LOOP_POLL_S", "Parking", "is_future"]

READY, PARKED, DONE = UBatchState.READY, UBatchState.PARKED, UBatchState.DONE
_now = time.perf_counter
_INF = float("inf")

#: How long a loop poll hands the GIL to other threads, once a ubatch has waited on the loop for
#: longer than the interpreter's switch interval (seconds; 0 turns the hand-over off). See
#: :meth:`Parking._let_the_loop_run`.
GIL_HANDOFF_S = 0.0001

#: Default for how often the kernel lets the event loop run while a ubatch waits on it and others
#: keep switching (seconds of real time).
LOOP_POLL_S = 0.001


_UNKNOWN = object()  # what is installed after an event-loop wait: whatever another task left


#: ``asyncio.wait_for``'s code from 3.12, where it awaits its argument in the caller (a ubatch)
#: under an ``asyncio.timeout`` instead of in a task of its own as 3.11 does (see _TimedSignal)
_WAIT_FOR_CODE = asyncio.tasks.wait_for.__code__ if sys.version_info >= (3, 12) else None


def _under_wait_for(coro: Any) -> bool:
    """Whether ``coro``'s await chain passes through ``asyncio.wait_for`` (3.12+ only)."""
    while coro is not None:
        code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
        if code is _WAIT_FOR_CODE:
            return True
        coro = getattr(coro, "cr_await", None) if hasattr(coro, "cr_await") else getattr(coro, "gi_yieldfrom", None)
    return False


class _TimedSignal:
    """What a ubatch is parked on when it waits on ``signal`` inside ``asyncio.wait_for`` (3.12+).

    On 3.11 ``wait_for`` runs a primitive in a task of its own (:mod:`asyncdbo._core.tasks`), so
    the ubatch waits on the event loop: the kernel polls the loop while the others switch, the
    timeout's timer fires and cancels the ubatch. From 3.12 ``wait_for`` awaits the primitive in
    the ubatch itself, which would park on the bare signal, and the loop (hence the timer) would
    not run until every ubatch parked. This token makes such a wait count as a wait on the loop
    as well, so ``wait_for`` around any primitive behaves the same on every version."""

    __slots__ = ("signal",)

    def __init__(self, signal: Signal) -> None:
        self.signal = signal

    @property
    def what(self) -> Any:
        return getattr(self.signal, "what", None)

    def __repr__(self) -> str:
        return f"asyncio.wait_for({self.signal!r})"


class _LoopTurn:
    """What a ubatch that yielded bare (``asyncio.sleep(0)``) is parked on: one turn of the loop."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "asyncio.sleep(0)"


def is_future(obj: object) -> bool:
    """Whether ``obj`` follows asyncio's future protocol (what a bare ``await fut`` yields)."""
    return getattr(obj, "_asyncio_future_blocking", None) is not None


class Parking:
    """Parking, waking and sleeping for :class:`~asyncdbo._core.kernel.DBORun` (its base class;
    the attributes below are set by ``DBORun.__init__``)."""

    _name: str | None
    _serial: int
    ubatches: list[UBatch]
    instrument: Instrument | None
    watchdog_s: float | None
    clock: Clock
    loop_poll_s: float
    num_parks: int
    time_asleep_s: float
    _live: int
    _num_parked: int
    _loop_waits: int  # ubatches parked on the event loop (futures, sleeps, bare yields)
    _loop_wait_since: float
    _poll_at: float
    _poll_due: bool
    _before_park: Callable[[UBatch], None] | None
    _ready: deque[UBatch]
    _woken: deque[tuple[UBatch, object]]
    _timers: list[tuple[float, int, Callable[[], None]]]
    _timer_seq: Iterator[int]
    _sleeping: bool
    _wakeup: asyncio.Future[None] | None
    _loop: asyncio.AbstractEventLoop | None
    _install: Callable[[object], None] | None
    _installed: object
    home: object

    @property
    def name(self) -> str:
        """The run's name (its ``name`` option, else ``dbo-run-<serial>``): errors and traces show
        it. Made when read, which few runs need."""
        return self._name or f"dbo-run-{self._serial}"

    def wake(self, ub: UBatch, token: object) -> None:
        """Make ``ub`` runnable if it is still parked on ``token`` (a stale wake, from something it
        stopped waiting for, is ignored). Safe from any thread."""
        self._woken.append((ub, token))
        if self._sleeping and self._loop is not None:
            self._loop.call_soon_threadsafe(self._poke)

    # ------------------------------------------------------------------ parking and waking
    def _park(self, ub: UBatch, request: object) -> None:
        """``ub`` yielded ``request`` (not a switch): park it on that, or fail it at its await."""
        if self._before_park is not None:
            self._run_before_park(ub)
        ub.state = PARKED
        self.num_parks += 1
        self._num_parked += 1
        if isinstance(request, Signal):
            token: object = request
            if _WAIT_FOR_CODE is not None and _under_wait_for(ub.coro):
                token = _TimedSignal(request)
                self._loop_parked()
            ub.parked_on = token
            ub.waker = waker = lambda: self.wake(ub, token)
            request.add_waiter(waker)
            return
        if request is None:  # a bare `yield` (asyncio.sleep(0)): let the loop run once
            ub.parked_on = turn = _LoopTurn()
            self._loop_parked()
            self._loop.call_soon(self.wake, ub, turn)  # type: ignore[union-attr]
            return
        if is_future(request):
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

    def _run_before_park(self, ub: UBatch) -> None:
        try:
            ub.ctx_run(self._before_park, ub)  # type: ignore[arg-type]
        except BaseException as exc:
            # It cannot park (what it had to launch failed) and nothing will resume it: cancel
            # it now, so its cleanup runs before the run's error propagates.
            note = cancel_now(cast("DBORun", self), ub, f"asyncdbo: ubatch {ub.id} failed as it parked: {type(exc).__name__}: {exc}")
            self._annotate(ub, exc, where="as it parked")
            if note is not None:
                exc.add_note(note)
            raise

    def _annotate(self, ub: UBatch, exc: BaseException, where: str = "") -> None:
        if isinstance(exc, asyncio.CancelledError):
            return
        exc.add_note(
            f"asyncdbo: raised in ubatch {ub.id} of {len(self.ubatches)} {where or 'while running'} "
            f"(last yield point {ub.tag!r}); the other ubatches were cancelled"
        )

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
        if isinstance(parked, _TimedSignal):
            if waker is not None:
                parked.signal.remove_waiter(waker)
            return
        if is_future(parked) and not parked.done():
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

    def call_at(self, deadline: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the kernel's thread once ``self.clock.now() >= deadline``.

        Checked between ubatch steps and while sleeping, so it fires even while other ubatches
        keep the CPU busy (a loop timer would wait until they all park)."""
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), fn))

    def _fire_timers(self) -> None:
        now = self.clock.now()
        timers = self._timers
        while timers and timers[0][0] <= now:
            heapq.heappop(timers)[2]()

    def cancel_ubatch(self, ub: UBatch, msg: Any = None) -> bool:
        """Cancel one ubatch the way ``Task.cancel`` cancels a task: ``CancelledError`` is raised at
        its suspension point when it next runs (at once if it waits on an asyncio future). The run
        goes on; what happens next is the ubatch's business (``asyncio.timeout`` turns it into
        ``TimeoutError``). False if it already finished."""
        if ub.state is DONE:
            return False
        ub.cancels += 1
        parked = ub.parked_on
        if ub.state is PARKED and is_future(parked) and not parked.done():
            parked.cancel(msg)  # its done callback wakes the ubatch; its await raises CancelledError
            return True
        throw_at_next_resume(ub, asyncio.CancelledError() if msg is None else asyncio.CancelledError(msg))
        if ub.state is PARKED:
            self.wake(ub, parked)
        return True

    async def _let_the_loop_run(self) -> None:
        """A ubatch waits on the event loop: let the loop run one turn (invariant 7).

        A thread that needs the GIL (an executor job a ubatch awaits) is granted it by force only
        once its holder kept it a whole switch interval. Every poll releases and retakes the GIL
        (the loop's ``select``), which restarts that wait, so behind ubatches that keep switching
        such a job can starve while a core is free for each thread. Once the wait is longer than
        the switch interval, each poll therefore also sleeps ``GIL_HANDOFF_S`` with the GIL
        released. The sleep blocks the loop on purpose: between polls the loop is the kernel's
        anyway (the switching ubatches hold it for ``loop_poll_s``), and the loop's own wait cannot
        hand over less than a millisecond on uvloop, whose timers round a 0.1 ms delay to a plain
        poll. The designs were compared once: benchmarks/results/gil_handoff_cpu-2c_2026-12-01.md."""
        self._poll_due = False
        if GIL_HANDOFF_S and self._loop_waits and _now() - self._loop_wait_since > sys.getswitchinterval():
            time.sleep(GIL_HANDOFF_S)
        self._poll_at = _now() + self.loop_poll_s  # loop_poll_s of switching between polls
        self._go_home()
        await asyncio.sleep(0)

    # ------------------------------------------------------------------ every ubatch parked
    def _poke(self) -> None:
        fut = self._wakeup
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _go_home(self) -> None:
        """Before an event-loop wait: make ``home`` current for the other tasks on this thread,
        and forget what is installed, so the next resume installs its ubatch's again whatever
        those tasks left current (invariant 9)."""
        if self._install is not None:
            if self.home is not None:
                self._install(self.home)
            self._installed = _UNKNOWN

    async def _sleep(self) -> None:
        """Every live ubatch is parked: await the first completion (or a timer, or the watchdog)."""
        if not self._timers:
            self._check_deadlock()
        loop = self._loop
        assert loop is not None
        self._wakeup = fut = loop.create_future()
        self._sleeping = True
        if self._woken:  # a completion raced in before _sleeping was visible
            fut.set_result(None)
        clock = self.clock
        t0 = clock.now()
        handle = None if fut.done() else self._arm_deadline(loop, fut, t0)
        if self.instrument is not None:
            self.instrument.sleeping(cast("DBORun", self))
        self._go_home()
        try:
            await fut
        finally:
            self._sleeping = False
            self._wakeup = None
            self.time_asleep_s += clock.now() - t0
            if handle is not None:
                handle.cancel()
        if self.instrument is not None:
            self.instrument.woke(cast("DBORun", self))

    def _arm_deadline(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], t0: float) -> Any:
        """A loop timer for the earliest of the next run timer and the watchdog (None: neither).
        A timer ends the sleep and the next sleep re-arms the watchdog: it measures one stretch
        with every ubatch parked."""
        clock = self.clock
        timer_due = self._timers[0][0] if self._timers else None
        # inf bounds nothing, as None: a deadline at inf would move a virtual clock there at once
        watchdog_due = None if self.watchdog_s is None or self.watchdog_s == _INF else t0 + self.watchdog_s
        if watchdog_due is not None and (timer_due is None or watchdog_due < timer_due):
            return loop.call_later(clock.wait_s(watchdog_due), self._watchdog_fire, fut)
        if timer_due is not None:
            return loop.call_later(clock.wait_s(timer_due), self._poke)
        return None

    def _watchdog_fire(self, fut: asyncio.Future[None]) -> None:
        if not fut.done():
            fut.set_exception(
                WatchdogTimeout(
                    format_run(
                        self.ubatches,
                        f"asyncdbo watchdog: run {self.name!r} made no progress for {self.watchdog_s:g} s "
                        "(every ubatch is parked on an outside event; watchdog_s bounds such a wait: raise it to wait "
                        "longer, None for no bound). Ubatch stacks:",
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
