"""Every ending of a run frees what the run was given by reference counting alone (invariant 8).

A run that returns, raises, is cancelled or times out must leave no reference cycle through its
inputs: on a GPU those are device tensors, and with the cycle collector's generations a cycle can
hold them for many steps. Each case runs with ``gc.disable()``, drops what the caller got (result
or error), and expects weak references to every ubatch's inputs to be dead. The kernel's two loops
(tests/core/conftest.py) and both event loops run every case; the test at the end re-runs them in
a subprocess with every C path off (``ASYNCDBO_PURE_PYTHON=1``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from asyncdbo import (
    dbo_current_ubatch_id,
    dbo_record_event,
    dbo_wait_event,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    prepare_run,
    run_ubatches,
)
from asyncdbo.lowlevel import SWITCH, DBORun, trap

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _older_objects_frozen() -> Iterator[None]:
    """Every object alive when this module starts moves to the collector's permanent generation
    (``gc.freeze``) until it ends, so each case's ``gc.collect()`` walks only what this module
    made: in a whole-suite run the heap (torch, transformers, every earlier test's modules and
    objects) made each full collect slow, and a case makes four. What a case checks is unchanged:
    the payloads are made after the freeze, so a cycle through them is collectable as before, and
    the checks run with the collector disabled either way."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Payload:
    """Stands for a ubatch's input tensors (weakly referenceable, like a tensor)."""

    def __init__(self, i: int) -> None:
        self.i = i


class Boom(Exception):
    pass


async def _work(p: Payload) -> None:
    """A layer's shape of yields: switches, an event and a wait, so the await chain is deep."""
    i = dbo_current_ubatch_id()
    await dbo_yield_and_switch_from_compute_to_comm(f"d{p.i}")
    dbo_record_event(("x", i))
    await dbo_yield_and_switch_from_comm_to_compute(f"c{p.i}")
    await dbo_wait_event(("x", i))
    await dbo_yield("attn")


async def returns(p: Payload) -> Payload:
    await _work(p)
    return p  # the result holds the input: freed once the caller drops the results


async def raises_in_one(p: Payload) -> None:
    """Ubatch 1 raises while the others keep switching: on the kernel's C loop the error comes
    back from C and is re-raised by the kernel."""
    await _work(p)
    if p.i == 1:
        raise Boom(f"ubatch {p.i} failed")
    while True:
        await dbo_yield("spin")


async def raises_while_others_wait(p: Payload) -> None:
    await _work(p)
    if p.i == 1:
        raise Boom(f"ubatch {p.i} failed")
    await asyncio.sleep(30)


async def parks_forever(p: Payload) -> None:
    await _work(p)
    await asyncio.get_running_loop().create_future()


async def switches_forever(p: Payload) -> None:
    """Ubatch 0 waits on the loop, so the kernel polls it: that is where a cancellation lands."""
    await _work(p)
    if p.i == 0:
        await asyncio.sleep(30)
    while True:
        await dbo_yield("spin")


async def times_out_inside(p: Payload) -> str:
    await _work(p)
    try:
        async with asyncio.timeout(0.01):
            await asyncio.get_running_loop().create_future()
    except TimeoutError:
        return "timed out inside"
    return "never"


#: The task that drives the run, for a ubatch that cancels it (inside a ubatch
#: ``asyncio.current_task()`` is the run's view, whose cancel cancels that ubatch only).
DRIVER: list[asyncio.Task[Any]] = []


async def cancels_its_task(p: Payload) -> Payload:
    """Ubatch 0 cancels the driving task while the run never waits on the loop: the run takes
    the cancel in one pass of the loop after every ubatch returned, still live and unreleased
    (the kernel's invariant 10), and drops the results."""
    await _work(p)
    if p.i == 0:
        DRIVER[0].cancel()
    await dbo_yield("after")
    return p


RESULTS: list[weakref.ref[Payload]] = []


async def returns_but_one_raises(p: Payload) -> Payload:
    await _work(p)
    if p.i == 1:
        raise Boom(f"ubatch {p.i} failed")
    result = Payload(100 + p.i)  # made here: only the run's records hold it once returned
    RESULTS.append(weakref.ref(result))
    return result


#: The entry point the endings run through: run_ubatches, or a prepared run's (whose shells are
#: its own, and whose re-raise is its own line).
ENTRIES: dict[str, Callable[..., Awaitable[Any]]] = {
    "run_ubatches": lambda fn, args: run_ubatches(fn, args, backend="host"),
    "prepared": prepare_run(backend="host").run_ubatches,
}
ENTRY = ["run_ubatches"]


def _entry(fn: Callable[..., Awaitable[Any]], args: list[tuple[Payload]]) -> Awaitable[Any]:
    return ENTRIES[ENTRY[0]](fn, args)


async def _cancelled(fn: Callable[[Payload], Awaitable[Any]], payloads: list[Payload]) -> None:
    task = asyncio.ensure_future(_entry(fn, [(p,) for p in payloads]))
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def _ending(name: str, payloads: list[Payload]) -> None:
    """Run one ending with ``payloads``; swallow what it raises the way a caller would."""
    args = [(p,) for p in payloads]
    if name == "returns":
        results = await _entry(returns, args)
        assert results == payloads
        del results
    elif name == "raises":
        try:
            await _entry(raises_in_one, args)
        except Boom:
            pass
    elif name == "raises while the others wait on the loop":
        try:
            await _entry(raises_while_others_wait, args)
        except Boom:
            pass
    elif name == "cancelled while parked":
        await _cancelled(parks_forever, payloads)
    elif name == "cancelled while switching":
        await _cancelled(switches_forever, payloads)
    elif name == "wait_for timeout":
        try:
            await asyncio.wait_for(_entry(parks_forever, args), 0.02)
        except TimeoutError:
            pass
    elif name == "asyncio.timeout around the run":
        try:
            async with asyncio.timeout(0.02):
                await _entry(switches_forever, args)
        except TimeoutError:
            pass
    elif name == "cancelled by a ubatch, never waiting":
        task = asyncio.current_task()
        assert task is not None
        DRIVER[:] = [task]
        try:
            await _entry(cancels_its_task, args)
        except asyncio.CancelledError:
            assert task.uncancel() == 0
        else:  # pragma: no cover - the run must take the cancel
            raise AssertionError("the run returned")
        finally:
            DRIVER.clear()
    elif name == "timeout inside a ubatch":
        assert await _entry(times_out_inside, args) == ["timed out inside"] * len(args)
    else:  # pragma: no cover - a typo in ENDINGS
        raise AssertionError(name)


ENDINGS = [
    "returns",
    "raises",
    "raises while the others wait on the loop",
    "cancelled while parked",
    "cancelled while switching",
    "wait_for timeout",
    "asyncio.timeout around the run",
    "timeout inside a ubatch",
    "cancelled by a ubatch, never waiting",
]


async def alive_after(name: str, n: int) -> list[int]:
    """The ubatch indices whose inputs are still alive after ending ``name`` with gc disabled."""
    payloads = [Payload(i) for i in range(n)]
    refs = [weakref.ref(p) for p in payloads]
    gc.collect()
    gc.disable()
    try:
        await _ending(name, payloads)
        del payloads
        await asyncio.sleep(0)  # callbacks the ending scheduled (a cancelled future's) run
        return [i for i, r in enumerate(refs) if r() is not None]
    finally:
        gc.enable()


@pytest.mark.asyncio
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", ENDINGS)
async def test_every_ending_frees_the_inputs_without_the_cycle_collector(name: str, entry: str) -> None:
    ENTRY[0] = entry
    try:
        for _ in range(3):  # the first run of a process warms caches; a cycle shows on every run
            assert await alive_after(name, 2) == []
        assert await alive_after(name, 4) == []
    finally:
        ENTRY[0] = "run_ubatches"


_SUBPROCESS = r"""
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import test_no_cycles as t
from asyncdbo._core import fastpath

async def main():
    out = []
    for name in t.ENDINGS:
        for _ in range(5):
            alive = await t.alive_after(name, 2)
            if alive:
                out.append(f"{name}: ubatches {alive} alive")
                break
    return out

print(fastpath.C is not None, asyncio.run(main()))
"""


def test_no_ending_leaves_a_cycle_with_every_c_path_off(kernel_loop: str) -> None:
    """The cases above, in a process where ASYNCDBO_PURE_PYTHON=1 left both C extensions unloaded
    (this process runs them with the C primitives on)."""
    if kernel_loop == "python":
        pytest.skip("the subprocess has no C paths at all: once is enough")
    env = dict(os.environ, ASYNCDBO_PURE_PYTHON="1")
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=100, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "False []\n"


@pytest.mark.asyncio
@pytest.mark.parametrize("entry", list(ENTRIES))
async def test_an_error_the_caller_keeps_holds_no_result_of_its_run(entry: str) -> None:
    """A failed run drops what its finished ubatches returned with their records: the error's
    traceback holds the kernel's frames while the caller keeps the error, and none of them may
    hold a result (on a GPU, the output tensors of the ubatches that finished)."""
    ENTRY[0] = entry
    RESULTS.clear()
    gc.collect()
    gc.disable()
    try:
        try:
            await _entry(returns_but_one_raises, [(Payload(i),) for i in range(3)])
        except Boom as exc:
            kept = exc
        await asyncio.sleep(0)
        assert str(kept) == "ubatch 1 failed"
        assert len(RESULTS) == 1  # ubatch 0 returned before 1 raised (2 was cancelled)
        assert RESULTS[0]() is None
        del kept
    finally:
        gc.enable()



async def returns_after_cancelling_its_task(p: Payload) -> Payload:
    """:func:`cancels_its_task` with a plain yield (a bare kernel run has no DBO layer), returning a
    result only the run's records hold."""
    if p.i == 0:
        DRIVER[0].cancel()
    await trap(SWITCH)
    result = Payload(100 + p.i)
    RESULTS.append(weakref.ref(result))
    return result


@pytest.mark.asyncio
async def test_a_late_cancel_the_caller_keeps_holds_no_result_of_its_run(kernel_loop: str) -> None:
    """A run that takes a cancel after its ubatches returned (the kernel's invariant 10) drops
    their results before the cancel is raised: the CancelledError the caller keeps holds the
    kernel's frames (driven bare here: ``run_ubatches`` cuts them from what it raises), and none
    of them a result."""
    RESULTS.clear()
    task = asyncio.current_task()
    assert task is not None
    DRIVER[:] = [task]
    gc.collect()
    gc.disable()
    try:
        try:
            await DBORun([returns_after_cancelling_its_task(Payload(i)) for i in range(3)]).drive()
        except asyncio.CancelledError as exc:
            kept = exc
        assert task.uncancel() == 0
        await asyncio.sleep(0)
        assert len(RESULTS) == 3  # every ubatch returned before the run took the cancel
        assert [r() for r in RESULTS] == [None, None, None]
        del kept
    finally:
        gc.enable()
        DRIVER.clear()
