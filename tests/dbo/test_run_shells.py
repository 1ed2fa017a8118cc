"""Run shells (asyncdbo.dbo.shell): a run reuses the records of a finished run with as many
ubatches, and only when nothing outside the shell can still see them; on both kernel loops."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from _host_works import HandWork

from asyncdbo import dbo_yield, run_ubatches
from asyncdbo.dbo import shell
from asyncdbo.lowlevel import DBORun, Instrument, get_ubatch

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


@pytest.fixture(autouse=True)
def each_loop_no_idle_shell(kernel_loop: str) -> Iterator[None]:
    """Every spec on both kernel loops (tests/conftest.py), starting with no idle shell."""
    shell._IDLE.clear()  # every spec starts with no idle shell
    yield
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


@pytest.mark.parametrize("submitter", [0, 1])  # ubatch policy: the first or the second comm stream is busy
@pytest.mark.parametrize("policy", ["role", "ubatch"])
async def test_a_kept_shell_hands_its_host_streams_to_the_next_run_emptied(policy: str, submitter: int) -> None:
    """The host backend keeps a shell's streams and events for its next run instead of building
    them again, without the works of the run before: a work left pending at the end of a run (a
    send nobody awaited) is in no stream, event or lane of the idle shell, and goes with its last
    reference, with no cycle collection."""
    from asyncdbo import dbo_submit, dbo_switch_to_comm

    seen: list[tuple[int, int, bool]] = []
    work = HandWork()

    async def fwd(i: int, submit: bool) -> int:
        lane = get_ubatch().ext  # type: ignore[union-attr]
        seen.append((id(lane.streams), id(lane.events), lane.events["comm"] is None))
        await dbo_switch_to_comm()
        if submit and i == submitter:
            dbo_submit(work, what="send")
            assert lane.events["comm"] is not None  # the stream has a work pending
        await dbo_yield()
        return i

    gc.disable()
    try:
        assert await run_ubatches(fwd, [(0, True), (1, True)], backend="host", stream_policy=policy) == [0, 1]
        idle = shell._IDLE[2][-1]
        state = idle.state
        assert [lane.events["comm"] for lane in state.lanes] == [None, None]
        comms = {id(lane.streams["comm"]): lane.streams["comm"] for lane in state.lanes}.values()
        assert [c.pending for c in comms] == [[]] * len(comms)
        assert all(ev.works == () and not ev.recorded for c in comms for _, ev in c.lanes)
        del idle, state, comms
        hw = work.fut.callbacks.pop().__self__  # the HostWork: only the torch-like future held it
        assert sys.getrefcount(hw) == 2  # this local and the call's argument
        del hw
        first = seen[:]
        seen.clear()
        assert await run_ubatches(fwd, [(0, False), (1, False)], backend="host", stream_policy=policy) == [0, 1]
        assert seen == [(s, e, True) for s, e, _ in first]  # the same dicts, nothing of the run before
    finally:
        gc.enable()


async def test_host_streams_taken_out_of_a_run_are_never_handed_to_another() -> None:
    """A stream or a lane's dict that someone keeps past its run (a tracer that stored them) is
    not reused: the next run of the shell gets new ones, as it got new records when a record was
    kept."""
    from asyncdbo import dbo_submit, dbo_switch_to_comm

    kept: list[Any] = []
    work = HandWork()

    async def fwd(i: int, keep: bool) -> int:
        lane = get_ubatch().ext  # type: ignore[union-attr]
        ids.append((id(lane.streams), id(lane.streams["comm"])))
        if keep and i == 1:
            kept.append(lane.streams["comm"])
            await dbo_switch_to_comm()
            dbo_submit(work, what="send")  # never completed
        await dbo_yield()
        return i

    ids: list[tuple[int, int]] = []
    await run_ubatches(fwd, [(0, False), (1, True)], backend="host")
    assert [w.what for w in kept[0].pending] == ["send"]  # left as its run ended, for whoever holds it
    first = ids[:]
    ids.clear()
    await run_ubatches(fwd, [(0, False), (1, False)], backend="host")
    assert not {c for _, c in ids} & {c for _, c in first}  # a new comm stream: the old one is kept
    PINNED.extend(shell._IDLE.get(2, ()))
    second = ids[:]
    ids.clear()
    await run_ubatches(fwd, [(0, False), (1, False)], backend="host")
    assert ids == second  # nothing kept them this time: reused
    kept.clear()


async def test_a_reused_run_has_the_options_and_a_new_name_of_each_run() -> None:
    """A shell whose last run had the same options (one frozen DBOOptions per set of plain keyword
    options) reruns its run with them as they are (DBORun.rerun); other options restart it. Either
    way each run sees its own options, and an unnamed run a name no earlier run had."""
    seen: list[tuple[str, float | None, float]] = []

    async def fwd(i: int) -> int:
        run = get_ubatch().run  # type: ignore[union-attr]
        if i == 0:
            seen.append((run.name, run.watchdog_s, run.loop_poll_s))
        await dbo_yield()
        return i

    for options in ({}, {}, {"watchdog_s": 5.0}, {"watchdog_s": 5.0, "name": "step"}, {"loop_poll_s": 0.5}, {}):
        await run_ubatches(fwd, [(0,), (1,)], backend="host", **options)
        assert len(shell._IDLE[2]) == 1  # one shell served them all
    assert [s[1:] for s in seen] == [(300.0, 0.001), (300.0, 0.001), (5.0, 0.001), (5.0, 0.001), (300.0, 0.5),
                                     (300.0, 0.001)]
    names = [s[0] for s in seen]
    assert names[3] == "step" and len(set(names)) == 6
    assert all(name.startswith("dbo-run-") for i, name in enumerate(names) if i != 3)


async def test_plain_keyword_options_map_to_one_options_object_and_numbers_keep_their_types() -> None:
    """Names and None are keys by value alone; numbers and flags with their types (``1 == 1.0 ==
    True``, yet each is its own option value, and ``debug=1`` is refused); an option that is not a
    plain value (an instrument) is never a key."""
    run_mod = sys.modules["asyncdbo.dbo.run"]
    host = run_mod._options({"backend": "host", "name": None})
    assert run_mod._options({"backend": "host", "name": None}) is host
    assert run_mod._options({"backend": "host"}) is not host  # other options, another object
    as_int, as_float = run_mod._options({"watchdog_s": 1}), run_mod._options({"watchdog_s": 1.0})
    assert (type(as_int.watchdog_s), type(as_float.watchdog_s)) == (int, float)
    assert run_mod._options({"watchdog_s": 1}) is as_int and run_mod._options({"watchdog_s": 1.0}) is as_float
    assert run_mod._options({"debug": True}).debug is True
    with pytest.raises(TypeError, match=r"debug must be True or False \(got 1 of type int\)"):
        run_mod._options({"debug": 1})
    inst = Instrument()
    assert run_mod._options({"instrument": inst}) is not run_mod._options({"instrument": inst})


async def test_a_shell_a_run_of_another_backend_emptied_gives_the_host_streams_anew() -> None:
    """host run, then a sim run on the same shell (the sim backend keeps nothing, so the lanes
    are emptied), then a host run again: the host must build its streams and events again, not
    take the emptied lanes for the ones it kept (it did: a KeyError 'compute' at the first switch,
    seen when docs/maintaining.md's sim run came between two doc pages' host runs)."""
    pytest.importorskip("torch", reason="the sim backend is torch's (CI runs tests/dbo on 3.12/3.13 without torch)")
    from asyncdbo import dbo_switch_to_compute_sync, dbo_yield_and_switch_from_compute_to_comm

    async def fwd(i: int) -> int:
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        await dbo_switch_to_compute_sync()
        return i

    assert await run_ubatches(fwd, [(0,), (1,)], backend="host") == [0, 1]
    assert await run_ubatches(fwd, [(0,), (1,)], backend="sim") == [0, 1]
    assert await run_ubatches(fwd, [(0,), (1,)], backend="host") == [0, 1]
