"""How a ubatch looks to asyncio: a task of its own, while it runs on the run's one task.

Ubatches are coroutines the kernel drives inside one asyncio task (the one that awaits
``run_ubatches``). Three asyncio facilities assume "the running coroutine is a task" and would act
on that whole task; this module makes each of them act on the ubatch instead:

* ``asyncio.current_task()`` inside a ubatch returns the run's :class:`UBatchTaskView`, swapped in
  for the driving task while the kernel resumes ubatches (four C calls per entry into the
  kernel's fast loop, none per switch). Its ``cancel``/``uncancel``/``cancelling`` act on the
  ubatch whose context calls them: asyncio schedules a timeout's callback in the context that
  armed it, which is that ubatch's, so ``asyncio.timeout`` (and ``wait_for``, ``TaskGroup``)
  cancel that ubatch only and it sees ``TimeoutError``.
* A task created inside a ubatch (``create_task``, ``ensure_future``, ``wait_for`` on 3.11) would
  copy the ubatch's context and believe it is in the run (``dbo_enabled()``) although the kernel
  never drives it ("Task got bad yield: SWITCH"). The loop's task factory (installed by the
  loop's first run and kept: :class:`RunTaskFactory`) gives such a task a copy of the context
  with the running ubatch unset: it is not part of the
  run, and the primitives are no-ops in it.
* An awaitable a ubatch created but handed to such a task (``asyncio.wait_for(dbo_yield(), t)`` on
  3.11, which wraps its argument in a task; ``ensure_future(dbo_wait_event(key))``) still yields
  the kernel's requests, which no task can take ("Task got bad yield: SWITCH"). The factory runs
  it under :func:`_detached` instead, which turns each request into its asyncio equivalent: a
  switch lets the loop go round once, a :class:`Signal` becomes a future set when it is. So
  ``wait_for`` around any primitive behaves as around an asyncio awaitable: the ubatch waits on
  the loop, the others go on, and it gets the result or ``TimeoutError``. (From 3.12 ``wait_for``
  awaits its argument in the ubatch; the kernel treats a signal wait under it as a wait on the
  loop instead: ``asyncdbo._core.parking._TimedSignal``.)
* Nothing here touches the fast path of a switch.
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from asyncio import tasks as _tasks
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, cast

from .traps import SWITCH, Signal
from .ubatch import UBatch, current_ubatch

if TYPE_CHECKING:
    from .kernel import DBORun

__all__ = ["RunTaskFactory", "UBatchTaskView", "attach_task_factory", "set_current_task"]

#: ``set_current_task(loop, obj)``: make ``obj`` the loop's current task in one call, where the
#: kernel knows which task is current now (it read it itself): asyncio's ``_swap_current_task``
#: (3.12+, what eager tasks use), else (3.11) a store into the dict that asyncio's own
#: ``_enter_task`` and ``_leave_task`` keep. Their pair per swap re-checks what the kernel knows and
#: deletes and re-inserts the loop's entry, and every run swaps twice.
set_current_task: Callable[[asyncio.AbstractEventLoop, Any], object] = getattr(
    _tasks, "_swap_current_task", None
) or _tasks._current_tasks.__setitem__  # type: ignore[attr-defined]


class UBatchTaskView:
    """What ``asyncio.current_task()`` returns inside a ubatch of a run.

    Cancellation is per ubatch (resolved from the calling context, see the module docstring);
    everything else is the driving task's (``get_loop``, ``add_done_callback``...). Called from a
    context that belongs to no ubatch of this run, ``cancel`` cancels the driving task, hence the
    whole run."""

    __slots__ = ("_run", "_task")
    #: No cancel of its own is pending undelivered (what asyncio's private ``_must_cancel`` says of a
    #: task, read by the kernel's ``drive``): a run nested in a ubatch sees this view as its task, and
    #: a pending cancel of the driving task is the outer run's to raise (without this, ``__getattr__``
    #: would answer with the driving task's).
    _must_cancel = False

    def __init__(self, run: DBORun, task: asyncio.Task[Any]) -> None:
        self._run = run
        self._task = task

    def _ubatch(self) -> UBatch | None:
        ub = current_ubatch.get(None)
        return ub if ub is not None and ub.run is self._run else None

    def cancel(self, msg: Any = None) -> bool:
        ub = self._ubatch()
        if ub is None:
            return self._task.cancel(msg)
        return self._run.cancel_ubatch(ub, msg)

    def uncancel(self) -> int:
        ub = self._ubatch()
        if ub is None:
            return self._task.uncancel()
        if ub.cancels > 0:
            ub.cancels -= 1
        return ub.cancels

    def cancelling(self) -> int:
        ub = self._ubatch()
        return self._task.cancelling() if ub is None else ub.cancels

    def done(self) -> bool:
        ub = self._ubatch()
        return self._task.done() if ub is None else str(ub.state) == "done"

    def cancelled(self) -> bool:
        return self._task.cancelled() if self._ubatch() is None else False

    def get_name(self) -> str:
        ub = self._ubatch()
        base = self._task.get_name()
        return base if ub is None else f"{base}:{self._run.name}:ubatch{ub.id}"

    def get_coro(self) -> Any:
        ub = self._ubatch()
        return self._task.get_coro() if ub is None else ub.coro

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def __repr__(self) -> str:
        ub = self._ubatch()
        where = "" if ub is None else f" ubatch {ub.id}"
        return f"<UBatchTaskView run={self._run.name!r}{where} of {self._task!r}>"


TaskFactory = Callable[..., "asyncio.Future[Any]"]


def _may_yield_to_kernel(coro: Any) -> bool:
    """Whether ``coro`` may be (or wrap) one of the kernel's awaitables: anything but a native
    coroutine (the primitives' generators and C steps; asyncio's wrapper of an awaitable on 3.11),
    or the native ``_wrap_awaitable`` that ``ensure_future`` defines inside itself from 3.12. A
    user's ``async def`` coroutine is left as it is: the primitives it calls there are no-ops."""
    if not isinstance(coro, types.CoroutineType):
        return True
    code = coro.cr_code
    return code.co_name == "_wrap_awaitable" and code.co_filename == _tasks.__file__


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@types.coroutine
def _wait_signal(signal: Signal, loop: asyncio.AbstractEventLoop) -> Generator[Any, Any, None]:
    fut = loop.create_future()

    def wake() -> None:  # may run on gloo's thread
        if not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, fut)

    signal.add_waiter(wake)
    try:
        yield from fut
    finally:
        signal.remove_waiter(wake)


@types.coroutine
def _detached(coro: Any, loop: asyncio.AbstractEventLoop) -> Generator[Any, Any, Any]:
    """Drive ``coro`` in a task of its own, turning the kernel's requests into asyncio's (see the
    module docstring); anything the task sends or throws in (a cancel) goes on into ``coro``."""
    value: Any = None
    exc: BaseException | None = None
    while True:
        try:
            request = coro.send(value) if exc is None else coro.throw(exc)
        except StopIteration as stop:
            return stop.value
        value = exc = None
        try:
            if request is SWITCH:
                value = yield None  # a bare yield: the task steps again after one loop round
            elif isinstance(request, Signal):
                yield from _wait_signal(request, loop)
            else:  # asyncio's own futures, and a bare yield
                value = yield request
        except BaseException as e:  # noqa: BLE001 - a cancel or a close goes to the awaitable
            exc = e


async def _detached_main(coro: Any, loop: asyncio.AbstractEventLoop) -> Any:
    return await _detached(coro, loop)


class RunTaskFactory:
    """The task factory of a loop that ran a DBO run: a task created inside a ubatch is not part
    of the run (see the module docstring); every other task is made as the factory that was there
    before (``previous``; None: asyncio's default) makes it.

    Installed by the first run on a loop and left there: a later run only checks that it is still
    the loop's factory (one call and a type check), instead of setting and resetting the factory
    around every run, which was a measurable part of a short run's fixed cost
    (benchmarks/run_setup.py). Outside a run it only reads one contextvar and passes the call on."""

    __slots__ = ("previous",)

    def __init__(self, previous: TaskFactory | None) -> None:
        self.previous = previous

    def __call__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> asyncio.Future[Any]:
        previous = self.previous
        ub = current_ubatch.get(None)
        if ub is not None and kwargs.get("context") is None:
            context = contextvars.copy_context()
            context.run(current_ubatch.set, None)
            kwargs["context"] = context
            if _may_yield_to_kernel(coro):
                inner, coro = coro, _detached_main(coro, loop)
                # The awaitable is handed over, not dropped: its missing-await mark (the latest
                # primitive's, since each primitive checks the one before) goes, even if the task
                # is cancelled before it starts (``wait_for(dbo_yield(), 0)``).
                ub.unawaited = None
                task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
                # A task cancelled before its first step never runs ``_detached_main``: close the
                # awaitable it would have driven (a no-op once it finished), or a native one
                # (3.12's ``_wrap_awaitable``) warns that it was never awaited.
                task.add_done_callback(lambda _: inner.close())
                return task
        if previous is not None:
            return previous(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)


def attach_task_factory(loop: asyncio.AbstractEventLoop) -> None:
    """Make tasks created inside a ubatch on ``loop`` not part of the run: install a
    :class:`RunTaskFactory` around the loop's factory, unless it is there already (a factory set
    after an earlier run, by the user, is wrapped in its turn)."""
    current: object = loop.get_task_factory()
    if type(current) is not RunTaskFactory:
        loop.set_task_factory(cast(TaskFactory, RunTaskFactory(cast("TaskFactory | None", current))))
