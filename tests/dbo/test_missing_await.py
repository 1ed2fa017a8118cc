"""A missing ``await`` is caught where it is made, never a silent wrong number.

vLLM's primitives are plain calls; a port that keeps one as a call creates an awaitable nothing
runs. The next primitive of that ubatch (or its exit) reports it: a dropped ``dbo_yield`` only
loses overlap, so it warns (an error under ``-W error``, as in this suite); a dropped switch or
event wait could let the ubatch read comm output that has not arrived, so it is an error always;
in debug mode every kind is an error. Every report names the line that created the awaitable.

Each spec runs on the C primitives (asyncdbo/dbo/_speedups.c, where built) and on the pure-Python
ones, which must report the same words and the same line.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncdbo import dbo_wait_event, run_ubatches
from asyncdbo.dbo import MissingAwaitError, primitives

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

HERE = __file__
IMPLS = ["python", "c"] if primitives.FAST is not None else ["python"]
P = SimpleNamespace(**primitives.PURE)  # the implementation the programs below call (set per test)


@pytest.fixture(autouse=True, params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    table = primitives.PURE if request.param == "python" else primitives.FAST
    assert table is not None
    for name, fn in table.items():
        monkeypatch.setattr(P, name, fn)
    return str(request.param)


def line_of(marker: str) -> int:
    with open(HERE) as f:
        return next(i + 1 for i, ln in enumerate(f) if ln.rstrip().endswith(marker))


async def forgets_a_yield(i: int) -> int:
    P.dbo_yield("dispatch")  # FORGOT YIELD
    await P.dbo_yield("combine")
    return i


async def forgets_a_yield_at_the_end(i: int) -> int:
    await P.dbo_yield("dispatch")
    P.dbo_yield("combine")  # FORGOT AT THE END
    return i


async def forgets_a_sync_switch(i: int) -> int:
    await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
    P.dbo_switch_to_compute_sync()  # FORGOT SYNC
    return i  # on the host backend this would read the all-to-all's output before it arrived


async def forgets_a_switch_then_yields(i: int) -> int:
    P.dbo_yield_and_switch_from_compute_to_comm("dispatch")  # FORGOT SWITCH
    await P.dbo_yield("combine")
    return i


def created_at(marker: str, function: str) -> str:
    return f"(created at {HERE}:{line_of(marker)} in {function})"


async def test_a_dropped_yield_warns_at_the_next_primitive_and_names_its_line() -> None:
    with pytest.raises(RuntimeWarning) as info:  # the suite turns warnings into errors
        await run_ubatches(forgets_a_yield, [(0,), (1,)])
    assert str(info.value) == (
        f"asyncdbo: dbo_yield('dispatch') in ubatch 0 was never awaited (missing await?) "
        f"{created_at('FORGOT YIELD', 'forgets_a_yield')}: it did not hand over, so "
        "nothing overlapped there. Write `await dbo_yield('dispatch')`."
    )


async def test_a_dropped_switch_is_an_error_naming_its_line() -> None:
    """The line named is the one that made the awaitable, not the next primitive's."""
    with pytest.raises(MissingAwaitError) as info:
        await run_ubatches(forgets_a_switch_then_yields, [(0,), (1,)], backend="host")
    assert str(info.value).startswith(
        "asyncdbo: dbo_yield_and_switch_from_compute_to_comm('dispatch') in ubatch 0 was never awaited (missing "
        f"await?) {created_at('FORGOT SWITCH', 'forgets_a_switch_then_yields')}: the stream switch"
    )


async def test_a_dropped_yield_warns_once_and_the_run_goes_on_when_warnings_only_print() -> None:
    with pytest.warns(RuntimeWarning, match=r"dbo_yield\(.dispatch.\) in ubatch [01] was never awaited") as record:
        assert await run_ubatches(forgets_a_yield, [(0,), (1,)]) == [0, 1]
    assert len(record) == 2  # one per ubatch
    assert {r.filename for r in record} == {HERE}  # it points at the user's code


async def test_a_yield_dropped_last_is_found_at_the_ubatchs_exit() -> None:
    with pytest.warns(RuntimeWarning, match=r"dbo_yield\(.combine.\) in ubatch [01] was never awaited") as record:
        assert await run_ubatches(forgets_a_yield_at_the_end, [(0,), (1,)]) == [0, 1]
    assert all(created_at("FORGOT AT THE END", "forgets_a_yield_at_the_end") in str(r.message) for r in record)


async def test_a_dropped_sync_switch_is_an_error_even_when_warnings_only_print() -> None:
    with pytest.raises(MissingAwaitError) as info:
        with pytest.warns(RuntimeWarning) if False else _no_filter():
            await run_ubatches(forgets_a_sync_switch, [(0,), (1,)], backend="host")
    assert str(info.value).startswith(
        "asyncdbo: dbo_switch_to_compute_sync() in ubatch 0 was never awaited (missing await?) "
        f"{created_at('FORGOT SYNC', 'forgets_a_sync_switch')}: the stream "
        "switch and its wait did not happen, so what the ubatch read since may be comm output that had not "
        "arrived yet. Write `await dbo_switch_to_compute_sync()`."
    )


@pytest.mark.parametrize("debug", [False, True])
async def test_a_dropped_event_wait_is_an_error_naming_the_key_as_written(debug: bool) -> None:
    async def forward(i: int) -> None:
        if i == 1:
            dbo_wait_event(("kv", 3))  # FORGOT WAIT
            return
        from asyncdbo import dbo_record_event

        dbo_record_event(("kv", 3))

    with pytest.raises(MissingAwaitError) as info:
        await run_ubatches(forward, [(0,), (1,)], debug=debug)
    site = created_at("FORGOT WAIT", "test_a_dropped_event_wait_is_an_error_naming_the_key_as_written.<locals>.forward")
    # The key's own repr, once: the suggested line waits on the same key (not on the string of its repr).
    assert str(info.value) == (
        f"asyncdbo: dbo_wait_event(('kv', 3)) in ubatch 1 was never awaited (missing await?) {site}: the wait on that "
        "event did not happen, so what the ubatch read since may be what the recording ubatch had not written yet. "
        "Write `await dbo_wait_event(('kv', 3))`."
    )


async def test_in_debug_mode_every_dropped_awaitable_is_an_error_naming_its_line() -> None:
    with pytest.raises(MissingAwaitError) as info:
        await run_ubatches(forgets_a_yield, [(0,), (1,)], debug=True)
    assert created_at("FORGOT YIELD", "forgets_a_yield") in str(info.value)
    with pytest.raises(MissingAwaitError) as info:
        await run_ubatches(forgets_a_sync_switch, [(0,), (1,)], debug=True)
    assert created_at("FORGOT SYNC", "forgets_a_sync_switch") in str(info.value)


async def test_awaited_primitives_leave_nothing_to_report() -> None:
    async def forward(i: int) -> int:
        await P.dbo_yield_and_switch_from_compute_to_comm("dispatch")
        await P.dbo_switch_to_compute_sync()
        await P.dbo_yield("combine")
        return i

    assert await run_ubatches(forward, [(0,), (1,)], debug=True) == [0, 1]
    assert await run_ubatches(forward, [(0,), (1,)]) == [0, 1]


class _no_filter:
    """Let warnings print (the suite's filter turns them into errors) for one block."""

    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("default")

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
