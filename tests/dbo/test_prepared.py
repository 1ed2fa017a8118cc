"""Prepared runs (asyncdbo.prepare_run): options and backend settled once, each run as
run_ubatches runs it, on run shells of the prepared run's own; on both kernel loops."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

import asyncdbo
from asyncdbo import DBOOptions, dbo_current_ubatch_id, dbo_yield, prepare_run, run_ubatches
from asyncdbo.backends import get_backend
from asyncdbo.dbo import PreparedRun, RunStats, run_ubatches_with_stats, shell
from asyncdbo.lowlevel import DBORun, Instrument, get_ubatch

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def each_loop_no_idle_shell(kernel_loop: str) -> Iterator[None]:
    """Every spec on both kernel loops (tests/conftest.py), starting with no idle shell."""
    shell._IDLE.clear()
    yield


async def traced(trace: list[tuple[int, str]], layers: int) -> Any:
    async def fwd(x: int) -> int:
        for layer in range(layers):
            trace.append((dbo_current_ubatch_id(), f"L{layer}"))
            await dbo_yield(f"L{layer}")
        return x * 10

    return fwd


@pytest.mark.asyncio
async def test_a_prepared_run_interleaves_and_returns_as_run_ubatches_does() -> None:
    prepared = prepare_run(backend="host")
    seen: dict[str, list[tuple[int, str]]] = {"run_ubatches": [], "prepared": [], "prepared again": []}
    out = {
        "run_ubatches": await run_ubatches(await traced(seen["run_ubatches"], 2), [(1,), (2,), (3,)], backend="host"),
        "prepared": await prepared.run_ubatches(await traced(seen["prepared"], 2), [(1,), (2,), (3,)]),
        "prepared again": await prepared.run_ubatches(await traced(seen["prepared again"], 2), [(1,), (2,), (3,)]),
    }
    assert out == dict.fromkeys(out, [10, 20, 30])
    assert seen == dict.fromkeys(seen, [(0, "L0"), (1, "L0"), (2, "L0"), (0, "L1"), (1, "L1"), (2, "L1")])
    _, stats = await prepared.run_ubatches_with_stats(await traced([], 2), [(1,), (2,)])
    _, plain = await run_ubatches_with_stats(await traced([], 2), [(1,), (2,)], backend="host")
    assert (stats.num_ubatches, stats.num_switches, stats.num_parks) == (plain.num_ubatches, plain.num_switches,
                                                                         plain.num_parks) == (2, 4, 0)


@pytest.mark.asyncio
async def test_the_stats_of_a_run_are_the_runstats_its_fields_build() -> None:
    """asyncdbo.dbo.run._stats stores the fields of RunStats at once: the same object, frozen."""
    from dataclasses import FrozenInstanceError, fields

    async def fwd(i: int) -> int:
        await dbo_yield()
        await asyncio.sleep(0)  # a park
        return i

    for stats in ((await run_ubatches_with_stats(fwd, [(0,), (1,)], backend="host"))[1],
                  (await prepare_run(backend="host", debug=True).run_ubatches_with_stats(fwd, [(0,), (1,), (2,)]))[1]):
        built = RunStats(**{f.name: getattr(stats, f.name) for f in fields(RunStats)})
        assert stats == built and repr(stats) == repr(built) and vars(stats) == vars(built)
        assert stats.num_parks > 0
        with pytest.raises(FrozenInstanceError):
            stats.num_parks = 0  # type: ignore[misc]


@pytest.mark.asyncio
async def test_its_runs_reuse_run_shells_of_its_own() -> None:
    prepared = prepare_run(backend="host")
    records: list[list[int]] = []

    async def fwd(i: int) -> int:
        records[-1].append(id(get_ubatch()))
        await dbo_yield()
        return i

    for _ in range(3):
        records.append([])
        assert await prepared.run_ubatches(fwd, [(0,), (1,)]) == [0, 1]
    assert records[0] == records[1] == records[2]  # one shell served the three runs
    assert shell._IDLE == {}  # ... and it is the prepared run's: the process's pool has none
    records.append([])
    await run_ubatches(fwd, [(0,), (1,)], backend="host")
    assert not set(records[-1]) & set(records[0])  # run_ubatches never takes a prepared run's shell


@pytest.mark.asyncio
async def test_each_run_has_the_name_it_is_given_else_the_options_name() -> None:
    names: list[str] = []

    async def fwd(i: int) -> None:
        if i == 0:
            names.append(get_ubatch().run.name)  # type: ignore[union-attr]
        await dbo_yield()

    prepared = prepare_run(backend="host", name="model")
    for name in ("default", "step7", "step8", "default", None):
        if name == "default":
            await prepared.run_ubatches(fwd, [(0,), (1,)])
        else:
            await prepared.run_ubatches(fwd, [(0,), (1,)], name=name)
    assert names[:4] == ["model", "step7", "step8", "model"]
    assert names[4].startswith("dbo-run-")


@pytest.mark.asyncio
async def test_an_instrument_given_to_one_run_sees_that_run_only() -> None:
    class Runs(Instrument):
        def __init__(self) -> None:
            self.started: list[str] = []

        def run_started(self, run: DBORun) -> None:
            self.started.append(run.name)

    async def fwd(i: int) -> None:
        await dbo_yield()

    always, once = Runs(), Runs()
    prepared = prepare_run(backend="host", instrument=always)
    await prepared.run_ubatches(fwd, [(0,), (1,)], name="a")
    await prepared.run_ubatches(fwd, [(0,), (1,)], name="b", instrument=[once])  # in place of the options'
    await prepared.run_ubatches(fwd, [(0,), (1,)], name="c", instrument=None)
    await prepared.run_ubatches(fwd, [(0,), (1,)], name="d")
    assert (always.started, once.started) == (["a", "d"], ["b"])


@pytest.mark.asyncio
async def test_bad_options_fail_when_prepared_with_the_messages_of_run_ubatches() -> None:
    with pytest.raises(TypeError) as info:
        prepare_run(watchdog=5.0)
    assert str(info.value) == (
        "prepare_run() got an unexpected keyword argument 'watchdog'; valid options are the fields of DBOOptions "
        "(backend, stream_policy, watchdog_s, instrument, debug, name, clock, blocking_s, loop_poll_s)")
    with pytest.raises(ValueError, match=r"^watchdog_s must be > 0 seconds or None \(got -1\.0\)$"):
        prepare_run(watchdog_s=-1.0)
    with pytest.raises(TypeError, match=r"^pass either options=DBOOptions\(\.\.\.\) or keyword options, not both "
                                        r"\(got \['debug'\]\)$"):
        prepare_run(options=DBOOptions(), debug=True)
    with pytest.raises(ValueError, match=r"^unknown stream backend 'nccl'; choose one of \('auto', 'host', "):
        prepare_run(backend="nccl")
    prepared = prepare_run(options=DBOOptions(backend="host", watchdog_s=5.0))
    assert (prepared.options.watchdog_s, prepared.backend) == (5.0, get_backend("host"))
    assert repr(prepared).startswith("PreparedRun(DBOOptions(backend='host', ") and isinstance(prepared, PreparedRun)


@pytest.mark.asyncio
async def test_bad_arguments_of_a_run_fail_before_it_starts() -> None:
    async def fwd(i: int) -> int:
        await dbo_yield()
        return i

    prepared = prepare_run(backend="host")
    with pytest.raises(TypeError, match=r"^name must be a str or None \(got 7 of type int\)$"):
        await prepared.run_ubatches(fwd, [(0,), (1,)], name=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^instrument must be an asyncdbo.lowlevel.Instrument, a list of them, or "
                                        r"None \(got 'trace'\)"):
        await prepared.run_ubatches_with_stats(fwd, [(0,), (1,)], instrument="trace")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^ubatch_args\[1\] is 1; each entry must be a tuple of arguments for fn"):
        await prepared.run_ubatches(fwd, [(0,), 1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="run_ubatches expects an async function, but got the coroutine object"):
        await prepared.run_ubatches(fwd(0), [(0,)])  # type: ignore[arg-type]
    assert await prepared.run_ubatches(fwd, [(0,), (1,)]) == [0, 1]  # and nothing of them is left behind


@pytest.mark.asyncio
async def test_a_coroutine_passed_as_fn_is_closed_when_a_bad_name_or_instrument_fails_first() -> None:
    async def fwd(i: int) -> int:
        await dbo_yield()
        return i

    prepared = prepare_run(backend="host")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        coros = [fwd(0), fwd(1)]
        with pytest.raises(TypeError, match=r"^name must be a str or None \(got 7 of type int\)$"):
            await prepared.run_ubatches(coros[0], [(0,)], name=7)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^instrument must be an asyncdbo.lowlevel.Instrument"):
            await prepared.run_ubatches_with_stats(coros[1], [(0,)], instrument="trace")  # type: ignore[arg-type]
        assert [c.cr_frame for c in coros] == [None, None]  # closed, never started
        del coros
        gc.collect()
    assert [str(w.message) for w in record] == []  # without the close: "coroutine 'fwd' was never awaited"


@pytest.mark.asyncio
async def test_a_failed_or_cancelled_run_leaves_the_next_one_whole() -> None:
    records: list[int] = []

    async def fwd(i: int, fail: bool = False, hang: bool = False) -> int:
        records.append(id(get_ubatch()))
        await dbo_yield()
        if fail and i == 1:
            raise ValueError("boom")
        if hang:
            await asyncio.sleep(10)  # parked on the loop, where the timeout cancels the run
        return i

    prepared = prepare_run(backend="host")
    assert await prepared.run_ubatches(fwd, [(0,), (1,)]) == [0, 1]
    with pytest.raises(ValueError, match="^boom\n") as info:
        await prepared.run_ubatches(fwd, [(0, True), (1, True)])
    assert info.value.__notes__ == [
        "asyncdbo: raised in ubatch 1 of 2 while running (last yield point 'yield'); the other ubatches were cancelled"]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(prepared.run_ubatches(fwd, [(0, False, True), (1, False, True)]), 0.05)
    records.clear()
    assert await prepared.run_ubatches(fwd, [(0,), (1,)]) == [0, 1]
    assert await prepared.run_ubatches(fwd, [(0,), (1,)]) == [0, 1]
    assert records[:2] == records[2:]  # a shell again serves run after run


@pytest.mark.asyncio
async def test_runs_in_flight_at_once_each_get_a_shell_of_their_own() -> None:
    ids: list[int] = []

    async def fwd(i: int) -> int:
        ids.append(id(get_ubatch()))
        await dbo_yield()
        await asyncio.sleep(0.001)  # every ubatch parked on the loop: the other tasks' runs start
        return i

    prepared = prepare_run(backend="host")
    both = await asyncio.gather(*(prepared.run_ubatches(fwd, [(0,), (1,)]) for _ in range(2)))
    assert both == [[0, 1], [0, 1]]
    assert len(set(ids)) == 4
    ids.clear()
    await asyncio.gather(*(prepared.run_ubatches(fwd, [(0,), (1,)]) for _ in range(2)))
    assert len(set(ids)) == 4  # the two kept shells served them again ...
    assert shell._IDLE == {}  # ... from the prepared run's own pool


def test_one_prepared_run_serves_several_event_loops_in_turn() -> None:
    async def fwd(i: int) -> int:
        await dbo_yield()
        return i

    prepared = prepare_run(backend="host")  # made outside any loop
    assert asyncio.run(prepared.run_ubatches(fwd, [(0,), (1,)])) == [0, 1]
    assert uvloop.run(prepared.run_ubatches(fwd, [(0,), (1,)])) == [0, 1]
    assert asyncdbo.run(prepared.run_ubatches, fwd, [(0,), (1,)]) == [0, 1]


@pytest.mark.asyncio
async def test_an_idle_prepared_run_holds_nothing_of_its_runs() -> None:
    import weakref

    class Payload:
        pass

    async def fwd(x: Payload) -> Payload:
        await dbo_yield()
        return Payload()

    prepared = prepare_run(backend="host")
    gc.disable()
    try:
        args = [(Payload(),), (Payload(),)]
        refs = [weakref.ref(a[0]) for a in args]
        results = await prepared.run_ubatches(fwd, args)
        refs += [weakref.ref(r) for r in results]
        del args, results
        assert [r() for r in refs] == [None] * 4
    finally:
        gc.enable()
