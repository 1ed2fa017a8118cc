"""Adversarial programs for the C extensions, run in a subprocess by test_adversarial.py.

``python _adversarial.py GROUP...`` runs every case of each group on each kernel loop this process
has (the C loop, if loaded, and the Python loop) and prints one JSON object: case -> the outcome
on each loop (the run's result, or its exception's type, message and notes, and the warnings it
gave). Under ``ASYNCDBO_PURE_PYTHON=1`` that is the reference every C outcome must equal; a crash
of the process is a failed test of its group only. ``python _adversarial.py --each LIMIT_S
GROUP...`` runs each group so in its own child forked from one driver (_fork_each.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from _recording_backend import RecordingBackend  # noqa: E402

import asyncdbo  # noqa: E402
from asyncdbo import run_ubatches  # noqa: E402
from asyncdbo._core import fastpath  # noqa: E402
from asyncdbo.lowlevel import Signal, get_ubatch  # noqa: E402

UB_FIELDS = ["unawaited", "unawaited_at", "debug", "ext", "tag", "resume_with"]
KERNEL_FIELDS = ["resume", "send", "coro", "ctx", "resume_with"]
LANE_FIELDS = ["role", "stream", "streams", "events", "record", "wait", "install"]


def call(name: str) -> Callable[[], Any]:
    """The public primitive, looked up at call time (C or Python, whichever this process runs)."""
    return lambda: getattr(asyncdbo, name)()


PRIMS = {
    "yield": call("dbo_yield"),
    "to_comm": call("dbo_yield_and_switch_from_compute_to_comm"),
    "sync": call("dbo_switch_to_compute_sync"),
    "plain": call("dbo_switch_to_comm"),
}


async def use(prim: str) -> None:
    aw = PRIMS[prim]()
    if prim != "plain":
        await aw


def deleted(owner: str, field: str, prim: str, *, after_call: bool) -> Callable[[int], Awaitable[Any]]:
    """Ubatch 0 deletes ``field`` of its UBatch or Lane, before calling ``prim`` or between the
    call and the await."""

    async def program(i: int) -> int:
        await asyncdbo.dbo_yield("first")
        ub = get_ubatch()
        target = ub if owner == "ub" else ub.ext
        if i == 0 and not after_call:
            delattr(target, field)
        aw = PRIMS[prim]()
        if i == 0 and after_call:
            delattr(target, field)
        if prim != "plain":
            await aw
        await asyncdbo.dbo_yield("last")
        return i

    return program


class ReentrantBackend(RecordingBackend):
    """Its install, or the signal its wait returns, sends into the running ubatch's own awaitable
    (the one whose resume or wait called it)."""

    def __init__(self, where: str) -> None:
        super().__init__([])
        self.where = where
        self.held: dict[int, Any] = {}

    def reenter(self) -> None:
        ub = get_ubatch()  # None: the kernel's install before a resume, outside any ubatch
        aw = None if ub is None else self.held.pop(ub.id, None)
        if aw is not None:
            aw.send(None)

    @property
    def install_stream(self) -> Any:
        def install(stream: Any) -> None:
            if self.where == "install":
                self.reenter()

        return install

    def wait(self, stream: Any, event: Any) -> Any:
        if self.where != "wait":
            return None
        backend = self

        class Reenter:
            def __await__(self) -> Any:
                backend.reenter()  # into the awaitable whose wait this is
                yield from ()

        return Reenter()


def reentrant(backend: ReentrantBackend, prim: str) -> Callable[[int], Awaitable[Any]]:
    async def program(i: int) -> int:
        await asyncdbo.dbo_yield_and_switch_from_compute_to_comm("dispatch")
        aw = (asyncdbo.dbo_yield_and_switch_from_comm_to_compute if prim == "role" else asyncdbo.dbo_switch_to_compute_sync)()
        backend.held[i] = aw
        await aw
        return i

    return program


def by_hand(kind: str) -> Callable[[int], Awaitable[Any]]:
    async def program(i: int) -> Any:
        if kind == "send_value":
            aw = asyncdbo.dbo_yield("by hand")
            try:
                aw.send(1)  # type: ignore[attr-defined]
            except TypeError as exc:
                return f"TypeError: {exc}"
            return "accepted"
        if kind == "class_attribute":

            class Model:
                hand_over = asyncdbo.dbo_yield

                def __repr__(self) -> str:
                    return "<Model>"

            await Model().hand_over()
            return repr(get_ubatch().tag)
        if kind == "replace_coro":

            async def other() -> str:
                return "the replacement ran"

            ub = get_ubatch()
            replacement = other()
            ub.coro = replacement
            await asyncdbo.dbo_yield()
            replacement.close()
            return "the original ran"
        if kind == "throw_into_fresh":
            aw = asyncdbo.dbo_yield("thrown")
            try:
                aw.throw(KeyError("k"))  # type: ignore[attr-defined]
            except KeyError as exc:
                return f"KeyError: {exc}"
            return "nothing"
        if kind == "throw_arity":  # a role step's throw() given 0, 4 and 5 arguments, then awaited
            out = []
            for args in [(), (ValueError, None, None, None), (ValueError, None, None, None, None)]:
                aw = asyncdbo.dbo_yield_and_switch_from_compute_to_comm("arity")
                try:
                    aw.throw(*args)  # type: ignore[attr-defined]
                except TypeError as exc:
                    out.append(f"TypeError: {exc}")
                await aw
                await asyncdbo.dbo_yield_and_switch_from_comm_to_compute("back")
            return out
        if kind == "close_then_send":
            aw = asyncdbo.dbo_yield_and_switch_from_compute_to_comm("closed")
            aw.close()  # type: ignore[attr-defined]
            try:
                aw.send(None)  # type: ignore[attr-defined]
            except StopIteration:
                return "StopIteration"
            return "sent"
        raise AssertionError(kind)

    return program


def site(kind: str) -> Callable[[int], Awaitable[Any]]:
    """Where a primitive records its caller (``ub.unawaited_at``), which the C primitives refill in
    place while nothing else holds it: a pair the program kept, a code object that the refill
    frees (its weakref callback reads the ubatch), and a pair the collector untracked."""
    import gc
    import weakref

    from asyncdbo.dbo.awaits import site_of

    async def program(i: int) -> Any:
        ub = get_ubatch()
        if kind == "kept":
            aw = asyncdbo.dbo_yield("a")
            kept = ub.unawaited_at
            before = tuple(kept)
            await aw
            await asyncdbo.dbo_yield("b")
            return [kept == before, kept is ub.unawaited_at, site_of(kept), site_of(ub.unawaited_at)]
        if kind == "freed_code":
            seen: list[Any] = []
            scope: dict[str, Any] = {}
            exec(compile("def make(prim):\n    return prim('made')\n", f"<made {i}>", "exec"), {}, scope)
            make = scope.pop("make")  # its globals are another dict: no cycle keeps it
            aw = make(asyncdbo.dbo_yield)
            ref = weakref.ref(make.__code__, lambda _: seen.append((site_of(ub.unawaited_at), ub.unawaited)))
            del make
            await aw
            await asyncdbo.dbo_yield("next")  # the pair of make's site is refilled: make's code goes
            return [seen, ref() is None]
        if kind == "untracked":
            await asyncdbo.dbo_yield("a")
            gc.collect()  # a pair of untracked items is untracked by the collection
            before = gc.is_tracked(ub.unawaited_at)
            aw = asyncdbo.dbo_yield("b")
            after = gc.is_tracked(ub.unawaited_at)
            await aw
            return [before, after, site_of(ub.unawaited_at)]
        raise AssertionError(kind)

    return program


def cases(group: str) -> dict[str, tuple[Callable[[int], Awaitable[Any]], dict[str, Any]]]:
    """The cases of a group: name -> (program, run_ubatches options)."""
    out: dict[str, tuple[Callable[[int], Awaitable[Any]], dict[str, Any]]] = {}
    if group.startswith("ub.") or group.startswith("lane."):
        owner, field = group.split(".")
        for prim in PRIMS:
            for after in (False, True):
                for backend in ("host", "recording"):
                    opts = {"backend": RecordingBackend([]) if backend == "recording" else "host"}
                    out[f"{prim} {'after' if after else 'before'} the call, {backend}"] = (
                        deleted(owner, field, prim, after_call=after), opts)
    elif group.startswith("kernel."):
        field = group.split(".")[1]
        out["yield"] = (deleted("ub", field, "yield", after_call=False), {"backend": "host"})
    elif group == "reentry":
        for where, prim in (("install", "role"), ("wait", "role"), ("wait", "sync")):
            if True:
                backend = ReentrantBackend(where)
                out[f"{prim} from {where}"] = (reentrant(backend, prim), {"backend": backend})
    elif group == "by_hand":
        for kind in ("send_value", "class_attribute", "replace_coro", "throw_into_fresh", "close_then_send"):
            out[kind] = (by_hand(kind), {"backend": "host"})
        out["throw_arity"] = (by_hand("throw_arity"), {"backend": RecordingBackend([])})
    elif group == "site":
        for kind in ("kept", "freed_code", "untracked"):
            out[kind] = (site(kind), {"backend": "host"})
    elif group == "configure":
        out["after a failed configure"] = (configure_misuse(), {"backend": RecordingBackend([])})
    elif group == "primitive_new":
        out["after refused constructions"] = (primitive_new_misuse(), {"backend": RecordingBackend([])})
    else:
        raise SystemExit(f"unknown group {group!r}")
    return out


class NoSlots:
    pass


class Foreign:
    """Borrows the real classes' member descriptors: its own instances have no such slots."""


def configure_misuse() -> Callable[[int], Awaitable[Any]]:
    """Every kind of bad configure() is refused and leaves the extensions working."""
    from asyncdbo._core import SWITCH, UBatch, current_ubatch
    from asyncdbo.backends import COMPLETED
    from asyncdbo.dbo import primitives
    from asyncdbo.dbo.state import Lane

    for name in ("resume", "resume_with", "unawaited", "unawaited_at", "debug", "ext", "tag"):
        setattr(Foreign, name, getattr(UBatch, name))
    for name in LANE_FIELDS:
        setattr(Foreign, name, getattr(Lane, name))
    refused = []
    spin = fastpath.C or sys.modules.get("asyncdbo._core._spin")
    if spin is not None:
        for bad in (NoSlots, Foreign, 3):
            try:
                spin.configure(bad)
            except (TypeError, AttributeError) as exc:
                refused.append(str(exc))
    speedups = sys.modules.get("asyncdbo.dbo._speedups")
    if speedups is not None:
        for ubt, lanet in ((UBatch, Foreign), (Foreign, Lane), (UBatch, NoSlots)):
            try:
                speedups.configure(current_ubatch, ubt, lanet, SWITCH, COMPLETED)
            except (TypeError, AttributeError) as exc:
                refused.append(str(exc))
    assert primitives.FAST is None or len(refused) == (6 if spin is not None else 3), refused

    async def program(i: int) -> int:
        for _ in range(3):
            await asyncdbo.dbo_yield_and_switch_from_compute_to_comm("dispatch")
            await asyncdbo.dbo_switch_to_compute_sync()
            await asyncdbo.dbo_yield()
        return i

    return program


#: (args, kwargs, what _speedups.Primitive(*args, **kwargs) raises): every argument by position and
#: by keyword, missing, doubled, of the wrong type, and kinds that only look like a valid one. A
#: keyword ``kind`` was read back from the positional tuple for the message and crashed (issue 48).
PRIMITIVE_NEW_CASES: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
    ((print, "bogus"), {}, "ValueError: Primitive kind must be yield, role, sync or plain (got 'bogus')"),
    ((print,), {"kind": "bogus"}, "ValueError: Primitive kind must be yield, role, sync or plain (got 'bogus')"),
    ((), {"pyfunc": print, "kind": "bogus"}, "ValueError: Primitive kind must be yield, role, sync or plain (got 'bogus')"),
    ((print,), {"kind": "bogus", "tag": "t", "src": 1, "dst": 2, "marks": {}},
     "ValueError: Primitive kind must be yield, role, sync or plain (got 'bogus')"),
    ((print,), {"kind": "yield\x00"}, "ValueError: Primitive kind must be yield, role, sync or plain (got 'yield\\x00')"),
    ((print,), {"kind": "yiel"}, "ValueError: Primitive kind must be yield, role, sync or plain (got 'yiel')"),
    ((print,), {"kind": "\udcff"}, "ValueError: Primitive kind must be yield, role, sync or plain (got '\\udcff')"),
    ((print,), {"kind": 3}, "TypeError: Primitive() argument 2 must be str, not int"),
    ((print,), {"kind": b"yield"}, "TypeError: Primitive() argument 2 must be str, not bytes"),
    ((print,), {}, "TypeError: Primitive() missing required argument 'kind' (pos 2)"),
    ((), {}, "TypeError: Primitive() missing required argument 'pyfunc' (pos 1)"),
    ((print, "yield"), {"kind": "yield"}, "TypeError: argument for Primitive() given by name ('kind') and position (2)"),
    ((print, "yield", None, None, None, None, None), {}, "TypeError: Primitive() takes at most 6 arguments (7 given)"),
    ((print,), {"kind": "yield", "bogus": 1}, "TypeError: 'bogus' is an invalid keyword argument for Primitive()"),
    ((3,), {"kind": "yield"}, "TypeError: Primitive needs a callable Python implementation (got 3)"),
    ((print,), {"kind": "yield"}, "TypeError: a yield primitive needs its marks dict (got None)"),
    ((print,), {"kind": "role"}, "TypeError: a role primitive needs its marks dict (got None)"),
    ((print,), {"kind": "role", "marks": []}, "TypeError: a role primitive needs its marks dict (got [])"),
]


def primitive_new_misuse() -> Callable[[int], Awaitable[Any]]:
    """Every bad construction of the C primitive raises its TypeError or ValueError (never a crash)
    and leaves the primitives working. The pure-Python primitives are functions: there the
    program alone runs, the reference that the C run's outcome must equal."""
    speedups = sys.modules.get("asyncdbo.dbo._speedups")
    if speedups is not None:
        got = []
        for args, kwargs, _ in PRIMITIVE_NEW_CASES:
            try:
                speedups.Primitive(*args, **kwargs)
                got.append("no error")
            except (TypeError, ValueError) as exc:
                got.append(f"{type(exc).__name__}: {exc}")
        # CPython 3.13 words an unknown keyword differently; the refusal is the same
        got = [re.sub(r"^TypeError: Primitive\(\) got an unexpected keyword argument '(\w+)'$",
                      r"TypeError: '\1' is an invalid keyword argument for Primitive()", g) for g in got]
        want = [w for _, _, w in PRIMITIVE_NEW_CASES]
        assert got == want, [(g, w) for g, w in zip(got, want) if g != w]
        made = speedups.Primitive(print, kind="yield", tag="t", marks={})  # all by keyword: accepted
        assert made.__name__ == "print", made

    async def program(i: int) -> int:
        for _ in range(2):
            await asyncdbo.dbo_yield_and_switch_from_compute_to_comm("dispatch")
            await asyncdbo.dbo_switch_to_compute_sync()
            await asyncdbo.dbo_yield()
        return i

    return program


def outcome(program: Callable[[int], Awaitable[Any]], opts: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = {"result": repr(asyncio.run(run_ubatches(program, [(0,), (1,)], **opts)))}
        except BaseException as exc:  # noqa: BLE001 - the outcome is what we compare
            result = {"raised": f"{type(exc).__name__}: {exc}", "notes": getattr(exc, "__notes__", [])}
    result["warnings"] = sorted(f"{w.category.__name__}: {w.message}" for w in caught)
    return result


def main(groups: list[str]) -> None:
    report: dict[str, dict[str, Any]] = {}
    for group in groups:
        for loop in fastpath.LOOPS:
            with fastpath.kernel_loop(loop):
                for name, (program, opts) in cases(group).items():
                    report.setdefault(f"{group}: {name}", {})[loop] = outcome(program, opts)
    json.dump(report, sys.stdout, indent=1, sort_keys=True)


if __name__ == "__main__":
    if sys.argv[1] == "--each":  # one forked child per group (_fork_each.py); the driver exits here
        from _fork_each import fork_each

        group = fork_each(sys.argv[3:], int(sys.argv[2]))
        if group is None:
            sys.exit(0)
        main([group])
    else:
        main(sys.argv[1:])
