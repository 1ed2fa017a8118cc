"""The sync entry point asyncdbo.run: loop selection and misuse errors."""

from __future__ import annotations

import asyncio

import pytest

import asyncdbo

pytestmark = pytest.mark.timeout(30)


def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


async def _which_loop() -> str:
    return _loop_module()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_run_refuses_to_nest_in_a_running_loop() -> None:
    with pytest.raises(RuntimeError, match=r"asyncdbo.run\(\) cannot be called from a running event loop"):
        asyncdbo.run(_which_loop)


def test_run_uses_uvloop_by_default_and_asyncio_on_request() -> None:
    assert asyncdbo.run(_which_loop).startswith("uvloop")
    assert asyncdbo.run(_which_loop, loop="asyncio").startswith("asyncio")
    with pytest.raises(ValueError, match=r"loop must be 'auto', 'uvloop' or 'asyncio' \(got 'trio'\)"):
        asyncdbo.run(_which_loop, loop="trio")  # type: ignore[arg-type]


def test_run_with_a_coroutine_object_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"asyncdbo.run expects an async function, but got the coroutine object"):
        asyncdbo.run(_which_loop())  # type: ignore[arg-type]


def test_run_with_a_plain_function_gets_the_same_message_as_run_ubatches() -> None:
    def forward(x: int) -> int:
        return x

    with pytest.raises(TypeError) as info:
        asyncdbo.run(forward, 1)  # type: ignore[arg-type]
    assert str(info.value) == (
        "async_fn must be an async def function: "
        "'test_run_with_a_plain_function_gets_the_same_message_as_run_ubatches.<locals>.forward'(*args) "
        "returned int, not a coroutine"
    )

    async def main() -> None:
        await asyncdbo.run_ubatches(forward, [(1,)])  # type: ignore[arg-type]

    with pytest.raises(TypeError) as info:
        asyncdbo.run(main)
    assert str(info.value) == (
        "fn must be an async def function: "
        "'test_run_with_a_plain_function_gets_the_same_message_as_run_ubatches.<locals>.forward'(*ubatch_args[0]) "
        "returned int, not a coroutine"
    )
    with pytest.raises(TypeError) as info:
        asyncdbo.run(5)  # type: ignore[arg-type]
    assert str(info.value) == "asyncdbo.run expects an async function as async_fn, got 5"


async def _loop_debug() -> bool:
    return asyncio.get_running_loop().get_debug()


def test_loop_debug_is_the_event_loops_flag_and_debug_is_its_deprecated_name() -> None:
    assert asyncdbo.run(_loop_debug, loop="asyncio", loop_debug=True) is True
    assert asyncdbo.run(_loop_debug, loop="asyncio") is False
    with pytest.warns(DeprecationWarning) as record:
        assert asyncdbo.run(_loop_debug, loop="asyncio", debug=True) is True
    assert [str(w.message) for w in record] == [
        "asyncdbo.run(debug=...) is renamed loop_debug: it is the event loop's debug mode, not DBO's "
        "(for that pass debug=True to run_ubatches or DBOOptions); debug= stops working in the next release"
    ]
    assert record[0].filename == __file__  # points at the caller's line


class _CountsRepr:
    reprs = 0

    def __repr__(self) -> str:
        type(self).reprs += 1
        return "_CountsRepr()"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_run_returns_its_result_without_formatting_it(loop: str) -> None:
    # asyncio's Runner formats its SIGINT handler, and with it the task's result, on the way out
    # (CPython issue 112559): a tensor's repr costs milliseconds. asyncdbo.run's task returns None.
    result = _CountsRepr()

    async def give() -> _CountsRepr:
        return result

    assert asyncdbo.run(give, loop=loop) is result  # type: ignore[arg-type]
    assert _CountsRepr.reprs == 0


def test_run_raises_what_its_function_raises() -> None:
    async def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        asyncdbo.run(fail)
