"""Debug mode's stream check (asyncdbo/dbo/stream_guard.py) and the fake device's report of the
same mistake: a ``with torch.cuda.stream(s):`` block held across a yield leaves ``s`` current for
the next ubatch (issue 48), which nothing reported on a real GPU."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the stream check is torch's streams (CI runs tests/dbo on 3.12/3.13 without torch)")

import asyncdbo  # noqa: E402
from asyncdbo import (
    DBOUsageError,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from asyncdbo.backends.accelerator import AcceleratorBackend
from asyncdbo.testing.fake_device import FakeDevice

pytestmark = pytest.mark.timeout(60)

POLICIES = ("role", "ubatch")


def _line(fn: Any, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


async def held_across_a_yield(i: int, side: Any) -> torch.Tensor:
    x = torch.ones(4)
    if i == 0:
        with torch.cuda.stream(side):  # the block
            await dbo_yield("inside")  # the yield
    else:
        await dbo_yield("inside")
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    await dbo_yield_and_switch_from_comm_to_compute("combine")
    return x + 1


async def clean(i: int) -> torch.Tensor:
    x = torch.ones(4) * i
    await dbo_yield("a")
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    y = x * 2
    await dbo_switch_to_compute_sync()
    z = y + 1
    await dbo_switch_to_comm_sync()
    await dbo_yield_and_switch_from_comm_to_compute("combine")
    return z + 1


@pytest.mark.parametrize("policy", POLICIES)
def test_debug_mode_names_the_line_where_a_ubatch_yields_inside_a_stream_context(policy: str) -> None:
    with FakeDevice() as dev:
        be = AcceleratorBackend("cuda")
        side = torch.cuda.Stream()
        with pytest.raises(DBOUsageError, match="stream context held across a yield") as err:
            asyncdbo.run(lambda: asyncdbo.run_ubatches(held_across_a_yield, [(0, side), (1, side)], backend=be,
                                                       stream_policy=policy, debug=True))
        dev.problems.clear()  # the fake's own findings: the next test
    msg = str(err.value)
    assert f"test_stream_guard.py:{_line(held_across_a_yield, '# the yield')} in held_across_a_yield" in msg
    assert "ubatch 0" in msg and "('inside')" in msg and "docs/troubleshooting.md" in msg


@pytest.mark.parametrize("policy", POLICIES)
def test_debug_mode_passes_a_program_that_switches_streams_with_the_primitives(policy: str) -> None:
    with FakeDevice():
        be = AcceleratorBackend("cuda")
        outs = asyncdbo.run(lambda: asyncdbo.run_ubatches(clean, [(0,), (1,), (2,)], backend=be, stream_policy=policy,
                                                          debug=True))
    assert [o.tolist() for o in outs] == [[2.0] * 4, [4.0] * 4, [6.0] * 4]


def test_without_debug_mode_the_fake_device_names_the_block_and_the_other_ubatchs_first_kernel() -> None:
    with FakeDevice() as dev:
        be = AcceleratorBackend("cuda")
        side = torch.cuda.Stream()
        asyncdbo.run(lambda: asyncdbo.run_ubatches(held_across_a_yield, [(0, side), (1, side)], backend=be))
        found = [p for p in dev.problems if p.startswith("stream context held across a yield")]
        dev.problems.clear()
    assert len(found) == 1, found  # once per block and ubatch, not per kernel
    block = _line(held_across_a_yield, "# the block")
    assert f"`with torch.cuda.stream({side.name})` entered by ubatch 0 of " in found[0]
    assert f"at test_stream_guard.py:{block} in held_across_a_yield" in found[0]
    assert "when ubatch 1 resumed" in found[0]


def test_a_stream_context_closed_before_the_yield_is_not_reported_as_held() -> None:
    async def closed(i: int, side: Any) -> None:
        if i == 0:
            with torch.cuda.stream(side):
                pass
        await dbo_yield("after")
        torch.ones(2)

    with FakeDevice() as dev:
        be = AcceleratorBackend("cuda")
        side = torch.cuda.Stream()
        asyncdbo.run(lambda: asyncdbo.run_ubatches(closed, [(0, side), (1, side)], backend=be, debug=True))
        assert dev.problems == []
