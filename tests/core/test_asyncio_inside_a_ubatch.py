"""The asyncio contract: inside a ubatch, asyncio's own tools behave as they do in a task, scoped to
that ubatch (docs/design.md, "asyncio inside a ubatch").

* ``asyncio.sleep``, futures and executor futures park only the ubatch that awaits them, and it
  wakes within a bounded time even while the others keep switching (the kernel lets the event
  loop run every ``loop_poll_s`` while anything waits on it);
* ``asyncio.timeout`` / ``asyncio.wait_for`` around them raise ``TimeoutError`` in that ubatch
  only; the run goes on;
* a task created from a ubatch is not part of the run: ``dbo_enabled()`` is False there and the
  primitives are no-ops (never "Task got bad yield");
* ``asyncio.wait_for`` around any primitive's awaitable (which on 3.11 runs it in a task of its
  own) returns what awaiting it would, or raises ``TimeoutError`` in that ubatch only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from asyncdbo import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_record_event,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_wait_event,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: a bound no healthy run reaches: a ubatch still parked after this many switches of the other
#: one starved (the poll interval is 1 ms; a switch costs well under 10 us even on a loaded machine)
STARVED = 2_000_000


async def test_timeout_raises_timeout_error_in_that_ubatch_only() -> None:
    trace: list[str] = []

    async def forward(i: int) -> str:
        if i == 0:
            try:
                async with asyncio.timeout(0.01):
                    await asyncio.sleep(30)
            except TimeoutError:
                trace.append("ub0: timed out")
                await dbo_yield("after")
                return "recovered"
            return "not reached"
        for k in range(3):
            trace.append(f"ub1: {k}")
            await dbo_yield(f"k{k}")
        return "done"

    assert await run_ubatches(forward, [(0,), (1,)]) == ["recovered", "done"]
    assert trace.index("ub0: timed out") > trace.index("ub1: 0")


async def test_wait_for_a_future_raises_timeout_error_in_that_ubatch_only() -> None:
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def forward(i: int) -> str:
        if i == 0:
            try:
                await asyncio.wait_for(never, 0.01)
            except TimeoutError:
                return "ub0 timed out"
        await dbo_yield("y")
        return f"ub{i}"

    assert await run_ubatches(forward, [(0,), (1,), (2,)]) == ["ub0 timed out", "ub1", "ub2"]
    assert never.cancelled()  # wait_for cancels what it waited for, as in a task


async def test_a_timeout_that_does_not_expire_changes_nothing() -> None:
    async def forward(i: int) -> int:
        async with asyncio.timeout(30):
            await asyncio.sleep(0)
            await dbo_yield("y")
        return i

    assert await run_ubatches(forward, [(0,), (1,)]) == [0, 1]


async def test_a_timeout_around_a_ubatch_that_keeps_switching_still_expires() -> None:
    """The timer fires while ubatches run: the kernel polls the loop while a timeout is armed?
    No: it polls while a ubatch waits on the loop. A ubatch that only switches under a timeout
    gets its cancellation at its next yield once the loop has run (here: the other ubatch's
    sleep makes the kernel poll)."""

    async def forward(i: int) -> str:
        if i == 1:
            await asyncio.sleep(0.05)
            return "slept"
        try:
            async with asyncio.timeout(0.01):
                for _ in range(STARVED):
                    await dbo_yield("spin")
        except TimeoutError:
            return "timed out while switching"
        return "never timed out"

    assert await run_ubatches(forward, [(0,), (1,)]) == ["timed out while switching", "slept"]


@pytest.mark.parametrize("what", ["sleep", "executor", "future from a thread"])
async def test_a_ubatch_waiting_on_the_loop_wakes_while_another_keeps_switching(what: str) -> None:
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()
    switches: list[int] = []

    async def forward(i: int) -> str:
        if i == 0:
            if what == "sleep":
                await asyncio.sleep(0.001)
            elif what == "executor":
                await loop.run_in_executor(None, time.sleep, 0.001)
            else:
                fut: asyncio.Future[None] = loop.create_future()
                loop.call_soon_threadsafe(fut.set_result, None)
                await fut
            woke.set()
            return "woke"
        n = 0
        while not woke.is_set() and n < STARVED:
            n += 1
            await dbo_yield("spin")
        switches.append(n)
        return "switched"

    assert await run_ubatches(forward, [(0,), (1,)]) == ["woke", "switched"]
    assert switches[0] < STARVED


async def test_a_task_created_in_a_ubatch_is_not_part_of_the_run() -> None:
    seen: list[tuple[int, bool]] = []

    async def child(parent: int) -> str:
        seen.append((parent, dbo_enabled()))
        await dbo_yield("no-op in a task")
        await asyncio.sleep(0)
        return f"child of ub{parent}"

    async def forward(i: int) -> str:
        task = asyncio.create_task(child(dbo_current_ubatch_id()))
        await dbo_yield("y")
        assert dbo_enabled()  # the ubatch itself is still in the run
        return await task

    assert await run_ubatches(forward, [(0,), (1,)]) == ["child of ub0", "child of ub1"]
    assert sorted(seen) == [(0, False), (1, False)]


async def test_tasks_created_after_the_run_see_the_callers_context_again() -> None:
    async def forward(i: int) -> int:
        await dbo_yield("y")
        return i

    await run_ubatches(forward, [(0,), (1,)])

    async def probe() -> bool:
        return dbo_enabled()

    assert await asyncio.create_task(probe()) is False


async def test_the_loops_task_factory_stays_and_wraps_one_set_after_a_run() -> None:
    """The first run installs its task factory and leaves it (later runs only check it is there);
    a factory the user sets between runs makes every task, inside and outside the runs, and the
    next run wraps it, so a task created in a ubatch is still not part of the run."""
    from asyncdbo.lowlevel import get_ubatch

    loop = asyncio.get_running_loop()
    made: list[str] = []

    def users_factory(loop: asyncio.AbstractEventLoop, coro, **kwargs):  # type: ignore[no-untyped-def]
        made.append(coro.__qualname__.split(".")[-1])
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def child() -> object:
        return get_ubatch()

    async def forward(i: int) -> object:
        await dbo_yield("y")
        return await asyncio.create_task(child())

    previous = loop.get_task_factory()
    try:
        await run_ubatches(forward, [(0,), (1,)])
        ours = loop.get_task_factory()
        assert ours is not previous and getattr(ours, "previous", "no previous") is previous
        await run_ubatches(forward, [(0,), (1,)])
        assert loop.get_task_factory() is ours  # kept, not set again
        loop.set_task_factory(users_factory)

        async def probe() -> str:
            return "outside"

        assert await asyncio.create_task(probe()) == "outside"
        assert await run_ubatches(forward, [(0,), (1,)]) == [None, None]  # not part of the run
        assert getattr(loop.get_task_factory(), "previous", None) is users_factory
        assert made == ["probe", "child", "child"]
    finally:
        loop.set_task_factory(previous)


async def test_current_task_inside_a_ubatch_is_the_ubatchs_own() -> None:
    names: list[str] = []

    async def forward(i: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        names.append(task.get_name())
        await dbo_yield("y")

    outer = asyncio.current_task()
    assert outer is not None
    await run_ubatches(forward, [(0,), (1,)], name="r")
    assert names == [f"{outer.get_name()}:r:ubatch0", f"{outer.get_name()}:r:ubatch1"]
    assert asyncio.current_task() is outer  # restored once the run is over


# ---------------------------------------------------------------- wait_for around each primitive
# Each program awaits its primitives through ``wait_for(x, 30)`` (a bound never reached) in
# ubatch 0 and directly in ubatch 1; both must end as the plain program does: the role switches
# took effect (a sync switch from the wrong role raises), the event and the hook were waited for.


async def _roles(i: int, wait: Callable[[Awaitable[None]], Awaitable[None]]) -> str:
    await wait(dbo_yield("a"))
    await wait(dbo_yield_and_switch_from_compute_to_comm("to comm"))
    await wait(dbo_yield_and_switch_from_comm_to_compute("to compute"))
    await wait(dbo_switch_to_comm_sync())
    await wait(dbo_switch_to_compute_sync())
    await wait(dbo_switch_to_comm())
    await wait(dbo_switch_to_compute())
    return f"ub{i} roles"


async def _event(i: int, wait: Callable[[Awaitable[None]], Awaitable[None]]) -> str:
    if i == 1:  # records after ubatch 0 started waiting: ubatch 0 parks
        await dbo_yield("let ub0 wait")
        dbo_record_event("k")
        return "ub1 recorded"
    await wait(dbo_wait_event("k"))
    return "ub0 waited"


async def _hook(i: int, wait: Callable[[Awaitable[None]], Awaitable[None]]) -> str:
    if i == 0:
        ran = dbo_register_recv_hook(lambda: None)  # ubatch 1 runs it
        await wait(ran)
        return "ub0 hook ran"
    await dbo_yield("let ub0 wait")
    dbo_maybe_run_recv_hook()
    return "ub1 ran the hook"


PROGRAMS = {"roles": (_roles, ["ub0 roles", "ub1 roles"]), "event": (_event, ["ub0 waited", "ub1 recorded"]),
            "recv hook": (_hook, ["ub0 hook ran", "ub1 ran the hook"])}


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("program", PROGRAMS)
async def test_wait_for_around_each_primitive_returns_as_awaiting_it_would(program: str, debug: bool) -> None:
    fn, expected = PROGRAMS[program]

    async def forward(i: int) -> str:
        async def wait(x: Awaitable[None]) -> None:
            if i == 0:
                assert await asyncio.wait_for(x, 30) is None
            else:
                await x

        return await fn(i, wait)

    async def plain(i: int) -> str:
        async def wait(x: Awaitable[None]) -> None:
            await x

        return await fn(i, wait)

    assert await run_ubatches(plain, [(0,), (1,)], debug=debug) == expected
    assert await run_ubatches(forward, [(0,), (1,)], debug=debug) == expected


@pytest.mark.parametrize("what", ["event", "recv hook"])
async def test_wait_for_around_a_primitive_that_does_not_finish_in_time_raises_timeout_error(what: str) -> None:
    """Ubatch 1 keeps switching until ubatch 0 has timed out, then lets the wait finish: ubatch 0
    gets ``TimeoutError`` only, the run goes on, and awaiting the same thing again still works."""
    timed_out = asyncio.Event()

    async def forward(i: int) -> str:
        if i == 0:
            first = dbo_wait_event("k") if what == "event" else dbo_register_recv_hook(lambda: None)
            try:
                await asyncio.wait_for(first, 0.01)
            except TimeoutError:
                timed_out.set()
            else:
                return "ub0 did not time out"
            if what == "event":
                await dbo_wait_event("k")
            else:
                await first
            return "ub0 timed out, then waited"
        n = 0
        while not timed_out.is_set() and n < STARVED:
            n += 1
            await dbo_yield("spin")
        if what == "event":
            dbo_record_event("k")
        else:
            dbo_maybe_run_recv_hook()
        return "ub1 went on"

    assert await run_ubatches(forward, [(0,), (1,)]) == ["ub0 timed out, then waited", "ub1 went on"]


async def test_wait_for_zero_cancels_the_primitive_without_a_missing_await_report() -> None:
    """``wait_for(x, 0)`` cancels ``x`` before it starts: it was handed over, not dropped, so the
    next primitive reports no missing await (it would raise for a dropped event wait)."""

    async def forward(i: int) -> str:
        if i == 0:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(dbo_wait_event("never"), 0)
        await dbo_yield("next")
        return f"ub{i}"

    assert await run_ubatches(forward, [(0,), (1,)], debug=True) == ["ub0", "ub1"]
