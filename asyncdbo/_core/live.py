"""The registry of runs being driven right now (what ``asyncdbo.dump_stacks`` shows)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kernel import DBORun

__all__ = ["LIVE_RUNS"]


class _LiveRuns:
    """Runs being driven right now, in any task of this process (what ``asyncdbo.dump_stacks``
    shows; iterate it). Held weakly, through the one weak reference each run makes when it is
    built: a run goes in and out with no allocation, and one dropped without its drive ending
    (an abandoned coroutine) disappears with it."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        self.refs: set[weakref.ref[DBORun]] = set()

    def __iter__(self) -> Iterator[DBORun]:
        return iter([run for ref in list(self.refs) if (run := ref()) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def forget(self, ref: weakref.ref[DBORun]) -> None:
        self.refs.discard(ref)


LIVE_RUNS = _LiveRuns()
"""Runs being driven right now, in any task of this process; a run adds and removes itself
(``DBORun.drive``)."""
