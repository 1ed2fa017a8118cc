"""Test that a layer hands over control where you expect: ``assert_yields`` / ``assert_no_yields``.

Usable inside a ubatch (trio's ``assert_checkpoints`` idea), as ``with`` or ``async with``::

    async def forward(x):
        with assert_yields("dispatch", "combine"):
            x = await moe_layer(x)
        with assert_no_yields():
            x = norm(x)          # must not hand over mid-norm
        return x

    await run_ubatches(forward, [(x0,), (x1,)])

A *yield* is a handover through ``dbo_yield`` or a ``dbo_yield_and_switch_*`` primitive; parking on
a comm completion or an event is not one (whether it happens depends on timing). Expect either the
exact tags in order or a count (``assert_yields(3)``).

How yields are seen: every yield primitive sets ``ub.tag`` just before it suspends, and nothing
else sets it. While a helper is active, the ubatch's class is switched to a subclass whose ``tag``
setter also logs the tag; on exit the class is switched back. This catches the yield that ends the
current scheduler step too (wrapping the resume function would miss it), and costs nothing outside
the helper.
"""

from __future__ import annotations

import contextvars
from types import TracebackType
from typing import Any

from .._core import UBatch, get_ubatch

__all__ = ["assert_no_yields", "assert_yields"]

# The slot descriptor of UBatch.tag, which the subclass property below stores through.
_slot_tag: Any = UBatch.__dict__["tag"]

# The logs of the helpers active in the running ubatch (set inside the ubatch: its own context).
_LOGS: contextvars.ContextVar[list[list[str | None]]] = contextvars.ContextVar("asyncdbo_yield_logs")


class _LoggingUBatch(UBatch):
    """A UBatch whose tag writes (one per yield) are appended to the active logs."""

    __slots__ = ()

    @property
    def tag(self) -> str | None:
        value: str | None = _slot_tag.__get__(self)
        return value

    @tag.setter
    def tag(self, value: str | None) -> None:
        _slot_tag.__set__(self, value)
        for log in _LOGS.get(()):
            log.append(value)


class _YieldAssertion:
    def __init__(self, expected: tuple[str, ...] | int) -> None:
        self.expected = expected
        self.log: list[str | None] = []
        self.ub: UBatch | None = None

    def __enter__(self) -> _YieldAssertion:
        ub = get_ubatch()
        self.ub = ub
        if ub is None:
            return self
        logs = _LOGS.get(None)
        if logs is None:
            logs = []
            _LOGS.set(logs)
        logs.append(self.log)
        if type(ub) is UBatch:
            ub.__class__ = _LoggingUBatch
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        ub = self.ub
        if ub is not None:
            logs = _LOGS.get()
            logs.remove(self.log)
            if not logs and type(ub) is _LoggingUBatch:
                ub.__class__ = UBatch  # type: ignore[assignment]
        if et is None:
            self._check()

    async def __aenter__(self) -> _YieldAssertion:
        return self.__enter__()

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.__exit__(et, exc, tb)

    def _check(self) -> None:
        where = "outside a DBO run, where the primitives never yield" if self.ub is None else f"in ubatch {self.ub.id}"
        if isinstance(self.expected, int):
            if len(self.log) != self.expected:
                raise AssertionError(
                    f"expected {self.expected} yield(s) {where}, but the block yielded {len(self.log)} time(s): {self.log}"
                )
        elif tuple(self.log) != self.expected:
            raise AssertionError(f"expected yields {list(self.expected)} {where}, but the block yielded {self.log}")


def assert_yields(*expected: Any) -> _YieldAssertion:
    """Assert that the block yields exactly these tags, in order (or ``assert_yields(n)``: n times)."""
    if len(expected) == 1 and isinstance(expected[0], int) and not isinstance(expected[0], bool):
        if expected[0] < 0:
            raise ValueError(f"assert_yields count must be >= 0 (got {expected[0]})")
        return _YieldAssertion(expected[0])
    if not expected or not all(isinstance(t, str) for t in expected):
        raise ValueError(
            f"assert_yields takes the expected yield tags (strings) or one count, got {expected!r}; "
            "use assert_no_yields() for a block that must not yield"
        )
    return _YieldAssertion(tuple(expected))


def assert_no_yields() -> _YieldAssertion:
    """Assert that the block never hands over to another ubatch."""
    return _YieldAssertion(0)
