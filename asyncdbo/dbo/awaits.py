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
    so the ubatch may read comm output that has not arrived): :class:`~asyncdbo.dbo.MissingAwaitError`
    (a ``RuntimeError``), always;
  - in debug mode (``debug=True``) every kind is an error and names the file:line that created the
    awaitable (the call sites are recorded; outside debug mode that costs too much per yield).
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from types import FrameType

from .._core import MissingAwaitError, UBatch

__all__ = ["Marks", "Unawaited", "check_unawaited", "mark_unawaited", "marks"]


@dataclass(frozen=True, slots=True)
class Unawaited:
    """A primitive's awaitable that was handed out and not awaited (yet)."""

    primitive: str
    tag: str | None
    hazard: bool  # skipping it can give wrong numbers, not only lost overlap
    site: str | None = None  # "file:line in function" (debug mode)

    def describe(self, ub_id: int) -> str:
        where = f" (created at {self.site})" if self.site else ""
        call = f"{self.primitive}({self.tag!r})" if self.tag is not None else f"{self.primitive}()"
        why = (
            "the stream switch and its wait did not happen, so what the ubatch read since may be comm output "
            "that had not arrived yet"
            if self.hazard
            else "it did not hand over, so nothing overlapped there"
        )
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


def check_unawaited(ub: UBatch) -> None:
    """Report the awaitable ``ub`` left unawaited, if any (see the module docstring)."""
    pending = ub.unawaited
    if pending is None:
        return
    ub.unawaited = None
    record = pending if isinstance(pending, Unawaited) else Unawaited("dbo_yield", str(pending), hazard=False)
    message = record.describe(ub.id)
    if record.hazard or ub.debug is not None:
        raise MissingAwaitError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


# Outside debug mode a mark has no call site, so one record per primitive and tag serves every
# call: the hot path is a dict lookup instead of building a frozen dataclass per primitive call
# (benchmarks/host_overhead.py). Bounded, for code that makes a fresh tag per call.
_MAX_MARKS = 4096


class Marks:
    """One primitive's shared (site-less) marks by tag, made on first use. The hot path reads
    ``table`` directly (``table.get(tag) or marks.make(tag)``): a plain dict's ``get`` is about
    half the cost of a subscript on a dict subclass with ``__missing__`` (timeit, 33 against 59 ns)."""

    __slots__ = ("primitive", "hazard", "table")

    def __init__(self, primitive: str, hazard: bool) -> None:
        self.primitive, self.hazard = primitive, hazard
        self.table: dict[str | None, Unawaited] = {}

    def make(self, tag: str | None) -> Unawaited:
        record = Unawaited(self.primitive, tag, self.hazard)
        if len(self.table) < _MAX_MARKS:
            self.table[tag] = record
        return record

    def of(self, tag: str | None) -> Unawaited:
        return self.table.get(tag) or self.make(tag)


_MARKS: dict[tuple[str, bool], Marks] = {}


def marks(primitive: str, *, hazard: bool = True) -> Marks:
    """The shared marks of ``primitive`` (one :class:`Marks` per primitive and hazard)."""
    found = _MARKS.get((primitive, hazard))
    if found is None:
        found = _MARKS[(primitive, hazard)] = Marks(primitive, hazard)
    return found


def mark_unawaited(ub: UBatch, primitive: str, tag: str | None, *, hazard: bool) -> None:
    """Called by an awaitable primitive (from its caller's frame + 1): report a previous one left
    unawaited, then mark this one (with its call site in debug mode)."""
    if ub.unawaited is not None:
        check_unawaited(ub)
    if ub.debug is None:
        ub.unawaited = marks(primitive, hazard=hazard).of(tag)
    else:
        ub.unawaited = Unawaited(primitive, tag, hazard, _site(3))
