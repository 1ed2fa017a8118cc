"""Per-ubatch state, reached through a contextvar.

Each ubatch coroutine runs inside its own :class:`contextvars.Context`, a copy of the caller's
context in which :data:`current_ubatch` is set to its :class:`UBatch`. The scheduler resumes a
ubatch with ``ctx.run(coro.send, value)``, so after every resume the ubatch sees its own state
and its own contextvars with no restore code at all (vLLM re-installs a process-global forward
context by hand after each thread handoff). Two DBO runs in two asyncio tasks never share state:
each run builds its own contexts.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scheduler import DBORun

__all__ = ["UBatch", "current_ubatch", "get_ubatch"]

current_ubatch: contextvars.ContextVar[UBatch] = contextvars.ContextVar("asyncdbo_ubatch")

# ubatch states
READY = "ready"
RUNNING = "running"
PARKED = "parked"
DONE = "done"


class UBatch:
    """The scheduler's record of one ubatch.

    Attributes a backend or tool may read: ``id``, ``run`` (the :class:`DBORun`), ``tag`` (the last
    yield tag), ``num_yields`` (counted only while an instrument is set), ``state``, ``parked_on``, ``stream`` (the stream the ubatch is on;
    the scheduler installs it on every resume), ``role`` ("compute" or "comm"), ``streams`` and
    ``events`` (filled by the stream backend), ``recv_hook``.
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
        "stream",
        "role",
        "streams",
        "events",
        "recv_hook",
        "result",
        "data",
    )

    def __init__(self, ub_id: int, run: DBORun, coro: Coroutine[Any, Any, Any]) -> None:
        self.id = ub_id
        self.run = run
        self.coro = coro
        self.ctx = contextvars.copy_context()
        self.ctx_run = self.ctx.run
        # coro.send(None) inside this ubatch's context, prebuilt: the scheduler's fast path calls
        # it once per switch, with no attribute lookups or argument packing of its own.
        self.resume: Callable[[], object] = functools.partial(self.ctx.run, coro.send, None)
        self.ctx.run(current_ubatch.set, self)
        self.state = READY
        self.tag: str | None = None
        self.num_yields = 0
        self.parked_on: Any = None
        self.stream: Any = None  # backend-defined stream object
        self.role = "compute"
        self.streams: dict[str, Any] = {}
        self.events: dict[str, Any] = {}
        self.recv_hook: Callable[[], object] | None = None
        self.result: object = None
        self.data: dict[Any, Any] = {}  # backend/tool per-ubatch scratch (never shared)

    @property
    def num_ubatches(self) -> int:
        return len(self.run.ubatches)

    def set_stream(self, stream: object) -> None:
        """Make ``stream`` this ubatch's current stream and install it on the device now."""
        self.stream = stream
        self.run.install_stream(stream)

    def __repr__(self) -> str:
        return f"<UBatch {self.id} {self.state} tag={self.tag!r} yields={self.num_yields}>"


def get_ubatch() -> UBatch | None:
    """The running ubatch, or None outside a DBO run."""
    return current_ubatch.get(None)
