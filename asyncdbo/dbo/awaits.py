"""Missing ``await``: caught where it is made.

vLLM's primitives are plain calls; ported code that keeps one as a call (``dbo_yield()``, or
``dbo_switch_to_compute_sync()``) creates an awaitable that nothing runs. Unlike a native
coroutine, asyncdbo's generator-based awaitables (one frame cheaper per switch) get no "never
awaited" warning from Python, so the DBO layer checks itself, at no cost to an awaited switch:

* every awaitable primitive marks the ubatch (``ub.unawaited``) when called, and the awaitable
  clears the mark when it starts;
* the next primitive the ubatch calls, and its exit, find a mark still set and report it:
  - a dropped ``dbo_yield`` only loses overlap (the numbers stay right): a ``RuntimeWarning``
    (an error under ``-W error``);
  - a dropped switch or event wait is a data hazard (the stream switch or its wait did not happen,
    so the ubatch may read comm output that has not arrived, or what the recording ubatch had not
    written yet): :class:`~asyncdbo.dbo.MissingAwaitError` (a ``RuntimeError``), always;
  - in debug mode (``debug=True``) every kind is an error.

Every report names the file:line that created the awaitable: each primitive records its caller's
code object and instruction offset (``ub.unawaited_at``, no frame kept alive, no line computed)
and the report turns them into a line. In debug mode the site is the first frame outside asyncdbo.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass
from types import CodeType, FrameType

from .._core import MissingAwaitError, UBatch

__all__ = ["Marks", "Unawaited", "check_unawaited", "made_at", "mark_unawaited", "marks", "site_of"]


@dataclass(frozen=True, slots=True)
class Unawaited:
    """A primitive's awaitable that was handed out and not awaited (yet)."""

    primitive: str
    tag: str | None  # a yield's or switch's tag (shown by its repr); an event wait's: the key's repr
    hazard: bool  # skipping it can give wrong numbers, not only lost overlap
    site: str | None = None  # "file:line in function" (debug mode)
    event_wait: bool = False  # dbo_wait_event: the tag is already the key's repr

    def describe(self, ub_id: int) -> str:
        where = f" (created at {self.site})" if self.site else ""
        arg = "" if self.tag is None else self.tag if self.event_wait else repr(self.tag)
        call = f"{self.primitive}({arg})"
        if self.event_wait:
            why = ("the wait on that event did not happen, so what the ubatch read since may be what the recording "
                   "ubatch had not written yet")
        elif self.hazard:
            why = ("the stream switch and its wait did not happen, so what the ubatch read since may be comm output "
                   "that had not arrived yet")
        else:
            why = "it did not hand over, so nothing overlapped there"
        return (
            f"asyncdbo: {call} in ubatch {ub_id} was never awaited (missing await?){where}: {why}. "
            f"Write `await {call}`."
        )


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _site(depth: int) -> str:
    """``file:line in function`` of the first frame outside asyncdbo, from ``depth`` frames up."""
    f: FrameType | None = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_PKG):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_qualname}"


_getframe = sys._getframe


def made_at(depth: int) -> tuple[CodeType, int]:
    """(code, instruction offset) of the frame ``depth`` above the caller: where an awaitable is
    made, cheap to record (the C primitives record the same pair) and turned into a line only
    when it is reported."""
    f = _getframe(depth + 1)
    return f.f_code, f.f_lasti


def site_of(at: object) -> str | None:
    """``file:line in function`` of a :func:`made_at` record (None for anything else)."""
    if not isinstance(at, tuple) or len(at) != 2 or not isinstance(at[0], CodeType):
        return None
    code, lasti = at
    line = next((ln for start, end, ln in code.co_lines() if start <= lasti < end and ln is not None), None)
    return f"{code.co_filename}:{line if line is not None else code.co_firstlineno} in {code.co_qualname}"


def check_unawaited(ub: UBatch, stacklevel: int = 4) -> None:
    """Report the awaitable ``ub`` left unawaited, if any (see the module docstring). A warning
    names the line ``stacklevel`` frames up (4: the caller of a primitive that calls a helper that
    calls this)."""
    pending = ub.unawaited
    if pending is None:
        return
    ub.unawaited = None
    record = pending if isinstance(pending, Unawaited) else Unawaited("a DBO primitive", repr(pending), hazard=False)
    if record.site is None:
        site = site_of(ub.unawaited_at)
        if site is not None:
            record = dataclasses.replace(record, site=site)
    message = record.describe(ub.id)
    if record.hazard or ub.debug is not None:
        raise MissingAwaitError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


# Outside debug mode a mark has no call site, so one record per primitive and tag serves every
# call: the hot path is a dict lookup instead of building a frozen dataclass per primitive call
# (benchmarks/host_overhead.py). Bounded, for code that makes a fresh tag per call.
_MAX_MARKS = 4096


class Marks:
    """One primitive's shared (site-less) marks by tag, made on first use. The hot path reads
    ``table`` directly (``table.get(tag) or marks.make(tag)``): a plain dict's ``get`` is about
    half the cost of a subscript on a dict subclass with ``__missing__`` (timeit, 33 against 59 ns)."""

    __slots__ = ("primitive", "hazard", "event_wait", "table")

    def __init__(self, primitive: str, hazard: bool, event_wait: bool = False) -> None:
        self.primitive, self.hazard, self.event_wait = primitive, hazard, event_wait
        self.table: dict[str | None, Unawaited] = {}

    def make(self, tag: str | None) -> Unawaited:
        record = Unawaited(self.primitive, tag, self.hazard, event_wait=self.event_wait)
        if len(self.table) < _MAX_MARKS:
            self.table[tag] = record
        return record

    def of(self, tag: str | None) -> Unawaited:
        return self.table.get(tag) or self.make(tag)


_MARKS: dict[tuple[str, bool, bool], Marks] = {}


def marks(primitive: str, *, hazard: bool = True, event_wait: bool = False) -> Marks:
    """The shared marks of ``primitive`` (one :class:`Marks` per primitive, hazard and kind)."""
    found = _MARKS.get((primitive, hazard, event_wait))
    if found is None:
        found = _MARKS[(primitive, hazard, event_wait)] = Marks(primitive, hazard, event_wait)
    return found


def mark_unawaited(ub: UBatch, primitive: str, tag: str | None, *, hazard: bool, depth: int = 1,
                   event_wait: bool = False) -> None:
    """Called by an awaitable primitive, ``depth`` frames below the code that called it: report a
    previous one left unawaited, then mark this one with where it was made (and the first frame
    outside asyncdbo in debug mode). ``event_wait``: ``tag`` is an event key's repr, shown as is."""
    if ub.unawaited is not None:
        check_unawaited(ub)
    if ub.debug is None:
        ub.unawaited = marks(primitive, hazard=hazard, event_wait=event_wait).of(tag)
    else:
        ub.unawaited = Unawaited(primitive, tag, hazard, _site(3), event_wait)
    ub.unawaited_at = made_at(depth + 1)
