"""Await chains of suspended ubatches, as file:line lists.

A suspended coroutine frame has no ``f_back``, so ``Task.get_stack()`` shows only the outermost
frame. Walking ``cr_await`` (coroutines) and ``gi_yieldfrom`` (generator-based awaitables such as
the trap) from the ubatch's top coroutine gives the whole chain, innermost last, the same order a
traceback uses. One printer serves the deadlock error, the watchdog and ``dump_stacks``.
"""

from __future__ import annotations

import linecache
import os
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from .ubatch import UBatchState

if TYPE_CHECKING:
    from .ubatch import UBatch

__all__ = ["Frame", "await_chain", "format_run", "format_ubatch", "from_the_ubatch", "user_frame"]


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    name: str

    def format(self) -> str:
        line = linecache.getline(self.filename, self.lineno).strip()
        text = f'  File "{self.filename}", line {self.lineno}, in {self.name}'
        return f"{text}\n    {line}" if line else text


def await_chain(awaitable: object) -> list[Frame]:
    """Frames from ``awaitable`` down to the innermost suspension point (outermost first)."""
    frames: list[Frame] = []
    obj = awaitable
    seen = 0
    while obj is not None and seen < 256:
        seen += 1
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            frames.append(Frame(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)))
        nxt = getattr(obj, "cr_await", None)
        if nxt is None:
            nxt = getattr(obj, "gi_yieldfrom", None)
        obj = nxt
    return frames


def _drop_internal(frames: list[Frame]) -> list[Frame]:
    """Hide asyncdbo's own trap frame: the user wants to see where *they* yielded."""
    return [f for f in frames if not (f.name in ("trap", "switch", "Signal.__await__") and "asyncdbo" in f.filename)] or frames


def format_ubatch(ub: UBatch) -> str:
    """One ubatch's state, last yield tag, what it is parked on, and its await chain."""
    head = f"ubatch {ub.id}: {ub.state}, last yield point {ub.tag!r}"
    if ub.parked_on is not None:
        head += f", parked on {ub.parked_on!r}"
    chain = _drop_internal(await_chain(ub.coro)) if ub.state is not UBatchState.DONE else []
    body = "\n".join(f.format() for f in chain) if chain else "  (no frames: finished or not started)"
    return f"{head}\n{body}"


def format_run(ubatches: list[UBatch], title: str) -> str:
    return title + "\n" + "\n".join(format_ubatch(ub) for ub in ubatches)


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_frame(ub: UBatch) -> Frame | None:
    """The innermost frame of ``ub``'s await chain outside asyncdbo's own code: where the user's
    code yielded or parked (None if it is not suspended)."""
    if ub.coro is None:
        return None
    frames = [f for f in await_chain(ub.coro) if not f.filename.startswith(_PKG)]
    return frames[-1] if frames else None


_CORE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def from_the_ubatch(tb: TracebackType | None, entry_files: frozenset[str] = frozenset()) -> TracebackType | None:
    """``tb`` without its leading frames of the run's machinery: the kernel's switch loops and its
    re-raise (this package) and the entry points in ``entry_files``, which carried the error out
    of the ubatch that raised it. A user then reads from the ``await run_ubatches(...)`` line
    straight into the ubatch's own frames, as asyncio's task step (in C) leaves its own frames out
    of a task's traceback. Returned unchanged when every frame is machinery (an error of the
    kernel itself, or of a run's arguments, keeps all of them)."""
    t = tb
    while t is not None and (t.tb_frame.f_code.co_filename.startswith(_CORE)
                             or t.tb_frame.f_code.co_filename in entry_files):
        t = t.tb_next
    return tb if t is None else t
