"""Run shells (asyncdbo.dbo.shell): a run reuses the records of a finished run with as many
ubatches, and only when nothing outside the shell can still see them; on both kernel loops."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from asyncdbo import dbo_yield, run_ubatches
from asyncdbo._core import kernel
from asyncdbo.dbo import shell
from asyncdbo.lowlevel import DBORun, Instrument, get_ubatch

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

KERNEL_LOOPS = ["c", "python"] if kernel._spin is not None else ["python"]


@pytest.fixture(autouse=True, params=KERNEL_LOOPS)
def kernel_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(kernel, "_spin", None)
    shell._IDLE.clear()  # every spec starts with no idle shell
    yield str(request.param)
    PINNED.clear()


async def records(n: int, **options: Any) -> list[int]:
    """The ids of the records a run of ``n`` ubatches ran on (each yields once). Its shell, if
    kept, is pinned: ids of records that are alive cannot be those of later ones."""
    seen: list[int] = []

    async def fwd(i: int) -> int:
        seen.append(id(get_ubatch()))
        await dbo_yield("y")
        return i

    assert await run_ubatches(fwd, [(i,) for i in range(n)], backend="host", **options) == list(range(n))
    PINNED.extend(shell._IDLE.get(n, ()))  # the Shell itself is not in the reference counts
    return seen


PINNED: list[shell.Shell] = []


async def test_a_run_reuses_the_records_of_the_last_run_with_as_many_ubatches() -> None:
    first = await records(2)
    assert await records(2) == first
    assert await records(2, name="named", watchdog_s=5.0) == first  # options are per run, not per shell
    three = await records(3)
    assert not set(three) & set(first)
    assert await records(3) == three
    assert await records(2) == first


async def test_a_reused_record_starts_from_the_callers_context_of_this_run() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    seen: list[tuple[str, str]] = []

    async def fwd(i: int) -> None:
        seen.append((var.get(), f"ubatch {get_ubatch().id}"))  # type: ignore[union-attr]
        var.set(f"set by ubatch {i}")  # the ubatch's own context only
        await dbo_yield()

    var.set("caller 1")
    await run_ubatches(fwd, [(0,), (1,)], backend="host")
    var.set("caller 2")
    await run_ubatches(fwd, [(0,), (1,)], backend="host")
    assert seen == [("caller 1", "ubatch 0"), ("caller 1", "ubatch 1"), ("caller 2", "ubatch 0"), ("caller 2", "ubatch 1")]
    assert var.get() == "caller 2"


async def test_a_record_kept_past_its_run_is_never_reused() -> None:
    kept: list[Any] = []

    async def keep(i: int) -> None:
        if i == 0:
            kept.append(get_ubatch())
        await dbo_yield()

    first = await records(2)
    await run_ubatches(keep, [(0,), (1,)], backend="host")
    assert id(kept[0]) == first[0]
    later = await records(2)
    assert first[0] not in later  # the kept record stays the finished run's
    assert (kept[0].run, str(kept[0].state)) == (None, "done")
    assert await records(2) == later


async def test_a_callback_scheduled_from_a_ubatch_keeps_its_records_out_of_reuse() -> None:
    """A loop callback runs in a copy of the ubatch's context, which names its record: the record
    must not serve another run meanwhile (the callback would see that run's ubatch)."""
    loop = asyncio.get_running_loop()
    fired = asyncio.Event()
    seen: list[Any] = []

    def callback() -> None:
        seen.append(get_ubatch())
        fired.set()

    async def schedule(i: int) -> None:
        if i == 0:
            loop.call_later(0.01, callback)
        await dbo_yield()

    first = await records(2)
    await run_ubatches(schedule, [(0,), (1,)], backend="host")
    during = await records(2)  # the callback's context holds the record: new ones
    assert first[0] not in during
    await fired.wait()
    assert id(seen[0]) == first[0] and seen[0].run is None


async def test_a_failed_or_cancelled_run_is_not_reused() -> None:
    async def fail(i: int) -> None:
        await dbo_yield()
        if i == 1:
            raise ValueError("boom")

    async def forever(i: int) -> None:
        await dbo_yield()
        await asyncio.sleep(10)  # parked on the loop, where the timeout cancels the run

    first = await records(2)
    with pytest.raises(ValueError, match="boom"):
        await run_ubatches(fail, [(0,), (1,)], backend="host")
    after_failure = await records(2)
    assert after_failure != first
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(run_ubatches(forever, [(0,), (1,)], backend="host"), 0.05)
    assert await records(2) != after_failure


async def test_an_instrument_that_keeps_the_run_keeps_it_out_of_reuse() -> None:
    class Keeper(Instrument):
        def __init__(self) -> None:
            self.runs: list[DBORun] = []

        def run_started(self, run: DBORun) -> None:
            self.runs.append(run)

    keeper = Keeper()
    first = await records(2)
    assert await records(2, instrument=keeper) == first  # the shell was idle, so this run took it
    assert await records(2) != first  # the keeper still holds the run: a new shell
    keeper.runs.clear()


async def test_an_idle_shell_holds_nothing_of_its_run() -> None:
    """Arguments, results and comm records go when the caller drops them, with no cycle
    collection, although the shell stays for the next run."""

    class Payload:
        pass

    async def fwd(x: Payload) -> Payload:
        await dbo_yield()
        return Payload()

    gc.disable()
    try:
        args = [(Payload(),), (Payload(),)]
        refs = [weakref.ref(a[0]) for a in args]
        results = await run_ubatches(fwd, args, backend="host")
        refs += [weakref.ref(r) for r in results]
        del args, results
        assert [r() for r in refs] == [None] * 4
        assert len(shell._IDLE[2]) == 1
    finally:
        gc.enable()


async def test_runs_in_flight_at_once_each_get_their_own_shell() -> None:
    async def fwd(i: int) -> int:
        ids.append(id(get_ubatch()))
        await dbo_yield()
        await asyncio.sleep(0.001)  # every ubatch parked on the loop: the other tasks' runs start
        return i

    ids: list[int] = []
    both = await asyncio.gather(*(run_ubatches(fwd, [(0,), (1,)], backend="host") for _ in range(2)))
    assert both == [[0, 1], [0, 1]]
    assert len(set(ids)) == 4
    assert len(shell._IDLE[2]) == 2
    ids.clear()
    await asyncio.gather(*(run_ubatches(fwd, [(0,), (1,)], backend="host") for _ in range(2 + shell.MAX_IDLE)))
    assert len(shell._IDLE[2]) == shell.MAX_IDLE


async def test_restart_refuses_a_run_that_is_not_finished_or_has_another_size() -> None:
    async def nothing() -> None:
        await dbo_yield()

    run = DBORun([nothing(), nothing()])
    coros = [nothing(), nothing()]
    with pytest.raises(ValueError) as info:
        run.restart(coros)
    assert str(info.value) == (
        f"run {run.name!r} can restart only after it was driven to its end, with as many coroutines as it has "
        "ubatches (2; got 2, not finished); build a new DBORun instead"
    )
    assert [c.cr_frame for c in coros] == [None, None]  # closed: no "never awaited" warning
    await run.drive()
    with pytest.raises(ValueError, match=r"ubatches \(2; got 1, released\)"):
        run.restart([nothing()])
    run.restart([nothing(), nothing()], name="again")
    assert (run.name, await run.drive()) == ("again", [None, None])
