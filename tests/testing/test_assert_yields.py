"""assert_yields / assert_no_yields: a layer hands over control exactly where the test expects."""

from __future__ import annotations

import asyncio

import pytest

from asyncdbo import (
    dbo_current_ubatch_id,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from asyncdbo.lowlevel import UBatch, get_ubatch
from asyncdbo.testing import assert_no_yields, assert_yields

pytestmark = pytest.mark.timeout(30)


async def moe_layer(x: int) -> int:
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    await dbo_yield_and_switch_from_comm_to_compute("expert")
    await dbo_yield("combine")
    return x + 1


@pytest.mark.asyncio
async def test_assert_yields_passes_for_the_exact_tags_and_counts() -> None:
    async def forward(x: int) -> int:
        with assert_yields("dispatch", "expert", "combine"):
            x = await moe_layer(x)
        async with assert_yields(3):
            x = await moe_layer(x)
        with assert_no_yields():
            x *= 10
        return x

    assert await run_ubatches(forward, [(0,), (5,)]) == [20, 70]


@pytest.mark.asyncio
async def test_assert_yields_reports_the_tags_it_saw() -> None:
    seen: dict[int, str] = {}

    async def forward(x: int) -> int:
        try:
            with assert_yields("dispatch", "combine"):
                x = await moe_layer(x)
        except AssertionError as exc:
            seen[dbo_current_ubatch_id()] = str(exc)
        return x

    await run_ubatches(forward, [(0,), (1,)])
    expected = "expected yields ['dispatch', 'combine'] in ubatch {}, but the block yielded ['dispatch', 'expert', 'combine']"
    assert seen == {0: expected.format(0), 1: expected.format(1)}


@pytest.mark.asyncio
async def test_assert_no_yields_fails_on_a_hidden_yield() -> None:
    async def helper() -> None:
        await dbo_yield("sneaky")

    async def forward() -> None:
        with assert_no_yields():
            await helper()

    with pytest.raises(AssertionError, match=r"^expected 0 yield\(s\) in ubatch 0, but the block yielded 1 time\(s\): \['sneaky'\]"):
        await run_ubatches(forward, [(), ()])


@pytest.mark.asyncio
async def test_parks_are_not_yields_and_nesting_counts_in_both_blocks() -> None:
    async def forward() -> None:
        with assert_yields("a", "b", "c"):
            await dbo_yield("a")
            with assert_yields("b"):
                await asyncio.sleep(0.005)  # a park, not a yield
                await dbo_yield("b")
            await dbo_yield("c")
        assert type(get_ubatch()) is UBatch  # restored after the outermost block

    await run_ubatches(forward, [(), ()])


@pytest.mark.asyncio
async def test_outside_a_run_nothing_yields() -> None:
    with assert_no_yields():
        assert await moe_layer(1) == 2
    with pytest.raises(AssertionError, match=r"expected 3 yield\(s\) outside a DBO run, where the primitives never yield"):
        with assert_yields(3):
            await moe_layer(1)


def test_bad_expectations_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"assert_yields count must be >= 0 \(got -1\)"):
        assert_yields(-1)
    with pytest.raises(ValueError, match=r"use assert_no_yields\(\) for a block that must not yield"):
        assert_yields()
