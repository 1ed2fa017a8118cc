"""A finished run frees its records in C (``asyncdbo._core._spin.release``) exactly as the Python
loop of ``Endings._release_records`` does: the same reads and stores in the same order, each
replaced value released at its store (a finalizer sees the fields stored before it) but the
result, which both return (the kernel's run hands it to its caller), a record whose ``__class__``
a finalizer reassigns is written through its attributes from then on, a subclass record through
its own ``__setattr__`` (whose error propagates, the rest left as they are), and the entry points
refuse wrong arguments with errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from asyncdbo._core import fastpath
from asyncdbo._core.endings import Endings
from asyncdbo._core.kernel import DBORun
from asyncdbo._core.ubatch import UBatch

needs_c = pytest.mark.skipif(fastpath.C is None, reason="the C kernel extension is not loaded here")

FIELDS = ("coro", "ctx", "ctx_run", "send", "resume", "ext", "waker", "parked_on", "result", "resume_with", "debug",
          "unawaited", "run")


class Logged(UBatch):
    """A record that logs every store (and refuses one to ``waker`` where told to)."""

    __slots__ = ()
    log: list[str] = []
    refuse = False

    def __setattr__(self, name: str, value: Any) -> None:
        Logged.log.append(f"set {name}")
        if name == "waker" and Logged.refuse:
            raise AttributeError("waker refused")
        super().__setattr__(name, value)


class Finalized:
    """A field value whose finalizer logs which fields of its record are already None, and may
    reassign the record's class."""

    def __init__(self, ub: UBatch, name: str, log: list[str], swap: bool) -> None:
        self.ub, self.name, self.log, self.swap = ub, name, log, swap

    def __del__(self) -> None:
        cleared = [f for f in FIELDS if getattr(self.ub, f, "deleted") is None]
        self.log.append(f"{self.name} freed after {cleared}")
        if self.swap:
            self.ub.__class__ = Logged


def released_with(release: Callable[[DBORun], object], swap_at: str | None, refuse: bool) -> list[str]:
    run = DBORun.released(3)
    log: list[str] = []
    Logged.log, Logged.refuse = log, refuse
    for ub in run.ubatches:
        for name in FIELDS:
            object.__setattr__(ub, name, Finalized(ub, f"ub{ub.id}.{name}", log, swap=name == swap_at and ub.id == 1))
    try:
        results = release(run)
    except AttributeError as exc:
        log.append(f"raised {exc}")
    else:
        log.append(f"returned {[r.name for r in results]}")  # type: ignore[attr-defined]
        del results  # the results' finalizers run here, after every store
    Logged.refuse = False
    for ub in run.ubatches:
        log.append(f"ub{ub.id} {type(ub).__name__}: " + " ".join(f for f in FIELDS if getattr(ub, f) is not None))
        for name in FIELDS:  # what a failed release left is freed here (its finalizers log alike on both)
            object.__setattr__(ub, name, None)
    return log


@needs_c
@pytest.mark.parametrize("swap_at", [None, "coro", "result", "run"])
@pytest.mark.parametrize("refuse", [False, True])
def test_the_c_release_stores_as_the_python_loop(swap_at: str | None, refuse: bool) -> None:
    spin = fastpath.C
    assert spin is not None
    python = released_with(Endings._release_records, swap_at, refuse)
    c = released_with(lambda run: spin.release(run.ubatches), swap_at, refuse)
    assert c == python
    # the spec itself: each value is freed at its own store, and a swapped record is written
    # through Logged's __setattr__ from the next store on
    assert python[:2] == ["ub0.coro freed after ['coro']", "ub0.ctx freed after ['coro', 'ctx']"]
    if swap_at is not None:  # (the result's finalizer runs only once the returned list is dropped)
        after = FIELDS[FIELDS.index(swap_at) + 1] if swap_at not in ("run", "result") else None
        assert (f"set {after}" in python) == (after is not None)
    assert ("raised waker refused" in python) == (refuse and swap_at == "coro")
    if "raised waker refused" not in python:
        assert "returned ['ub0.result', 'ub1.result', 'ub2.result']" in python
        # no result is freed before the release returns; each is freed after every store
        returned = python.index("returned ['ub0.result', 'ub1.result', 'ub2.result']")
        assert sorted(line.split()[0] for line in python[returned + 1:returned + 4]) == ["ub0.result", "ub1.result",
                                                                                          "ub2.result"]


@needs_c
def test_the_entry_points_refuse_bad_arguments_with_errors() -> None:
    spin = fastpath.C
    assert spin is not None
    errors = []
    for call in (lambda: spin.release(), lambda: spin.release((1,)), lambda: spin.spin(*([None] * 7)),
                 lambda: spin.spin(None, None, None, [], None, None, None, None)):
        try:
            call()
        except TypeError as exc:
            errors.append(str(exc))
    assert errors == [
        "release() takes 1 arguments (0 given)",
        "release(): ubatches must be a list",
        "spin() takes 8 arguments (7 given)",
        "spin(): run must be the DBORun whose ubatches it resumes, not None",
    ]
