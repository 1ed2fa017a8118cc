"""The kernel: a round-robin driver of N ubatch coroutines on one OS thread.

It knows coroutines, signals, asyncio futures, timers and a clock; nothing about streams, events,
comm or models (curio's rule: new features go outside the kernel). The layer above talks to it
through three narrow seams: ``UBatch.resume_with`` plus an ``install`` callable (what to make
current before a resume: a device stream), ``before_park``/``at_exit`` callables (where vLLM's
recv hooks run), and the opaque ``ext`` slots on the run and each ubatch.

Invariants (each names the test that specifies it; every test in tests/core/ runs on the C and the Python loop):

1. Exactly one ubatch runs at a time. Runnable ubatches run in strict round-robin order (a ubatch
   that yields goes to the back of the ring), so the same program gives the same interleaving on
   every run.
   Test: ``tests/core/test_scheduler.py::test_round_robin_for_n_ubatches``.
2. Only the functions in :mod:`asyncdbo._core.traps` (and asyncio futures, by asyncio's own
   protocol) suspend a ubatch to the kernel, and every resume goes through the loop below: it
   installs the ubatch's ``resume_with`` (if it differs from the installed one) and runs
   ``coro.send`` inside the ubatch's own context. Nothing else restores state.
   Test: ``tests/core/test_scheduler.py::test_a_resume_installs_the_ubatchs_stream_only_when_another_is_current``.
3. A ubatch parked on a foreign awaitable or a :class:`Signal` is skipped until it completes. When
   every live ubatch is parked, the scheduler awaits one asyncio future that the first completion
   resolves: the event loop stays free for other tasks and nothing spins.
   Test: ``tests/core/test_scheduler.py::test_when_every_ubatch_is_parked_the_loop_sleeps_instead_of_spinning``.
4. When every live ubatch is parked on something no one can produce (a signal that only another
   ubatch could set), the run raises :class:`DeadlockError` with each ubatch's await chain.
   Test: ``tests/core/test_scheduler.py::test_a_wait_on_an_event_nobody_records_is_a_deadlock_with_every_stack``.
5. An exception in one ubatch cancels the others at their suspension point (in their own context,
   with their stream installed, a bounded number of times: :mod:`asyncdbo._core.cancel`) and
   propagates with its coroutine traceback and a note naming the ubatch and its last yield.
   Test: ``tests/core/test_scheduler.py::test_an_exception_cancels_the_others_and_names_the_ubatch_and_its_last_yield``.
6. Runs share nothing: two runs in two asyncio tasks never see each other's ubatches.
   Test: ``tests/core/test_scheduler.py::test_two_runs_in_two_tasks_never_see_each_others_state``.
7. Inside a ubatch asyncio behaves as in a task of its own (:mod:`asyncdbo._core.tasks`): a ubatch
   parked on the event loop (a sleep, a future, an executor) wakes within about ``loop_poll_s``
   even while others keep switching, since the kernel then lets the loop run every
   ``loop_poll_s``; ``asyncio.timeout`` cancels that ubatch only; a task created from a ubatch is
   not part of the run.
   Test: ``tests/core/test_asyncio_inside_a_ubatch.py::test_a_ubatch_waiting_on_the_loop_wakes_while_another_keeps_switching``.
8. A finished run frees itself: it drops every ubatch's coroutine, context and state, so results
   and device memory go as soon as the caller drops them, with no cycle collection.
   Test: ``tests/core/test_failure_paths.py::test_a_finished_run_frees_itself_its_ubatches_and_their_results_without_gc``.
9. What is current (a device stream) is per OS thread, shared with every other task on the loop:
   before the run waits on the event loop it installs its ``home`` (the caller's stream, set by
   the layer above), and after the wait it installs the next ubatch's ``resume_with`` again
   whatever it installed before, since another task (another run) may have changed it meanwhile.
   Test: ``tests/core/test_scheduler.py::test_a_run_waiting_on_the_loop_leaves_home_current_and_reinstalls_after``.
10. A cancel of the task that drives the run ends that run, never a later one: asyncio delivers it
    where the run waits on the loop (invariant 5); one requested while the run never waits (by a
    ubatch, by ``asyncio.run``'s Ctrl-C handler), or before it and not delivered yet, is raised
    from the run once its ubatches finished.
    Test: ``tests/core/test_failure_paths.py::test_a_cancel_requested_while_the_run_never_waits_ends_that_run_not_a_later_one``.

A yield (``SWITCH``) never touches the event loop: one ``ctx.run(send)``, a deque pop and push, a counter.
The loop below (:meth:`DBORun._switch_in_python`) is the reference. Its fast path, the same loop in C
(``asyncdbo/_core/_spin.c``) while no instrument or loop wait is involved, and the reuse of a finished run
for the next one live in :mod:`asyncdbo._core.fastpath`, the base of :class:`DBORun`, whose ``_switch`` is
the one place that picks a loop (``ASYNCDBO_PURE_PYTHON=1`` runs the reference alone; tests pick one
through ``fastpath.kernel_loop``).
Parking, waking, the loop poll and the run's sleep (invariants 3, 4, 7) live in :mod:`asyncdbo._core.parking`;
the endings of a ubatch and a run (5, 8) in :mod:`asyncdbo._core.endings`, the bases of :class:`DBORun`;
cancellation at a suspension point (5) in :mod:`asyncdbo._core.cancel`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from asyncio import tasks as _tasks
from types import BuiltinFunctionType
from typing import Any

from .clock import Clock, MonotonicClock
from .fastpath import FastPath
from .instrument import Instrument
from .live import LIVE_RUNS
from .parking import LOOP_POLL_S
from .tasks import RunTaskFactory, UBatchTaskView, attach_task_factory, set_current_task
from .traps import SWITCH
from .ubatch import UBatch, UBatchState

__all__ = ["LIVE_RUNS", "LOOP_POLL_S", "DBORun"]

READY, PARKED, DONE = UBatchState.READY, UBatchState.PARKED, UBatchState.DONE


_MONOTONIC = MonotonicClock()
_now = time.perf_counter
# What drive() asks the loop for once per run, without asyncio's Python wrappers: on 3.11
# ``asyncio.current_task`` is a Python function (drive does its dict lookup inline), from 3.12 C.
_get_running_loop = asyncio.get_running_loop
_current_task: Callable[[asyncio.AbstractEventLoop], Any] | None = (
    asyncio.current_task if isinstance(asyncio.current_task, BuiltinFunctionType) else None
)


class DBORun(FastPath):
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
        """``install(obj)`` makes a ubatch's ``resume_with`` current before it resumes (None: nothing to
        install); ``before_park(ub)`` runs as ``ub`` parks, ``at_exit(ub)`` as it returns (either may raise)."""
        self.ubatches = [UBatch(i, self, c) for i, c in enumerate(coros)]
        self.ext: Any = None  # the layer above's per-run state; the kernel never reads it
        self._ready = deque(self.ubatches)
        self._woken = deque()
        self._timers = []
        # the C loop's arguments (FastPath._switch) without an install, with and without wake-ups to
        # watch (none names the run)
        ready = self._ready
        self._spin_args = ((ready.popleft, ready.append, None, self._timers, SWITCH, None),
                           (ready.popleft, ready.append, self._woken, self._timers, SWITCH, None))
        self._timer_seq = itertools.count()
        self._released = False
        self._installed: object = None
        self._wakeup = None
        self._task: asyncio.Task[Any] | None = None
        self._view: UBatchTaskView | None = None
        self._wref = weakref.ref(self, LIVE_RUNS.forget)  # its entry in LIVE_RUNS while driven
        hash(self._wref)  # computed while the run lives: the callback finds a dead reference by it
        self._arm(install, before_park, at_exit, instrument, watchdog_s, clock, loop_poll_s, name)

    def _arm(self, install: Callable[[object], None] | None, before_park: Callable[[UBatch], None] | None,
             at_exit: Callable[[UBatch], None] | None, instrument: Instrument | None, watchdog_s: float | None,
             clock: Clock | None, loop_poll_s: float, name: str | None) -> None:
        """The options of :meth:`restart` (and ``__init__``), in their order, then every per-run
        field at its start value (the ubatches are in the ready ring)."""
        self._name = name
        self.instrument = instrument
        self.watchdog_s = watchdog_s
        self.clock = _MONOTONIC if clock is None else clock
        self.loop_poll_s = loop_poll_s
        self._install = install
        self.installs = install is not None  # whether install() has anything to do (a host: no)
        self._before_park = before_park
        self._at_exit = at_exit
        self._reset()

    def _reset(self) -> None:
        """Every per-run field at its start value (a released run has ``_installed``, ``_wakeup``,
        ``_task`` and ``_view`` None already: :meth:`_release`)."""
        self._serial = next(self._ids)  # names the run unless its options did (``name``)
        self.num_parks = 0
        self.num_switches = 0
        self._num_parked = 0
        self._loop_waits = 0
        self._poll_at = 0.0
        self._poll_due = False
        self._loop_wait_since = 0.0
        self.time_asleep_s = 0.0
        self.home: object = None  # what install() makes current while the run waits on the loop
        self._sleeping = False
        self._loop = None
        self._live = len(self.ubatches)

    # ------------------------------------------------------------------ services for the layer above
    @property
    def installed(self) -> object:
        """What :meth:`install` made current last (None: nothing yet; a resume installs only another)."""
        return self._installed

    def install(self, obj: object) -> None:
        """Make ``obj`` current now (a role switch inside a step), as a resume would."""
        if obj is not self._installed:
            self._installed = obj
            if self._install is not None:
                self._install(obj)

    # ------------------------------------------------------------------ the run
    async def drive(self) -> list[Any]:
        """Run every ubatch to completion; return their results in ubatch order."""
        loop = self._loop = _get_running_loop()
        task = self._task = _current_task(loop) if _current_task is not None else _tasks._current_tasks.get(loop)  # type: ignore[attr-defined]
        view = None if task is None else UBatchTaskView(self, task)
        self._view = view
        # invariant 10: the cancels requested so far, less one asyncio has not delivered (its private
        # ``_must_cancel``; absent: none pending), which is this run's to raise (Ctrl-C between two steps)
        cancels = 0 if task is None else task.cancelling() - (getattr(task, "_must_cancel", False) is True)
        if self.instrument is not None:
            self.instrument.run_started(self)
        live = LIVE_RUNS.refs
        live.add(self._wref)
        factory: object = loop.get_task_factory()
        if type(factory) is not RunTaskFactory:
            attach_task_factory(loop)
        try:
            try:
                # _loop_until_done's first pass (nothing woken, no timer or poll yet), without its coroutine:
                # a run whose ubatches only switch ends here
                if self._ready and not (self._timers or self._woken or self._poll_due):
                    if view is not None:  # _switch_in_view, inline: every run starts here
                        set_current_task(loop, view)
                    try:
                        self._switch()
                    finally:
                        if view is not None:
                            set_current_task(loop, task)
                if self._live:  # they parked, or one waits on the loop
                    await self._loop_until_done()
            except BaseException as exc:
                self._fail_run(exc)
                raise
            if task is not None and task.cancelling() > cancels:
                await self._cancelled_meanwhile()  # invariant 10 (an instrument hears the cancel)
            if self.instrument is not None:
                self.instrument.run_finished(self, None)
            if not self.num_switches and not self.num_parks:
                self._warn_if_nothing_overlapped()
        except BaseException:
            live.discard(self._wref)
            self._release()  # its results are dropped with the records: the error's frames hold none
            raise
        live.discard(self._wref)
        return self._release()  # the records' results, read as they are released

    async def _loop_until_done(self) -> None:
        """Switch ubatches until every one finished; sleep while all are parked, and let the event
        loop run while one waits on it."""
        ready, woken, timers = self._ready, self._woken, self._timers
        while self._live:
            if timers or woken:
                self._drain()
            if not ready:
                await self._sleep()
            elif self._poll_due:
                await self._let_the_loop_run()
            else:
                self._switch_in_view()

    def _switch_in_view(self) -> None:
        """Switch ubatches (:meth:`_switch`: in C where it can) with the run's task view as the loop's
        current task (no view: no task drives the run, a bare send)."""
        view = self._view
        if view is None:
            self._switch()
            return
        set_current_task(self._loop, view)  # type: ignore[arg-type]  # a view has a loop and a task
        try:
            self._switch()
        finally:
            set_current_task(self._loop, self._task)  # type: ignore[arg-type]

    # ---- the switch loop. Ubatches that keep switching stay in it (or in its C twin, see FastPath._switch)
    # until one parks or finishes. Completions and loop polls only matter for parked ubatches, so they are checked only while
    # some ubatch is parked (a wake can only target a parked one). Timers added during the loop (a modeled
    # link's releases) fire at the next switch once due: the message is then complete before its ubatch awaits
    # it, which does not park.
    def _switch_in_python(self) -> None:
        """Resume ubatches round-robin until one parks, finishes or fails, or a loop poll is due.
        The reference for the C loop (:meth:`_switch`), and the only path with an instrument or a ubatch
        waiting on the event loop."""
        ready, woken, timers = self._ready, self._woken, self._timers
        inst = self.instrument
        watch = self._num_parked > 0 or bool(timers)
        installs = self.installs
        switch, pop, push = SWITCH, ready.popleft, ready.append
        n = 0
        try:
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
                    if woken or timers:  # its exit woke or armed something: drained out there first
                        return
                    continue
                except BaseException as exc:
                    self._failed(ub, exc)
                    raise
                if request is not switch:
                    self._park(ub, request)
                    if inst is not None:
                        inst.stepped(ub, request)
                    return
                n += 1
                if inst is not None:
                    ub.num_yields += 1
                    inst.stepped(ub, request)
                if not watch:
                    if timers:  # set during this loop (a modeled link's release): due ones
                        self._fire_timers()  # complete now, so nobody parks on them later
                    push(ub)
                    continue
                if woken or timers:
                    self._drain()  # woken during this step: they were runnable first
                push(ub)
                if self._loop_waits and not n & 63 and _now() >= self._poll_at:
                    self._poll_due = True
                    return
        finally:
            self.num_switches += n
