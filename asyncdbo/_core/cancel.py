"""Cancelling ubatches: one at its next resume (a timeout, a ``cancel()``), or all of a failing run
at once, each in its own context with what it resumes with installed.

A run fails when a ubatch raises or the awaiting task is cancelled. Every other live ubatch is then
cancelled at its suspension point, like ``Task.cancel``: ``CancelledError`` is thrown into it inside
its own context, with its stream installed, so its ``finally``/``except CancelledError`` cleanup
sees what it would see at any other resume. Unlike a task's, that cleanup runs to its end at once,
inside the failing run, which schedules nothing any more: an ``await`` in it that suspends (a
yield, a comm wait, ``asyncio.sleep``) gets ``CancelledError`` again, and the error says so in a
note. Cleanup that must wait belongs after ``run_ubatches`` returns or raises. Rules:

* the failing run's own exception is the one that propagates; what goes wrong during cleanup rides
  on it as a note (:func:`cancel_all` returns the notes), never replacing it;
* every live ubatch is cancelled, even after another one's cleanup raised;
* a ubatch that swallows its cancellation gets :data:`MAX_THROWS` throws, then ``close()``; one
  that ignores even ``GeneratorExit`` is named in a note and abandoned, never spun on (see
  :func:`_keep_forever` for why it is then kept alive for the life of the process).
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from .ubatch import UBatch, UBatchState

if TYPE_CHECKING:
    from .kernel import DBORun

__all__ = ["ABANDONED", "MAX_THROWS", "cancel_all", "cancel_now", "throw_at_next_resume"]

#: CancelledError throws a ubatch gets before it is closed instead
MAX_THROWS = 3

#: coroutines that ignored GeneratorExit: kept so that nothing tries to close them again
ABANDONED: list[Coroutine[Any, Any, Any]] = []


def _keep_forever(coro: Coroutine[Any, Any, Any]) -> None:
    """Keep ``coro`` alive, unfinalized, until the process ends.

    Finalizing a coroutine closes it: ``GeneratorExit`` is thrown in once more, outside any run.
    This one already ignored ``GeneratorExit`` inside its run; one that does so around a primitive
    in a loop (``except BaseException: await dbo_yield()``) now finds the primitive a no-op (no
    ubatch is current there) and loops without ever suspending, so whoever drops the last
    reference (the garbage collector, or module teardown at interpreter exit) hangs.
    :data:`ABANDONED` keeps it while the interpreter runs; module teardown clears that list, so the
    one extra reference taken through the C API (``Py_IncRef``; Python has no other way to hold
    an object past teardown) is what keeps the interpreter's exit from finalizing it. The cost is
    the coroutine and its frames, once per abandoned ubatch: a bug that the run's error already
    names. tests/core/test_failure_paths.py runs both ways in a subprocess (without the extra
    reference, the exit spins)."""
    ABANDONED.append(coro)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(coro))


def throw_at_next_resume(ub: UBatch, exc: BaseException) -> None:
    """Make the kernel's next resume of ``ub`` throw ``exc`` at its suspension point, once (the
    fast path keeps calling ``ub.resume``; this swaps it for one call)."""
    send = ub.send

    def throw_once() -> object:
        ub.resume = send
        return ub.ctx_run(ub.coro.throw, exc)

    ub.resume = throw_once


def cancel_now(run: DBORun, ub: UBatch, why: str) -> str | None:
    """Cancel ``ub`` right away (see the module docstring); the note to attach to the run's error
    if its cleanup raised or it refused, else None. ``ub`` is DONE afterwards."""
    run._unpark(ub)
    ub.state = UBatchState.DONE
    run._live -= 1
    coro = ub.coro
    state = inspect.getcoroutinestate(coro)
    if state == inspect.CORO_CLOSED:
        return None
    if state == inspect.CORO_CREATED:  # never started: nothing to clean up; no "never awaited" warning
        ub.ctx_run(coro.close)
        return None
    run.install(ub.resume_with)
    awaited = False  # its cleanup suspended on an await (the next throw lands there)
    for _ in range(MAX_THROWS):
        try:
            ub.ctx_run(coro.throw, asyncio.CancelledError(why))
        except (asyncio.CancelledError, StopIteration):
            if not awaited:
                return None
            return (f"asyncdbo: while cancelling ubatch {ub.id}, its cleanup awaited (last yield point {ub.tag!r}); "
                    "a failing run schedules nothing, so that await got CancelledError too and the cleanup did not "
                    "finish: do cleanup that waits after run_ubatches returns or raises")
        except BaseException as exc:  # noqa: BLE001 - a cleanup error rides on the run's own error
            return f"asyncdbo: while cancelling ubatch {ub.id}, its cleanup raised {type(exc).__name__}: {exc}"
        awaited = True
    try:
        ub.ctx_run(coro.close)
    except RuntimeError as exc:
        if "ignored GeneratorExit" not in str(exc):
            return f"asyncdbo: while cancelling ubatch {ub.id}, its cleanup raised RuntimeError: {exc}"
        _keep_forever(coro)
        return (
            f"asyncdbo: ubatch {ub.id} ignored cancellation {MAX_THROWS} times and then GeneratorExit, at yield "
            f"point {ub.tag!r}; it was abandoned (its cleanup did not finish). Let CancelledError and "
            "GeneratorExit propagate."
        )
    except BaseException as exc:  # noqa: BLE001
        return f"asyncdbo: while closing ubatch {ub.id}, its cleanup raised {type(exc).__name__}: {exc}"
    return (
        f"asyncdbo: ubatch {ub.id} ignored cancellation {MAX_THROWS} times, at yield point {ub.tag!r}; it was closed "
        "instead. Let CancelledError propagate."
    )


def cancel_all(run: DBORun, cause: BaseException) -> list[str]:
    """Cancel every live ubatch of a failing run; the notes for the run's error."""
    why = (
        "asyncdbo: the run was cancelled"
        if isinstance(cause, asyncio.CancelledError)
        else f"asyncdbo: a sibling ubatch failed: {type(cause).__name__}: {cause}"
    )
    notes = []
    for ub in run.ubatches:
        if ub.state is not UBatchState.DONE:
            note = cancel_now(run, ub, why)
            if note is not None:
                notes.append(note)
    return notes
