"""A comm work for the host backend that the test completes by hand: the parts of a torch
``Work`` and its future that ``dbo_submit`` on the host backend uses (no torch, no gloo), so the
specs that run without torch (CI's Python 3.12 and 3.13 runs of tests/dbo) can submit one."""

from __future__ import annotations

from typing import Any


class HandFuture:
    """A future whose callbacks run when the test calls :meth:`complete`."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def add_done_callback(self, fn: Any) -> None:
        self.callbacks.append(fn)

    def value(self) -> None:
        return None

    def complete(self) -> None:
        for fn in self.callbacks:
            fn(self)


class HandWork:
    """A work whose future is a :class:`HandFuture` (``work.fut.complete()`` completes it)."""

    def __init__(self) -> None:
        self.fut = HandFuture()

    def get_future(self) -> HandFuture:
        return self.fut
