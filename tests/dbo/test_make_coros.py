"""Making the ubatch coroutines (``fn(*args)`` per entry of ``ubatch_args``, before any runs): an
exception there keeps its type and gains a note naming the entry, and the coroutines made before
it are closed, so none warns "coroutine ... was never awaited" on top of the error."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Coroutine
from typing import Any

import pytest

import asyncdbo
from asyncdbo import dbo_yield

pytestmark = pytest.mark.timeout(30)


async def fwd(x: int) -> int:
    await dbo_yield("a")
    return x


def test_fn_raising_on_an_entry_closes_the_coroutines_made_and_names_the_entry() -> None:
    async def main() -> list[int]:
        return await asyncdbo.run_ubatches(fwd, [(1,), (2,), (1, 2), (3,)])  # type: ignore[list-item]

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(TypeError) as info:
            asyncdbo.run(main)
        exc = info.value
        del info
        gc.collect()
    assert str(exc) == "fwd() takes 1 positional argument but 2 were given"
    assert exc.__notes__ == ["asyncdbo: raised by 'fwd'(*ubatch_args[2]), making ubatch 2's coroutine; no ubatch ran"]
    assert [str(w.message) for w in record] == []  # without the close: "coroutine 'fwd' was never awaited"


@pytest.mark.parametrize("raised", [ValueError("bad shape"), KeyboardInterrupt()])
def test_every_coroutine_made_before_the_failing_call_is_closed(raised: BaseException) -> None:
    made: list[Coroutine[Any, Any, int]] = []

    def make(x: int) -> Coroutine[Any, Any, int]:  # a plain function returning a coroutine, as allowed
        if x == 2:
            raise raised
        made.append(fwd(x))
        return made[-1]

    async def main() -> list[int]:
        return await asyncdbo.run_ubatches(make, [(0,), (1,), (2,)])

    with pytest.raises(type(raised)) as info:
        asyncdbo.run(main)
    assert info.value is raised
    assert raised.__notes__ == [
        "asyncdbo: raised by 'test_every_coroutine_made_before_the_failing_call_is_closed.<locals>.make'"
        "(*ubatch_args[2]), making ubatch 2's coroutine; no ubatch ran"
    ]
    assert [c.cr_frame for c in made] == [None, None]  # closed, never started


def test_the_errors_about_an_entry_itself_carry_no_note_and_close_what_was_made() -> None:
    async def main(args: list[Any]) -> list[int]:
        return await asyncdbo.run_ubatches(fwd, args)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(TypeError) as info:
            asyncdbo.run(main, [(0,), 7])
        assert str(info.value) == ("ubatch_args[1] is 7; each entry must be a tuple of arguments for fn "
                                   "(write (7,) for a single argument)")
        assert not hasattr(info.value, "__notes__")
        del info
        gc.collect()
    assert [str(w.message) for w in record] == []


def test_a_coroutine_passed_as_fn_is_closed_when_a_bad_option_fails_first() -> None:
    async def main() -> None:
        coros = [fwd(0), fwd(1)]
        with pytest.raises(TypeError, match=r"^name must be a str or None \(got 7 of type int\)$"):
            await asyncdbo.run_ubatches(coros[0], [(0,)], name=7)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^run_ubatches\(\) got an unexpected keyword argument 'bakend'"):
            await asyncdbo.run_ubatches_with_stats(coros[1], [(0,)], bakend="host")  # type: ignore[arg-type]
        assert [c.cr_frame for c in coros] == [None, None]  # closed, never started

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        asyncdbo.run(main)
        gc.collect()
    assert [str(w.message) for w in record] == []  # without the close: "coroutine 'fwd' was never awaited"
