"""The C fast paths of the primitives (asyncdbo/dbo/_speedups.c) against their Python reference.

Each program below runs once on the pure-Python primitives (``primitives.PURE``) and once on the C
ones (``primitives.FAST``) and must leave the same whole trace, the same results and the same
errors, word for word: the C versions handle the common case and call the Python ones for the rest.
Every spec runs on both kernel loops (the C loop, asyncdbo/_core/_spin.c, and the Python loop).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _recording_backend import RecordingBackend

import asyncdbo
from asyncdbo import DeadlockError, run_ubatches
from asyncdbo.backends import COMPLETED
from asyncdbo.dbo import primitives
from asyncdbo.lowlevel import Signal, get_ubatch

# every spec on both kernel loops (tests/conftest.py)
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.usefixtures("kernel_loop")]

IMPLS = {"python": primitives.PURE, "c": primitives.FAST}


def impl(name: str) -> SimpleNamespace:
    table = IMPLS[name]
    if table is None:
        pytest.skip("the C extension is not built here (or ASYNCDBO_PURE_PYTHON is set)")
    return SimpleNamespace(**table)


async def both(program: Callable[[SimpleNamespace], Any]) -> tuple[Any, Any]:
    """(what ``program`` returned on the Python primitives, what it returned on the C ones)."""
    if primitives.FAST is None:
        pytest.skip("the C extension is not built here (or ASYNCDBO_PURE_PYTHON is set)")
    return await program(impl("python")), await program(impl("c"))


class SignalBackend(RecordingBackend):
    """The recording backend whose comm->compute waits return a signal the test completes."""

    def __init__(self, log: list[str], signals: dict[int, Signal]) -> None:
        super().__init__(log)
        self.signals = signals

    def wait(self, stream: Any, event: Any) -> Signal | None:  # type: ignore[override]
        super().wait(stream, event)
        ub = get_ubatch()
        return self.signals.get(ub.id) if stream == "compute" and ub is not None else None


def ht_layer(P: SimpleNamespace, log: list[str]) -> Callable[[int], Any]:
    """The ``ht`` MoE layer's primitive sequence (asyncdbo.moe.layer), twice."""

    async def moe(i: int) -> int:
        for layer in range(2):
            log.append(f"ub{i} L{layer}: attn")
            await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
            log.append(f"ub{i} L{layer}: dispatch")
            await P.dbo_switch_to_compute_sync()
            log.append(f"ub{i} L{layer}: experts")
            await P.dbo_yield_and_switch_from_compute_to_comm("combine")
            P.dbo_switch_to_compute()
            P.dbo_switch_to_comm()
            await P.dbo_yield_and_switch_from_comm_to_compute("combine_done")
            await P.dbo_yield()
            await P.dbo_yield(tag="after")
            log.append(f"ub{i} L{layer}: done ({get_ubatch().tag})")
        return i

    return moe


async def test_the_c_fast_paths_are_in_use_where_a_compiler_built_them() -> None:
    """An install with a C compiler and Python's headers builds the extension, and the public names
    are its objects."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if os.environ.get("ASYNCDBO_PURE_PYTHON", "") not in ("", "0") or shutil.which("cc") is None or not headers.exists():
        pytest.skip("pure Python asked for, or no C compiler or Python headers here")
    assert primitives.FAST is not None
    for name, fast in primitives.FAST.items():
        assert getattr(asyncdbo, name) is fast
        assert fast.__wrapped__ is primitives.PURE[name]


async def test_they_introspect_as_their_python_versions() -> None:
    if primitives.FAST is None:
        pytest.skip("the C extension is not built here (or ASYNCDBO_PURE_PYTHON is set)")
    for name, fast in primitives.FAST.items():
        pure = primitives.PURE[name]
        assert (fast.__name__, fast.__qualname__, fast.__module__) == (name, name, "asyncdbo.dbo.table")
        assert fast.__doc__ == pure.__doc__
        assert inspect.signature(fast) == inspect.signature(pure)


async def test_both_are_awaitable_and_asyncio_iscoroutine_differs_by_design() -> None:
    """A deliberate difference: the C awaitable has ``send``, ``throw``, ``close`` and ``__await__``,
    so it is a ``collections.abc.Coroutine`` and ``asyncio.iscoroutine`` says True; the Python one
    is a generator-based coroutine, which ``asyncio.iscoroutine`` counts on 3.11 only. Hiding one
    of those methods would break the await protocol (throw and close reach the awaitable through
    them), so the difference stays. Both are awaitable, which is what DBO code relies on; neither
    belongs in an asyncio task (their yields are the DBO kernel's)."""

    async def program(P: SimpleNamespace) -> list[tuple[bool, bool]]:
        seen: list[tuple[bool, bool]] = []

        async def forward(i: int) -> None:
            aw = P.dbo_yield()
            seen.append((inspect.isawaitable(aw), asyncio.iscoroutine(aw)))
            await aw

        await run_ubatches(forward, [(0,), (1,)])
        return seen

    py, c = await both(program)
    assert c == [(True, True)] * 2
    assert py == [(True, sys.version_info < (3, 12))] * 2


@pytest.mark.parametrize("name", ["python", "c"])
async def test_outside_a_run_every_primitive_is_a_done_no_op(name: str) -> None:
    P = impl(name)
    for fn in (P.dbo_yield, P.dbo_yield_and_switch_from_compute_to_comm, P.dbo_yield_and_switch_from_comm_to_compute,
               P.dbo_switch_to_comm_sync, P.dbo_switch_to_compute_sync, P.dbo_switch_to_comm, P.dbo_switch_to_compute):
        assert fn() is COMPLETED
        await fn()


@pytest.mark.parametrize("policy", ["role", "ubatch"])
async def test_the_whole_trace_is_the_same(policy: str) -> None:
    """Every record, wait, install and step, in order, for both stream policies."""

    async def program(P: SimpleNamespace) -> tuple[list[str], list[int]]:
        log: list[str] = []
        out = await run_ubatches(ht_layer(P, log), [(0,), (1,), (2,)], backend=RecordingBackend(log),
                                 stream_policy=policy)
        return log, out

    (py_log, py_out), (c_log, c_out) = await both(program)
    assert c_out == py_out == [0, 1, 2]
    assert c_log == py_log
    assert "ub2 L1: done (after)" in c_log


async def test_a_wait_that_parks_resumes_when_its_signal_is_set() -> None:
    """A comm->compute switch whose wait returns a pending signal parks the ubatch (the C awaitable
    delegates to the signal) until the other ubatch sets it; the interleaving is the Python one."""

    async def program(P: SimpleNamespace) -> list[str]:
        log: list[str] = []
        signals = {0: Signal("ub0 comm done")}

        async def moe(i: int) -> None:
            await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
            log.append(f"ub{i}: on comm")
            await P.dbo_yield_and_switch_from_comm_to_compute("experts")
            log.append(f"ub{i}: experts")
            if i == 1:
                for _ in range(2):
                    await P.dbo_yield()
                    log.append("ub1: still running")
                signals[0].set()
                log.append("ub1: set ub0's signal")
                await P.dbo_yield()
                log.append("ub1: last")

        await run_ubatches(moe, [(0,), (1,)], backend=SignalBackend(log, signals))
        return log

    py_log, c_log = await both(program)
    assert c_log == py_log
    assert c_log.index("ub1: set ub0's signal") < c_log.index("ub0: experts")


async def test_a_failed_signal_raises_at_the_await() -> None:
    async def program(P: SimpleNamespace) -> str:
        signals = {0: Signal("ub0 comm done")}
        signals[0].set(ConnectionError("peer 3 went away"))

        async def moe(i: int) -> None:
            await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
            await P.dbo_yield_and_switch_from_comm_to_compute("experts")

        with pytest.raises(ConnectionError) as info:
            await run_ubatches(moe, [(0,), (1,)], backend=SignalBackend([], signals))
        return "\n".join([str(info.value), *info.value.__notes__])

    py_err, c_err = await both(program)
    assert c_err == py_err
    assert c_err.startswith("peer 3 went away\nasyncdbo: raised in ubatch 0 of 2")


async def test_cancellation_reaches_a_ubatch_at_its_yield_and_while_parked() -> None:
    """One ubatch fails: the others are cancelled where they are suspended (one at a yield, one
    parked on a signal), and their cleanup runs, with the same notes."""

    async def program(P: SimpleNamespace) -> tuple[list[str], str]:
        log: list[str] = []
        signals = {2: Signal("never set", external=True)}

        async def moe(i: int) -> None:
            try:
                await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
                await P.dbo_yield_and_switch_from_comm_to_compute("experts")
                if i == 0:
                    raise ValueError("expert 7 got a NaN")
                await P.dbo_yield()
            except BaseException as exc:
                log.append(f"ub{i}: {type(exc).__name__}")
                raise
            finally:
                log.append(f"ub{i}: cleanup")

        with pytest.raises(ValueError) as info:
            await run_ubatches(moe, [(0,), (1,), (2,)], backend=SignalBackend(log, signals))
        return log, "\n".join([str(info.value), *info.value.__notes__])

    (py_log, py_err), (c_log, c_err) = await both(program)
    assert (c_log, c_err) == (py_log, py_err)
    assert {"ub1: CancelledError", "ub2: CancelledError", "ub2: cleanup"} <= set(c_log)


async def test_a_missing_await_and_a_wrong_role_raise_the_python_errors() -> None:
    async def program(P: SimpleNamespace) -> list[str]:
        errors: list[str] = []

        async def forgot(i: int) -> None:
            P.dbo_yield_and_switch_from_compute_to_comm("dispatch")  # no await
            await P.dbo_yield()

        async def wrong_role(i: int) -> None:
            await P.dbo_yield_and_switch_from_comm_to_compute("combine_done")  # still on compute

        for fn in (forgot, wrong_role):
            with pytest.raises(RuntimeError) as info:
                await run_ubatches(fn, [(0,), (1,)], backend="host")
            errors.append(str(info.value))
        return errors

    py_errors, c_errors = await both(program)
    assert c_errors == py_errors
    assert "dbo_yield_and_switch_from_compute_to_comm('dispatch')" in c_errors[0]
    assert c_errors[1].startswith("dbo_yield_and_switch_from_comm_to_compute() called in ubatch 0 while it is on the compute")


async def test_a_deadlock_report_walks_through_the_c_awaitable() -> None:
    """The await chain in a deadlock report goes through the C awaitable into the signal: the user's
    line is there, as with the Python primitives."""

    async def program(P: SimpleNamespace) -> str:
        signals = {0: Signal("only ub1 sets this"), 1: Signal("only ub0 sets this")}

        async def moe(i: int) -> None:
            await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
            await P.dbo_yield_and_switch_from_comm_to_compute("stuck here")  # the user's line

        with pytest.raises(DeadlockError) as info:
            await asyncio.wait_for(run_ubatches(moe, [(0,), (1,)], backend=SignalBackend([], signals)), 30)
        return str(info.value)

    py_report, c_report = await both(program)
    for report in (py_report, c_report):
        assert report.count('await P.dbo_yield_and_switch_from_comm_to_compute("stuck here")  # the user\'s line') == 2
        assert "only ub1 sets this" in report


@pytest.mark.parametrize("backend", ["host", "recording"])
async def test_the_common_case_never_falls_back_to_python(backend: str) -> None:
    """Once each tag has been seen, the ``ht`` sequence runs entirely in C, keyword tags included;
    a pending missing-await mark hands the call to Python (which reports it)."""
    P = impl("c")
    fast = primitives.FAST or {}

    async def run() -> None:
        back: Any = RecordingBackend([]) if backend == "recording" else backend
        await run_ubatches(ht_layer(P, []), [(0,), (1,)], backend=back)

    await run()  # first use of each tag
    before = {name: fn.fallbacks for name, fn in fast.items()}
    await run()
    assert {name: fn.fallbacks - before[name] for name, fn in fast.items()} == dict.fromkeys(fast, 0)

    async def forgot(i: int) -> None:
        P.dbo_yield_and_switch_from_compute_to_comm("dispatch")  # no await: the next primitive finds the mark
        await P.dbo_yield()

    with pytest.raises(RuntimeError, match="was never awaited"):
        await run_ubatches(forgot, [(0,), (1,)], backend="host")
    assert fast["dbo_yield"].fallbacks == before["dbo_yield"] + 1
