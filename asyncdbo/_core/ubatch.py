"""The kernel's record of one ubatch, reached through a contextvar.

Each ubatch coroutine runs inside its own :class:`contextvars.Context`, a copy of the caller's
context in which :data:`current_ubatch` is set to its :class:`UBatch`. The kernel resumes a
ubatch with ``ctx.run(coro.send, None)``, so after every resume the ubatch sees its own state and
its own contextvars with no restore code at all (vLLM re-installs a process-global forward context
by hand after each thread handoff). Two DBO runs in two asyncio tasks never share state: each run
builds its own contexts.

The record holds only what a round-robin driver of coroutines needs. The layer above (streams,
events, recv hooks) keeps its per-ubatch state in ``ext``, an object the kernel never reads, and
tells the kernel what to install before a resume through ``resume_with``.
"""

from __future__ import annotations

import contextvars
import enum
import functools
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from .extensions import load_extension

if TYPE_CHECKING:
    from .kernel import DBORun

__all__ = ["UBatch", "UBatchState", "current_ubatch", "get_ubatch"]

current_ubatch: contextvars.ContextVar[UBatch | None] = contextvars.ContextVar("asyncdbo_ubatch")
"""The running ubatch in its own context; None (or unset) outside a run, and in a task created
from a ubatch (such a task is not part of the run)."""


_spin = load_extension("asyncdbo._core._spin")
#: ``Resume(ctx, coro)()`` is ``ctx.run(coro.send, None)`` in C (asyncdbo/_core/_spin.c), which the
#: kernel's C loop runs inline; the functools.partial where the extension is not loaded.
_Resume: Callable[[contextvars.Context, Coroutine[Any, Any, Any]], Callable[[], object]] | None = (
    None if _spin is None else _spin.Resume
)


class UBatchState(enum.Enum):
    """Where a ubatch is in the kernel's ring."""

    READY = "ready"  # in the ring, or running now
    PARKED = "parked"  # skipped until what it waits on completes
    DONE = "done"  # returned, raised, or was cancelled

    def __str__(self) -> str:
        return self.value


class UBatch:
    """One ubatch of a run.

    ``id`` (its index), ``run`` (the :class:`~asyncdbo._core.kernel.DBORun`), ``tag`` (the last yield
    tag), ``num_yields`` (counted only while an instrument is set), ``state``, ``parked_on`` (what it
    waits on), ``result``; ``resume_with``: what the run installs before resuming it (a device
    stream; the kernel only compares and passes it on); ``ext``: the upper layer's per-ubatch state;
    ``unawaited``: the upper layer's record of an awaitable it handed out and that was not awaited
    yet (the DBO layer's missing-await check) and ``unawaited_at``, where it was made; ``debug``: the upper layer's debug-mode state (None
    outside debug mode); ``cancels``: pending cancellation requests (``Task.cancelling()``).

    The record is valid while its run is driven: afterwards the run drops the coroutine, context,
    state and the back-reference to the run, so that nothing of a finished run outlives it
    through reference cycles.
    """

    __slots__ = (
        "id",
        "run",
        "coro",
        "resume",
        "ctx",
        "ctx_run",
        "state",
        "tag",
        "num_yields",
        "parked_on",
        "result",
        "resume_with",
        "ext",
        "send",
        "waker",
        "unawaited",
        "unawaited_at",
        "debug",
        "cancels",
        "__weakref__",
    )

    def __init__(self, ub_id: int, run: DBORun, coro: Coroutine[Any, Any, Any]) -> None:
        self.id = ub_id
        # What the kernel drops when a run releases its records (DBORun._release): a released
        # record has them all None, so _start() need not set them again.
        self.parked_on: Any = None
        self.result: object = None
        self.resume_with: object = None
        self.ext: Any = None
        self.waker: Any = None  # the callback the kernel registered on what it is parked on
        self.unawaited: object = None
        self.debug: Any = None
        self._start(run, coro)

    def _start(self, run: DBORun, coro: Coroutine[Any, Any, Any]) -> None:
        """Fill a new or released record for a run of ``coro``: its own context (a copy of the
        caller's, with this ubatch current) and the counters at their start values. A new record
        does this once; :meth:`DBORun.restart` does it again on a released one."""
        # What can fail first, then the stores (as ``asyncdbo._core._spin.start``, its C twin in
        # DBORun.restart, fills the record).
        ctx = contextvars.copy_context()
        ctx_run = ctx.run
        # coro.send(None) inside this ubatch's context, prebuilt: the kernel's fast path calls it
        # once per switch, with no attribute lookups or argument packing of its own.
        send: Callable[[], object] = functools.partial(ctx_run, coro.send, None) if _Resume is None else _Resume(ctx, coro)
        ctx_run(current_ubatch.set, self)
        self.run = run
        self.coro = coro
        self.ctx = ctx
        self.ctx_run = ctx_run
        self.send = send
        self.resume: Callable[[], object] = send  # swapped for a one-shot throw by a cancellation
        self.state = UBatchState.READY
        self.tag: str | None = None
        self.num_yields = 0
        self.unawaited_at: object = None  # where ``unawaited`` was made: (code, lasti) of its caller
        self.cancels = 0

    @property
    def num_ubatches(self) -> int:
        return len(self.run.ubatches)

    def __repr__(self) -> str:
        return f"<UBatch {self.id} {self.state} tag={self.tag!r} yields={self.num_yields}>"


def get_ubatch() -> UBatch | None:
    """The running ubatch, or None outside a DBO run."""
    return current_ubatch.get(None)
