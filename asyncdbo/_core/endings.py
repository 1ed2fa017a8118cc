"""How a ubatch and a run end: a ubatch returns or raises, the run fails or finishes, and a
finished run releases every record.

:class:`Endings` is the base class of :class:`~asyncdbo._core.kernel.DBORun` between
:class:`~asyncdbo._core.parking.Parking` and the switch loop: what the loop calls when a ubatch
leaves the ring for good (its exit hook, the note on its error), what the run does when it ends by
an error (cancel the others at their suspension points, invariant 5) and how it frees itself
(invariant 8).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .cancel import cancel_all
from .errors import NoOverlapWarning
from .parking import Parking
from .stacks import format_run
from .tasks import UBatchTaskView, set_current_task
from .ubatch import UBatch, UBatchState

if TYPE_CHECKING:
    from .kernel import DBORun

__all__ = ["Endings"]

DONE = UBatchState.DONE
# What ends a run from outside: its error carries each ubatch's position as a note.
_INTERRUPTIONS = (TimeoutError, asyncio.CancelledError, KeyboardInterrupt)


class Endings(Parking):
    """The endings of a ubatch and a run for :class:`~asyncdbo._core.kernel.DBORun` (its base
    class; the attributes below are set by ``DBORun._arm``)."""

    num_switches: int
    _at_exit: Callable[[UBatch], None] | None
    _task: asyncio.Task[Any] | None
    _view: UBatchTaskView | None
    _released: bool

    def _fail_run(self, exc: BaseException) -> None:
        """The run ends with ``exc``: cancel the live ubatches, their cleanup's troubles ride on
        ``exc`` as notes (invariant 5). An interruption from outside the ubatches' own code (a
        timeout, a cancellation, Ctrl-C) first gets a note with where each ubatch was, since the
        traceback shows only the kernel."""
        if isinstance(exc, _INTERRUPTIONS) and self._live:
            exc.add_note(format_run(
                self.ubatches,
                f"asyncdbo: run {self.name!r} ended by {type(exc).__name__}; where its ubatches were:",
            ))
        self._enter_view()
        try:
            for note in cancel_all(cast("DBORun", self), exc):
                exc.add_note(note)
        finally:
            self._leave_view()
        if self.instrument is not None:
            self.instrument.run_finished(cast("DBORun", self), exc)

    async def _cancelled_meanwhile(self) -> None:
        """Deliver a cancel of the driving task that no wait has delivered (invariant 10): one
        requested while the run never waited on the event loop, or before it. asyncio throws a
        cancel into the task at its next suspension, and a run whose ubatches only switch has none:
        it would land after the run, at the caller's next wait (a serving loop's next step, or
        later). Requested by code the run ran (a ubatch that cancels the task, a signal handler
        between two bytecodes: ``asyncio.run`` turns Ctrl-C into a cancel of its main task) or
        between two runs. One pass of the loop takes it here, so the run going on is the one that
        raises ``CancelledError``. The ubatches have finished; their results are dropped. Other
        tasks run in that pass, so the run's ``home`` is made current first (invariant 9), as
        before any wait of the run on the loop."""
        self._go_home()
        try:
            await asyncio.sleep(0)
        except BaseException as exc:
            exc.add_note(f"asyncdbo: run {self.name!r} took a cancel of its task that no wait had delivered (the run "
                         "never waited on the event loop); its ubatches had finished, and their results were dropped")
            if self.instrument is not None:  # it ends the run as the caller sees it
                self.instrument.run_finished(cast("DBORun", self), exc)
            raise

    def _warn_if_nothing_overlapped(self) -> None:
        if len(self.ubatches) >= 2 and self.num_switches == 0 and self.num_parks == 0:
            warnings.warn(
                NoOverlapWarning(
                    f"{len(self.ubatches)} ubatches ran without a single yield, so nothing could overlap; "
                    "put `await dbo_yield()` (or a switch primitive) where one ubatch should hand over"
                ),
                stacklevel=5,  # _warn, drive, _run, run_ubatches, the caller
            )

    def _enter_view(self) -> None:
        """Make the run's task view the loop's current task (the kernel resumes ubatches)."""
        if self._view is not None:
            set_current_task(self._loop, self._view)  # type: ignore[arg-type]  # a view has a loop

    def _leave_view(self) -> None:
        """Give the loop the task that drives the run back (before the kernel awaits)."""
        if self._view is not None:
            set_current_task(self._loop, self._task)  # type: ignore[arg-type]

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

    def _release(self) -> list[Any]:
        """Drop everything a ubatch held (coroutine, context, state, the back-reference to this
        run), so a finished run is freed by reference counting alone (invariant 8); return the
        results the records held, in ubatch order (the run's, where it ended cleanly)."""
        results = self._release_records()
        self._ready.clear()
        self._woken.clear()
        self._timers.clear()
        self._view = self._task = self._wakeup = None
        self._installed = None
        self._released = True
        return results

    def _release_records(self) -> list[Any]:
        """Each record's result read, then its coroutine, context, layer-above state, what it
        waited on, result and run set to None; the results read, in ubatch order (the reference
        of ``asyncdbo._core._spin.release``, which the kernel calls where the extension is
        loaded)."""
        results: list[Any] = []
        try:
            for ub in self.ubatches:
                results.append(ub.result)
                ub.coro = ub.ctx = ub.ctx_run = ub.send = ub.resume = None  # type: ignore[assignment]
                ub.ext = ub.waker = ub.parked_on = ub.result = ub.resume_with = ub.debug = ub.unawaited = None
                ub.run = None  # type: ignore[assignment]
        except BaseException:
            results.clear()  # freed now, as the C loop frees them, not with the error's traceback
            raise
        return results
