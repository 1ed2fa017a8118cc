"""The DBO loop's invariants, as specifications: whole interleaving traces, exact errors."""

from __future__ import annotations

import asyncio
import contextvars
import re
import threading
import types

import pytest

from asyncdbo import (
    DeadlockError,
    NoOverlapWarning,
    WatchdogTimeout,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_record_event,
    dbo_register_recv_hook,
    dbo_wait_event,
    dbo_yield,
    run_ubatches,
)
from asyncdbo import DBOOptions
from asyncdbo._core import LOOP_POLL_S, fastpath
from asyncdbo.lowlevel import SWITCH, DBORun, Instrument, VirtualClock, get_ubatch, trap

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def make_forward(trace: list[str], steps: dict[int, int] | int = 3):
    async def forward(name: str) -> str:
        ub = dbo_current_ubatch_id()
        n = steps if isinstance(steps, int) else steps[ub]
        for i in range(n):
            trace.append(f"ub{ub}:{name}{i}")
            await dbo_yield(f"{name}{i}")
        trace.append(f"ub{ub}:done")
        return f"{name}-result"

    return forward


# ---------------------------------------------------------------- ordering and results


async def test_two_ubatches_alternate_strictly_and_return_results_in_order() -> None:
    trace: list[str] = []
    results = await run_ubatches(make_forward(trace), [("a",), ("b",)])
    assert results == ["a-result", "b-result"]
    assert trace == [
        "ub0:a0", "ub1:b0",
        "ub0:a1", "ub1:b1",
        "ub0:a2", "ub1:b2",
        "ub0:done", "ub1:done",
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
async def test_round_robin_for_n_ubatches(n: int) -> None:
    trace: list[str] = []
    results = await run_ubatches(make_forward(trace, steps=2), [(f"x{i}-",) for i in range(n)])
    assert results == [f"x{i}--result" for i in range(n)]
    expected = [f"ub{i}:x{i}-{k}" for k in range(2) for i in range(n)] + [f"ub{i}:done" for i in range(n)]
    assert trace == expected


async def test_ubatches_with_different_numbers_of_yields() -> None:
    trace: list[str] = []
    await run_ubatches(make_forward(trace, steps={0: 1, 1: 3, 2: 2}), [("a",), ("b",), ("c",)])
    assert trace == [
        "ub0:a0", "ub1:b0", "ub2:c0",
        "ub0:done", "ub1:b1", "ub2:c1",
        "ub1:b2", "ub2:done",
        "ub1:done",
    ]


async def test_same_program_gives_same_interleaving_every_run() -> None:
    traces = set()
    for _ in range(10):
        trace: list[str] = []
        await run_ubatches(make_forward(trace, steps={0: 2, 1: 4, 2: 3, 3: 1}), [("p",), ("q",), ("r",), ("s",)])
        traces.add(tuple(trace))
    assert len(traces) == 1


async def test_single_ubatch_never_warns_and_runs_to_completion() -> None:
    trace: list[str] = []
    assert await run_ubatches(make_forward(trace, steps=2), [("solo",)]) == ["solo-result"]
    assert trace == ["ub0:solo0", "ub0:solo1", "ub0:done"]


async def test_two_ubatches_that_never_yield_warn_that_nothing_could_overlap() -> None:
    async def no_yields(x: int) -> int:
        return x * 2

    with pytest.warns(NoOverlapWarning, match=r"2 ubatches ran without a single yield, so nothing could overlap") as seen:
        assert await run_ubatches(no_yields, [(1,), (2,)]) == [2, 4]
    assert seen[0].filename == __file__  # the warning names the caller's line, not asyncdbo's


# ---------------------------------------------------------------- foreign awaitables


async def test_a_ubatch_parked_on_asyncio_sleep_does_not_block_the_others() -> None:
    trace: list[str] = []

    async def forward(i: int) -> None:
        if i == 0:
            trace.append("ub0:sleep")
            await asyncio.sleep(0.05)
            trace.append("ub0:woke")
            return
        for k in range(3):
            trace.append(f"ub1:{k}")
            await dbo_yield("k")

    await run_ubatches(forward, [(0,), (1,)])
    # ub1 runs all its steps while ub0 is parked; ub0 wakes after the timer.
    assert trace == ["ub0:sleep", "ub1:0", "ub1:1", "ub1:2", "ub0:woke"]


async def test_future_completed_from_another_thread_wakes_its_ubatch() -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    seen: list[str] = []

    async def forward(i: int) -> int:
        if i == 0:
            return await fut
        seen.append("ub1 ran while ub0 was parked")
        threading.Timer(0.02, lambda: loop.call_soon_threadsafe(fut.set_result, 42)).start()
        await dbo_yield()
        return -1

    assert await run_ubatches(forward, [(0,), (1,)]) == [42, -1]
    assert seen == ["ub1 ran while ub0 was parked"]


class CountSleeps(Instrument):
    def __init__(self) -> None:
        self.sleeps = 0
        self.wakes = 0

    def sleeping(self, run: object) -> None:
        self.sleeps += 1

    def woke(self, run: object) -> None:
        self.wakes += 1


async def test_when_every_ubatch_is_parked_the_loop_sleeps_instead_of_spinning() -> None:
    """Both ubatches park on futures another task completes one at a time: the kernel sleeps once
    per completion (a polling loop would never reach ``sleeping``, or would reach it per poll)."""
    counter = CountSleeps()
    loop = asyncio.get_running_loop()
    fut0, fut1, woke0 = loop.create_future(), loop.create_future(), loop.create_future()

    async def forward(i: int) -> int:
        await (fut0 if i == 0 else fut1)
        if i == 0:
            woke0.set_result(None)
        return i

    async def complete_one_at_a_time() -> None:
        fut0.set_result(None)  # runs once the kernel sleeps with both ubatches parked
        await woke0
        fut1.set_result(None)

    driver = asyncio.create_task(complete_one_at_a_time())
    assert await run_ubatches(forward, [(0,), (1,)], instrument=counter) == [0, 1]
    await driver
    assert counter.sleeps == counter.wakes == 2


async def test_bare_yield_to_the_event_loop_is_allowed() -> None:
    async def forward(i: int) -> int:
        await asyncio.sleep(0)
        await dbo_yield()
        return i

    assert await run_ubatches(forward, [(0,), (1,)]) == [0, 1]


async def test_awaiting_an_object_from_another_framework_raises_inside_the_ubatch() -> None:
    class Alien:
        def __await__(self):
            yield "not an asyncio future"

    async def forward(i: int) -> str:
        try:
            await Alien()
        except TypeError as exc:
            return str(exc)
        return "no error"

    msgs = await run_ubatches(forward, [(0,)])
    assert msgs[0].startswith("ubatch 0 awaited something that yielded 'not an asyncio future'; asyncdbo can park")


# ---------------------------------------------------------------- failure


async def test_an_exception_cancels_the_others_and_names_the_ubatch_and_its_last_yield() -> None:
    cleanup: list[str] = []

    async def forward(i: int) -> None:
        try:
            await dbo_yield("attn")
            if i == 1:
                raise ValueError("router exploded")
            await dbo_yield("dispatch")
            await dbo_yield("combine")
        except asyncio.CancelledError:
            cleanup.append(f"ub{i} cancelled")
            raise

    with pytest.raises(ValueError, match="router exploded") as info:
        await run_ubatches(forward, [(0,), (1,), (2,)])
    assert info.value.__notes__ == [
        "asyncdbo: raised in ubatch 1 of 3 while running (last yield point 'attn'); the other ubatches were cancelled"
    ]
    assert cleanup == ["ub0 cancelled", "ub2 cancelled"]
    # The traceback is the coroutine's own chain: it ends in the frame that raised.
    assert info.traceback[-1].name == "forward"


async def test_cancelling_the_outer_task_cancels_every_ubatch() -> None:
    cancelled: list[int] = []

    async def forward(i: int) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(run_ubatches(forward, [(0,), (1,)]), timeout=0.05)
    assert sorted(cancelled) == [0, 1]


async def test_a_wait_on_an_event_nobody_records_is_a_deadlock_with_every_stack() -> None:
    async def layer(i: int) -> None:
        await dbo_yield("attn")
        await dbo_wait_event(("dispatch-done", i))  # nobody records these

    async def forward(i: int) -> None:
        await layer(i)

    with pytest.raises(DeadlockError) as info:
        await run_ubatches(forward, [(0,), (1,)], name="dl")
    msg = str(info.value)
    assert msg.startswith(
        "asyncdbo deadlock in run 'dl': every live ubatch waits on something only another ubatch could produce"
    )
    for i in (0, 1):
        assert f"ubatch {i}: parked, last yield point 'attn', parked on <Signal \"event ('dispatch-done', {i}) (never recorded yet)\"" in msg
    # each ubatch's await chain, outermost first, with file:line of the test's own frames
    assert len(re.findall(r'test_scheduler.py", line \d+, in .*forward', msg)) == 2
    assert len(re.findall(r'test_scheduler.py", line \d+, in .*layer\n    await dbo_wait_event', msg)) == 2


async def test_a_recv_hook_is_never_left_with_a_ubatch_that_cannot_run_it() -> None:
    """vLLM hangs when a receive hook waits on a peer that is blocked; here a hook is only left
    with a runnable ubatch, so the cycle "ub0 waits for its receive, ub1 (the launcher) waits for
    ub0" cannot form: the hook runs at once when its launcher is parked."""
    trace: list[str] = []

    async def forward(i: int) -> None:
        if i == 1:
            await dbo_wait_event("ub0.after_recv")  # ub1 parks first: it cannot launch hooks
            trace.append("ub1 woke")
            return
        await dbo_yield("send")
        handle = dbo_register_recv_hook(lambda: trace.append("ub0's recv launched"))
        await handle
        dbo_record_event("ub0.after_recv")
        trace.append("ub0 recorded")

    await run_ubatches(forward, [(0,), (1,)])
    assert trace == ["ub0's recv launched", "ub0 recorded", "ub1 woke"]


async def test_watchdog_fails_a_run_stuck_on_an_outside_event_with_the_stacks() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def stuck_in_comm(i: int) -> None:
        await dbo_yield("dispatch")
        await never

    clock = VirtualClock()
    with pytest.raises(WatchdogTimeout) as info:
        await run_ubatches(stuck_in_comm, [(0,), (1,)], watchdog_s=30.0, name="wd", clock=clock)
    assert clock.now() == 30.0  # the virtual clock jumped to the watchdog: no wall time spent
    msg = str(info.value)
    assert msg.startswith("asyncdbo watchdog: run 'wd' made no progress for 30 s")
    assert msg.count("stuck_in_comm\n    await never") == 2


# ---------------------------------------------------------------- bad input


async def test_passing_a_coroutine_object_instead_of_the_function_is_a_type_error_with_the_fix() -> None:
    async def forward(x: int) -> int:
        return x

    with pytest.raises(TypeError) as info:
        await run_ubatches(forward(1), [(1,)])  # type: ignore[arg-type]
    assert str(info.value).splitlines()[1:] == [
        "Probably you wrote:",
        "    run_ubatches(forward(...), ...)      # incorrect",
        "Pass the function and its arguments instead:",
        "    run_ubatches(forward, ...)",
    ]


async def test_zero_ubatches_is_a_value_error() -> None:
    async def forward() -> None:
        return None

    with pytest.raises(ValueError, match=r"run_ubatches needs at least 1 ubatch \(got 0 argument tuples\)"):
        await run_ubatches(forward, [])


async def test_bare_arguments_instead_of_tuples_get_a_type_error_naming_the_entry() -> None:
    async def forward(x: int) -> int:
        return x

    with pytest.raises(TypeError, match=r"ubatch_args\[1\] is 7; each entry must be a tuple of arguments for fn \(write \(7,\)"):
        await run_ubatches(forward, [(1,), 7])  # type: ignore[list-item]


async def test_a_sync_function_is_a_type_error() -> None:
    def forward(x: int) -> int:
        return x

    with pytest.raises(TypeError, match=r"fn must be an async def function: .*forward'\(\*ubatch_args\[0\]\) returned int"):
        await run_ubatches(forward, [(1,)])  # type: ignore[arg-type]


async def test_unknown_options_and_bad_values_are_rejected() -> None:
    async def forward() -> None:
        return None

    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stream_polcy'"):
        await run_ubatches(forward, [()], stream_polcy="role")
    with pytest.raises(ValueError, match=r"stream_policy must be 'role' or 'ubatch' \(got 'roles'\)"):
        await run_ubatches(forward, [()], stream_policy="roles")
    with pytest.raises(ValueError, match=r"unknown stream backend 'tpu'"):
        await run_ubatches(forward, [()], backend="tpu")


# ---------------------------------------------------------------- isolation


user_var: contextvars.ContextVar[str] = contextvars.ContextVar("user_var", default="unset")


async def test_two_runs_in_two_tasks_never_see_each_others_state() -> None:
    traces: dict[str, list[str]] = {"A": [], "B": []}

    async def forward(run: str, i: int) -> tuple[str, int, str]:
        user_var.set(f"{run}{i}")  # per-ubatch: each ubatch has its own context
        for k in range(3):
            traces[run].append(f"{run}.ub{dbo_current_ubatch_id()}:{k}:{user_var.get()}")
            await dbo_yield()
            if run == "A" and k == 0:
                await asyncio.sleep(0.01)  # let the other run's task interleave at the loop level
        return run, dbo_current_ubatch_id(), user_var.get()

    ra, rb = await asyncio.gather(
        run_ubatches(forward, [("A", 0), ("A", 1)]),
        run_ubatches(forward, [("B", 0), ("B", 1), ("B", 2)]),
    )
    assert ra == [("A", 0, "A0"), ("A", 1, "A1")]
    assert rb == [("B", 0, "B0"), ("B", 1, "B1"), ("B", 2, "B2")]
    assert traces["B"] == [f"B.ub{i}:{k}:B{i}" for k in range(3) for i in range(3)]
    assert sorted(traces["A"]) == sorted(f"A.ub{i}:{k}:A{i}" for k in range(3) for i in range(2))
    assert user_var.get() == "unset" and not dbo_enabled()


async def test_primitives_are_no_ops_outside_a_run() -> None:
    assert not dbo_enabled()
    assert dbo_current_ubatch_id() == 0
    await dbo_yield()  # returns at once


# ---------------------------------------------------------------- the clock


async def test_timers_and_the_watchdog_run_on_the_runs_clock() -> None:
    """A virtual clock makes a schedule of timers deterministic and instant: a ubatch parked on a
    signal that a timer sets 5 s later wakes when the clock jumps there, with no wall time spent."""
    from asyncdbo.lowlevel import Signal, get_ubatch

    clock = VirtualClock(start=100.0)
    order: list[tuple[str, float]] = []

    async def forward(i: int) -> float:
        ub = get_ubatch()
        assert ub is not None
        if i == 0:
            done = Signal("five seconds", external=True)
            ub.run.call_at(clock.now() + 5.0, done.set)
            await done
        order.append((f"ub{i}", clock.now()))
        return clock.now()

    assert await run_ubatches(forward, [(0,), (1,)], clock=clock) == [105.0, 100.0]
    assert order == [("ub1", 100.0), ("ub0", 105.0)]


async def test_an_infinite_watchdog_bounds_nothing_as_none_does() -> None:
    """``watchdog_s=inf`` is no bound, as None: its deadline would be where a virtual clock moves
    itself while every ubatch is parked, and the watchdog then fired at once ("made no progress for
    inf s"). The ubatches wait for the loop's timer, on the virtual clock and on real time."""
    from asyncdbo.lowlevel import Signal

    for clock in (VirtualClock(start=100.0), None):
        loop = asyncio.get_running_loop()
        outside = Signal("set by the loop", external=True)

        async def forward(i: int) -> int:
            await outside
            return i

        loop.call_later(0.01, outside.set)
        assert await run_ubatches(forward, [(0,), (1,)], clock=clock, watchdog_s=float("inf")) == [0, 1]


async def test_a_virtual_clock_moves_only_forward() -> None:
    clock = VirtualClock()
    clock.advance(2.5)
    assert clock.now() == 2.5
    assert clock.wait_s(1.0) == 0.0 and clock.now() == 2.5  # a past deadline does not move it back
    with pytest.raises(ValueError, match=r"VirtualClock.advance needs dt >= 0 seconds \(got -1\)"):
        clock.advance(-1)


async def test_the_fast_loop_runs_in_c_where_it_was_built(kernel_loop: str) -> None:
    """With the extension built, ubatches that keep switching are driven by ``_spin.spin``, which
    finishes a ubatch that returns itself and goes on: a run that only switches is one call, which
    ends on the empty ring; the interleaving is the Python loop's (the test runs on both)."""
    calls: list[int] = []
    real = fastpath.C if kernel_loop == "c" else None

    def spin(*args: object) -> tuple[int, object, int, object]:
        out = real.spin(*args)  # type: ignore[union-attr]
        calls.append(out[2])
        return out  # type: ignore[no-any-return]

    spy = "python" if real is None else types.SimpleNamespace(spin=spin, release=real.release, start=real.start)
    log: list[str] = []

    async def ub(i: int) -> int:
        for step in range(3 + i):
            log.append(f"{i}.{step}")
            await trap(SWITCH)
        return i

    with fastpath.kernel_loop(spy):  # type: ignore[arg-type]  # a stand-in for the extension module
        assert await DBORun([ub(0), ub(1)]).drive() == [0, 1]
    assert log == ["0.0", "1.0", "0.1", "1.1", "0.2", "1.2", "1.3"]
    assert calls == ([] if real is None else [fastpath._EMPTY])


async def test_a_resume_installs_the_ubatchs_stream_only_when_another_is_current(kernel_loop: str) -> None:
    """Before every resume the kernel makes the ubatch's ``resume_with`` current, calling
    ``install`` only when it differs from the installed one; an install that fails fails the run
    at that resume (on the C loop as on the Python one)."""
    log: list[str] = []

    def install(stream: object) -> None:
        if stream == "bad":
            raise RuntimeError("device stream lost")
        log.append(f"install {stream}")

    async def ub(i: int, streams: list[str]) -> int:
        for s in streams:
            log.append(f"ub{i} runs")
            get_ubatch().resume_with = s  # what the next resume installs
            await trap(SWITCH)
        return i

    run = DBORun([ub(0, ["a", "a", "b"]), ub(1, ["a", "c", "c"])], install=install)
    for u, first in zip(run.ubatches, ("a", "a")):
        u.resume_with = first
    assert await run.drive() == [0, 1]
    # each ubatch's first loop pass sets what its next resume installs: a and a, then a and c, ...
    assert log == ["install a", "ub0 runs", "ub1 runs", "ub0 runs", "ub1 runs", "ub0 runs", "install c", "ub1 runs",
                   "install b", "install c"]

    bad = DBORun([ub(0, ["bad"]), ub(1, ["a"])], install=install)
    with pytest.raises(RuntimeError, match="^device stream lost$"):
        await bad.drive()


async def test_a_run_waiting_on_the_loop_leaves_home_current_and_reinstalls_after(kernel_loop: str) -> None:
    """Invariant 9: what is current belongs to the thread, not the run. Before every event-loop
    wait the run installs its ``home``; after it, the next resume installs its ubatch's
    ``resume_with`` even if that is what the run installed last, since a task that ran during the
    wait (here one that makes "x" current) may have changed it."""
    log: list[str] = []

    async def ub(i: int) -> int:
        log.append(f"ub{i} runs")
        await asyncio.sleep(0)  # both park on the loop: the run sleeps
        log.append(f"ub{i} runs")
        return i

    async def bystander() -> None:
        log.append("install x")

    run = DBORun([ub(0), ub(1)], install=lambda s: log.append(f"install {s}"))
    run.home = "home"
    for u in run.ubatches:
        u.resume_with = "a"
    await asyncio.gather(run.drive(), bystander())
    assert log == ["install a", "ub0 runs", "ub1 runs", "install home", "install x", "install a", "ub0 runs", "ub1 runs"]


async def test_a_run_taking_a_late_cancel_leaves_home_current_while_the_loop_runs(kernel_loop: str) -> None:
    """Invariants 9 and 10: a cancel that no wait delivered is taken in one pass of the event
    loop after the ubatches finished, and other tasks run in it (here a callback scheduled by
    ubatch 0): they find the run's ``home`` current, not the stream its last ubatch ran on."""
    task = asyncio.current_task()
    assert task is not None
    log: list[str] = []

    async def ub(i: int) -> int:
        if i == 0:
            task.cancel()
            asyncio.get_running_loop().call_soon(log.append, "another task runs")
        log.append(f"ub{i} runs")
        return i

    run = DBORun([ub(0), ub(1)], install=lambda s: log.append(f"install {s}"))
    run.home = "home"
    for u in run.ubatches:
        u.resume_with = "a"
    with pytest.raises(asyncio.CancelledError):
        await run.drive()
    assert task.uncancel() == 0
    assert log == ["install a", "ub0 runs", "ub1 runs", "install home", "another task runs"]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("watchdog_s", "5", "watchdog_s must be a number of seconds or None (got '5' of type str); write watchdog_s=5.0"),
    ("watchdog_s", True, "watchdog_s must be a number of seconds or None (got True of type bool); write e.g. watchdog_s=10.0"),
    ("blocking_s", "soon", "blocking_s must be a number of seconds or None (got 'soon' of type str); write e.g. blocking_s=0.01"),
    ("loop_poll_s", None, f"loop_poll_s must be a number of seconds (got None of type NoneType); write e.g. loop_poll_s={LOOP_POLL_S!r}"),
    ("debug", "yes", "debug must be True or False (got 'yes' of type str)"),
    ("name", 3, "name must be a str or None (got 3 of type int)"),
])
async def test_options_of_the_wrong_type_name_the_field_and_the_value(field: str, value: object, message: str) -> None:
    with pytest.raises(TypeError) as info:
        DBOOptions(**{field: value})  # type: ignore[arg-type]
    assert str(info.value) == message

    async def forward() -> None:
        return None

    with pytest.raises(TypeError) as info:
        await run_ubatches(forward, [()], **{field: value})
    assert str(info.value) == message
