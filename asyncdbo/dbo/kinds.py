"""The four kinds of yield and switch primitive, and :func:`declare`, which makes one from a row.

A primitive is a row of :mod:`asyncdbo.dbo.table` (name, kind, stream move, default tag, what
dropping its ``await`` risks, docstring). :func:`declare` turns the row into the Python reference
of its kind (below), the C fast path of the same kind where ``asyncdbo/dbo/_speedups.c`` is built
(a ``Primitive`` object given the row's tag, roles and missing-await marks), and the entries of
:data:`TABLE`, :data:`PURE` and :data:`FAST` that the exports, the missing-await reports and the
differential tests read. A primitive of an existing kind is one row; a new kind is a new function
here, its twin in ``_speedups.c`` and a case in tests/native/test_differential.py
(docs/maintaining.md).

Ordering follows vLLM exactly: a ubatch records its done-event on the stream it leaves *before* it
yields, and the stream it enters waits on that event *after* it resumes.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

from .._core import SWITCH, Signal, UBatch, WrongStreamError, current_ubatch, load_extension, switch
from ..backends import COMPLETED, Role
from .awaits import check_unawaited, made_at, mark_unawaited, marks
from .state import Lane

__all__ = ["FAST", "PURE", "TABLE", "Kind", "PrimitiveRow", "Risk", "Tagged", "Untagged", "declare"]

#: ``yield``: hand over, stay on the stream; ``role``: record on the stream left, hand over, enter
#: the other role after its event; ``sync``: record, enter the other role after its event, no
#: handover; ``plain``: enter the other role at call time, no dependency, no handover.
Kind = Literal["yield", "role", "sync", "plain"]
#: What a dropped ``await`` costs: ``overlap`` (a warning: nothing handed over there), ``data``
#: (an error: a stream switch or its wait did not happen), ``nothing`` (acts at call time).
Risk = Literal["overlap", "data", "nothing"]


@dataclass(frozen=True, slots=True)
class PrimitiveRow:
    """One primitive, as :mod:`asyncdbo.dbo.table` declares it."""

    name: str
    kind: Kind
    src: Role | None  # the role it must be called on (``role``), else None
    dst: Role | None  # the role it enters, None for ``yield``
    tag: str | None  # the default tag (``yield``, ``role``), else None
    risk: Risk
    doc: str
    module: str = "asyncdbo.dbo.table"

    def __post_init__(self) -> None:
        moves = {"yield": (False, False, True), "role": (True, True, True), "sync": (False, True, False),
                 "plain": (False, True, False)}
        if self.kind not in moves:
            raise ValueError(f"primitive {self.name}: kind must be one of {sorted(moves)} (got {self.kind!r})")
        src, dst, tag = moves[self.kind]
        if (self.src is not None) != src or (self.dst is not None) != dst or (self.tag is not None) != tag:
            raise ValueError(
                f"primitive {self.name}: a {self.kind} primitive takes "
                f"{'a' if src else 'no'} src, {'a' if dst else 'no'} dst and {'a' if tag else 'no'} default tag "
                f"(got src={self.src!r}, dst={self.dst!r}, tag={self.tag!r})"
            )
        if self.risk not in ("overlap", "data", "nothing"):
            raise ValueError(f"primitive {self.name}: risk must be overlap, data or nothing (got {self.risk!r})")


class Tagged(Protocol):
    """A ``yield`` or ``role`` primitive: ``await p(tag)``."""

    __name__: str

    def __call__(self, tag: str = ...) -> Awaitable[None]: ...


class Untagged(Protocol):
    """A ``sync`` or ``plain`` primitive: ``await p()``."""

    __name__: str

    def __call__(self) -> Awaitable[None]: ...


#: Every declared primitive's row, by name, in declaration order.
TABLE: dict[str, PrimitiveRow] = {}
#: The Python implementations, by name: the reference the C fast paths fall back to (and what
#: tests/dbo/test_speedups.py and tests/native/ run side by side with them).
PURE: dict[str, Callable[..., Any]] = {}

_get_ubatch = current_ubatch.get


# --------------------------------------------------------------------------- the kinds, in Python
def _check_role(ub: UBatch, lane: Lane, expected: Role, name: str) -> None:
    if lane.role != expected:
        raise WrongStreamError(
            f"{name}() called in ubatch {ub.id} while it is on the {lane.role} stream; it must be on the "
            f"{expected} stream (last yield point {ub.tag!r}). Check the order of switches in this layer."
        )


@types.coroutine
def _yield_and_switch(ub: UBatch, lane: Lane, tag: str, src: Role, dst: Role) -> Generator[Any, Any, None]:
    ub.unawaited = None
    event = lane.events[src]  # None: a synchronous role, nothing to record or wait on
    if event is not None:
        lane.record(event, lane.streams[src])  # before the yield: covers only this ubatch's work
    ub.tag = tag
    yield SWITCH  # trap(SWITCH) inlined: one generator frame less on every resume
    lane.role = dst
    lane.stream = ub.resume_with = stream = lane.streams[dst]  # lane.set_stream, inlined
    if lane.install is not None:
        lane.install(stream)
    if event is not None:
        signal = lane.wait(stream, event)  # after the resume
        if signal is not None:
            yield from signal.__await__()


@types.coroutine
def _then_wait(ub: UBatch, signal: Signal | None) -> Generator[Any, Any, None]:
    ub.unawaited = None
    if signal is not None:
        yield from signal.__await__()


# Outside debug mode a primitive's missing-await mark is shared by every call with its tag
# (asyncdbo.dbo.awaits.Marks): the hot path is one lookup in a plain dict.
def _yield_kind(row: PrimitiveRow) -> Callable[..., Awaitable[None]]:
    name, hazard, default = row.name, row.risk == "data", row.tag
    shared = marks(name, hazard=hazard)
    get, make = shared.table.get, shared.make

    def primitive(tag: str = default) -> Awaitable[None]:  # type: ignore[assignment]
        ub = _get_ubatch(None)
        if ub is None:
            return COMPLETED
        if ub.unawaited is not None or ub.debug is not None:
            mark_unawaited(ub, name, tag, hazard=hazard)
        else:
            ub.unawaited = get(tag) or make(tag)
            ub.unawaited_at = made_at(1)
        ub.tag = tag
        return switch(ub)

    return primitive


def _role_kind(row: PrimitiveRow) -> Callable[..., Awaitable[None]]:
    name, hazard, default = row.name, row.risk == "data", row.tag
    src: Role = row.src  # type: ignore[assignment]
    dst: Role = row.dst  # type: ignore[assignment]
    shared = marks(name, hazard=hazard)
    get, make = shared.table.get, shared.make

    def primitive(tag: str = default) -> Awaitable[None]:  # type: ignore[assignment]
        ub = _get_ubatch(None)
        if ub is None:
            return COMPLETED
        if ub.unawaited is not None or ub.debug is not None:
            mark_unawaited(ub, name, tag, hazard=hazard)
        else:
            ub.unawaited = get(tag) or make(tag)
            ub.unawaited_at = made_at(1)
        lane = ub.ext
        if lane.role != src:
            _check_role(ub, lane, src, name)
        return _yield_and_switch(ub, lane, tag, src, dst)

    return primitive


def _sync_kind(row: PrimitiveRow) -> Callable[..., Awaitable[None]]:
    name, hazard = row.name, row.risk == "data"
    dst: Role = row.dst  # type: ignore[assignment]
    mark = marks(name, hazard=hazard).of(None)

    def primitive() -> Awaitable[None]:
        ub = _get_ubatch(None)
        if ub is None:
            return COMPLETED
        lane: Lane = ub.ext
        if ub.unawaited is not None or ub.debug is not None:
            mark_unawaited(ub, name, None, hazard=hazard)
        else:
            ub.unawaited = mark
            ub.unawaited_at = made_at(1)
        event = lane.events[lane.role]  # None: a synchronous role, nothing to record or wait on
        if event is not None:
            lane.record(event, lane.stream)
        lane.role = dst
        lane.stream = ub.resume_with = stream = lane.streams[dst]  # lane.set_stream, inlined
        if lane.install is not None:
            lane.install(stream)
        return _then_wait(ub, None if event is None else lane.wait(stream, event))  # a failed comm raises when awaited

    return primitive


def _plain_kind(row: PrimitiveRow) -> Callable[..., Awaitable[None]]:
    dst: Role = row.dst  # type: ignore[assignment]

    def primitive() -> Awaitable[None]:
        ub = _get_ubatch(None)
        if ub is None:
            return COMPLETED
        if ub.unawaited is not None:
            check_unawaited(ub, stacklevel=3)
        lane: Lane = ub.ext
        lane.role = dst
        lane.stream = ub.resume_with = stream = lane.streams[dst]  # lane.set_stream, inlined
        if lane.install is not None:
            lane.install(stream)
        return COMPLETED

    return primitive


_KINDS = {"yield": _yield_kind, "role": _role_kind, "sync": _sync_kind, "plain": _plain_kind}


# ------------------------------------------------------------------------------- the C fast paths
def _speedups() -> Any:
    """``asyncdbo/dbo/_speedups.c``, configured, or None where it was not built (no compiler at
    install time) or ``ASYNCDBO_PURE_PYTHON=1`` is set. Each of its ``Primitive`` objects handles
    only the common case and calls its Python version for everything else (see the C file's
    header), so behaviour and error messages are the Python ones."""
    ext = load_extension("asyncdbo.dbo._speedups")
    if ext is not None:
        ext.configure(current_ubatch, UBatch, Lane, SWITCH, COMPLETED)
    return ext


_SPEEDUPS = _speedups()
#: The C fast paths in use, by name (None: the pure-Python primitives run).
FAST: dict[str, Callable[..., Any]] | None = None if _SPEEDUPS is None else {}


def build(row: PrimitiveRow) -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    """(the Python reference, the C fast path or None) of ``row``, registered nowhere."""
    pure = _KINDS[row.kind](row)
    pure.__name__ = pure.__qualname__ = row.name
    pure.__module__, pure.__doc__ = row.module, row.doc
    if _SPEEDUPS is None:
        return pure, None
    shared: object = None
    if row.kind in ("yield", "role"):
        shared = marks(row.name, hazard=row.risk == "data").table
    elif row.kind == "sync":
        shared = marks(row.name, hazard=row.risk == "data").of(None)
    fast = _SPEEDUPS.Primitive(pure, row.kind, tag=row.tag, src=row.src, dst=row.dst, marks=shared)
    return pure, fast


@overload
def declare(name: str, kind: Literal["yield", "role"], *, src: Role | None = None, dst: Role | None = None,
            tag: str, risk: Risk, doc: str) -> Tagged: ...
@overload
def declare(name: str, kind: Literal["sync", "plain"], *, src: Role | None = None, dst: Role | None = None,
            tag: None = None, risk: Risk, doc: str) -> Untagged: ...
def declare(name: str, kind: Kind, *, src: Role | None = None, dst: Role | None = None, tag: str | None = None,
            risk: Risk, doc: str) -> Any:
    """Register a primitive of an existing kind and return the implementation in use (C where
    built, else Python). Called once per row, by :mod:`asyncdbo.dbo.table`."""
    if name in TABLE:
        raise ValueError(f"primitive {name} is declared twice")
    row = PrimitiveRow(name, kind, src, dst, tag, risk, doc)
    pure, fast = build(row)
    TABLE[name], PURE[name] = row, pure
    if FAST is not None and fast is not None:
        FAST[name] = fast
        return fast
    return pure
