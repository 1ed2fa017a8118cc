"""Adversarial cases of DBORun.restart's refill (``asyncdbo._core._spin.start``, whose reference
is the Python loop over ``UBatch._start``), one per process: ``python _start_cases.py CASE``
prints the case's outcome as JSON; ``python _start_cases.py --each LIMIT_S CASE...`` runs each
case so in its own forked child (_fork_each.py). tests/native/test_start.py runs each on the C
extension and under ``ASYNCDBO_PURE_PYTHON=1`` and compares."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from asyncdbo._core import fastpath
from asyncdbo._core.kernel import DBORun
from asyncdbo._core.traps import SWITCH
from asyncdbo._core.ubatch import UBatch, current_ubatch

FIELDS = ("run", "coro", "ctx", "ctx_run", "send", "resume", "state", "tag", "num_yields", "unawaited_at", "cancels")


def summary(run: DBORun, ub: Any) -> dict[str, Any]:
    """What the record holds, in terms both implementations share (their resume objects differ)."""
    out: dict[str, Any] = {"class": type(ub).__name__}
    for f in FIELDS:
        try:
            v = getattr(ub, f)
        except AttributeError as e:
            out[f] = f"AttributeError: {e}"
            continue
        if f == "run":
            out[f] = "the run" if v is run else repr(v)
        elif f == "ctx":
            out[f] = f"ctx, current ubatch {'is it' if v is not None and v.get(current_ubatch) is ub else 'not it'}"
        elif f == "ctx_run":
            out[f] = "ctx.run" if v is not None and v == ub.ctx.run else repr(v)
        elif f in ("send", "resume"):
            out[f] = "callable, send is resume" if callable(v) and ub.send is ub.resume else repr(v)
        elif f == "coro":
            out[f] = type(v).__name__
        else:
            out[f] = repr(v) if f != "state" else str(v)
    return out


async def body(i: int) -> int:
    await SWITCH_AWAIT()
    return i * 10


class _Switch:
    def __await__(self) -> Any:
        yield SWITCH


def SWITCH_AWAIT() -> _Switch:  # noqa: N802 - reads as the await it stands for
    return _Switch()


async def drive_once(n: int) -> DBORun:
    run = DBORun.released(n)
    run.restart([body(i) for i in range(n)])
    await run.drive()
    return run


def restart_and_drive(run: DBORun, coros: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        run.restart(coros)
    except BaseException as e:  # noqa: BLE001 - the outcome compared
        out["restart raised"] = f"{type(e).__name__}: {e}"
        for c in coros:
            if hasattr(c, "close"):
                c.close()
    out["records"] = [summary(run, ub) for ub in run.ubatches]
    if "restart raised" not in out:
        try:
            out["results"] = asyncio.run(run.drive())
        except BaseException as e:  # noqa: BLE001
            out["drive raised"] = f"{type(e).__name__}: {e}"
    return out


class Sub(UBatch):
    __slots__ = ()


class OwnStart(UBatch):
    __slots__ = ()
    log: list[str] = []

    def _start(self, run: Any, coro: Any) -> None:
        OwnStart.log.append(f"own _start of ub{self.id}")
        super()._start(run, coro)


def case_deleted(field: str) -> Callable[[], dict[str, Any]]:
    def case() -> dict[str, Any]:
        run = asyncio.run(drive_once(2))
        delattr(run.ubatches[0], field)
        return restart_and_drive(run, [body(i) for i in range(2)])
    return case


def case_own_start() -> dict[str, Any]:
    run = asyncio.run(drive_once(3))
    run.ubatches[1].__class__ = OwnStart
    out = restart_and_drive(run, [body(i) for i in range(3)])
    out["log"] = OwnStart.log
    return out


class SwapsOnSend:
    """A coroutine-like awaitable whose ``send`` lookup turns its record into a subclass."""

    def __init__(self, run: DBORun, i: int) -> None:
        self.run, self.i, self.inner = run, i, body(i)

    def __getattr__(self, name: str) -> Any:
        if name == "send":
            self.run.ubatches[self.i].__class__ = Sub
        return getattr(self.inner, name)


def case_class_swapped_by_send_lookup() -> dict[str, Any]:
    run = asyncio.run(drive_once(2))
    return restart_and_drive(run, [SwapsOnSend(run, 0), body(1)])


class NoSend:
    def close(self) -> None:
        pass


def case_no_send() -> dict[str, Any]:
    run = asyncio.run(drive_once(2))
    return restart_and_drive(run, [body(0), NoSend()])


class Finalizer:
    """A tag whose release (by the refill's store of ``tag``) looks at the record, and then
    turns it into a subclass or shrinks the run's list of records."""

    seen: list[Any] = []

    def __init__(self, run: DBORun, ub: UBatch, then: str) -> None:
        self.run, self.ub, self.then = run, ub, then

    def __del__(self) -> None:
        Finalizer.seen.append(summary(self.run, self.ub))
        if self.then == "swap":
            self.ub.__class__ = Sub
        elif self.then == "shrink":
            del self.run.ubatches[1:]


def case_finalizer(then: str) -> Callable[[], dict[str, Any]]:
    def case() -> dict[str, Any]:
        run = asyncio.run(drive_once(3))
        first = run.ubatches[0]
        first.num_yields, first.cancels = 7, 3  # so the finalizer shows which stores came before the tag's
        first.tag = Finalizer(run, first, then)
        coros = [body(i) for i in range(3)]
        out: dict[str, Any] = {}
        try:
            run.restart(coros)
        except BaseException as e:  # noqa: BLE001
            out["restart raised"] = f"{type(e).__name__}: {e}"
        out["records"] = [summary(run, ub) for ub in run.ubatches]
        out["seen by the finalizer"] = Finalizer.seen
        for c in coros:
            c.close()
        return out
    return case


def case_bad_arguments() -> dict[str, Any]:
    """The C entry point called wrongly (pure Python has none: the outcome is only 'no crash')."""
    spin = fastpath.C
    if spin is None:
        return {"c": "not loaded"}
    run = asyncio.run(drive_once(1))
    out = []
    for args in ((), (run.ubatches, run, [], current_ubatch), (tuple(run.ubatches), run, [], current_ubatch, None),
                 (run.ubatches, run, [], "not a var", None), (run.ubatches, run, [object()], current_ubatch, None)):
        try:
            spin.start(*args)
            out.append("ok")
        except BaseException as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return {"c": "loaded", "errors": out}


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    **{f"deleted {f}": case_deleted(f) for f in FIELDS},
    "own _start": case_own_start,
    "class swapped by the send lookup": case_class_swapped_by_send_lookup,
    "no send": case_no_send,
    "finalizer looks": case_finalizer("look"),
    "finalizer swaps the class": case_finalizer("swap"),
    "finalizer shrinks the list": case_finalizer("shrink"),
    "bad arguments": case_bad_arguments,
}

if __name__ == "__main__":
    if sys.argv[1] == "--each":  # one forked child per case (_fork_each.py); the driver exits here
        from _fork_each import fork_each

        chosen = fork_each(sys.argv[3:], int(sys.argv[2]))
        if chosen is None:
            sys.exit(0)
    else:
        chosen = sys.argv[1]
    result = CASES[chosen]()
    result["c extension"] = fastpath.C is not None
    print(json.dumps(result, default=repr))
