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
