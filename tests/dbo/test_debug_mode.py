"""The yield-discipline checker: the first divergence of yield tags, named exactly."""

from __future__ import annotations

import asyncio

import pytest

from asyncdbo import YieldMismatchError, dbo_current_ubatch_id, dbo_yield, run_ubatches
from asyncdbo.dbo.debug import YieldChecker

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def layer(tags_by_ub: dict[int, list[str]], log: list[str]):
    async def forward() -> int:
        ub = dbo_current_ubatch_id()
        for tag in tags_by_ub[ub]:
            log.append(f"ub{ub}:{tag}")
            await dbo_yield(tag)
        return ub

    return forward


async def test_matching_yields_pass_in_debug_mode() -> None:
    log: list[str] = []
    tags = {0: ["attn", "dispatch", "combine"], 1: ["attn", "dispatch", "combine"]}
    assert await run_ubatches(layer(tags, log), [(), ()], debug=True) == [0, 1]
    assert log == ["ub0:attn", "ub1:attn", "ub0:dispatch", "ub1:dispatch", "ub0:combine", "ub1:combine"]


async def test_a_mismatched_pair_is_reported_at_the_first_divergence() -> None:
    log: list[str] = []
    tags = {0: ["attn", "dispatch", "combine"], 1: ["attn", "combine", "dispatch"]}
    msg = (
        r"^yield mismatch in run 'mismatch': ubatch 1 yield #1 is 'combine' at .*tests/dbo/test_debug_mode\.py:\d+ "
        r"in layer\.<locals>\.forward but ubatch 0 yield #1 was 'dispatch' at .*tests/dbo/test_debug_mode\.py:\d+ "
        r"in layer\.<locals>\.forward\. "
        r"Sequences so far: ubatch 0: \['attn', 'dispatch'\]; ubatch 1: \['attn', 'combine'\]\. "
    )
    with pytest.raises(YieldMismatchError, match=msg):
        await run_ubatches(layer(tags, log), [(), ()], debug=True, name="mismatch")
    # the run stopped right there: ubatch 0 never reached its third yield
    assert log == ["ub0:attn", "ub1:attn", "ub0:dispatch", "ub1:combine"]


async def test_a_ubatch_that_stops_yielding_early_is_a_length_mismatch() -> None:
    tags = {0: ["attn", "dispatch", "combine"], 1: ["attn", "dispatch"]}
    msg = (
        r"^yield mismatch in run 'short': ubatch 1 finished after 2 yields \(the last one at "
        r".*tests/dbo/test_debug_mode\.py:\d+ in layer\.<locals>\.forward\) but ubatch 0 made 3 "
        r"\(its yield #2 was 'combine' at .*tests/dbo/test_debug_mode\.py:\d+ in layer\.<locals>\.forward\)\. "
        r"Sequences: ubatch 0: \['attn', 'dispatch', 'combine'\]; "
        r"ubatch 1: \['attn', 'dispatch'\]\. "
    )
    with pytest.raises(YieldMismatchError, match=msg):
        await run_ubatches(layer(tags, []), [(), ()], debug=True, name="short")


async def test_an_empty_ubatch_that_never_yields_is_allowed() -> None:
    tags = {0: ["attn", "combine"], 1: [], 2: ["attn", "combine"]}
    assert await run_ubatches(layer(tags, []), [(), (), ()], debug=True) == [0, 1, 2]


async def test_parking_on_a_completion_is_not_a_yield() -> None:
    # ubatch 0 parks on an asyncio timer between its yields; ubatch 1 does not. Same yield tags.
    async def forward() -> int:
        ub = dbo_current_ubatch_id()
        await dbo_yield("a")
        if ub == 0:
            await asyncio.sleep(0.01)
        await dbo_yield("b")
        return ub

    assert await run_ubatches(forward, [(), ()], debug=True) == [0, 1]


async def test_the_checker_works_as_an_explicit_instrument_and_is_reusable() -> None:
    checker = YieldChecker()
    tags = {0: ["x", "y"], 1: ["x", "y"]}
    await run_ubatches(layer(tags, []), [(), ()], instrument=checker)
    with pytest.raises(YieldMismatchError, match=r"ubatch 1 yield #0 is 'y' at .* but ubatch 0 yield #0 was 'x'"):
        await run_ubatches(layer({0: ["x"], 1: ["y"]}, []), [(), ()], instrument=checker)
    await run_ubatches(layer(tags, []), [(), ()], instrument=checker)


# ---------------------------------------------------------------- blocking code between yields
async def test_debug_mode_reports_a_step_that_blocks_with_its_yield_points_and_lines() -> None:
    import time

    from asyncdbo import run_ubatches_with_stats

    async def forward(i: int) -> int:
        await dbo_yield("attn")
        if i == 1:
            time.sleep(0.05)  # a host sync in disguise: nothing else can run meanwhile
        await dbo_yield("moe")  # BLOCKED BEFORE THIS
        return i

    with open(__file__) as f:
        line = next(n + 1 for n, ln in enumerate(f) if ln.rstrip().endswith("# BLOCKED BEFORE THIS"))
    _, stats = await run_ubatches_with_stats(forward, [(0,), (1,)], debug=True, blocking_s=0.02)
    (step,) = [b for b in stats.blocking if b.ub == 1]
    assert (step.from_tag, step.to_tag) == ("attn", "moe")
    assert step.to_where.endswith(f"tests/dbo/test_debug_mode.py:{line} in test_debug_mode_reports_a_step_that_blocks_with_its_yield_points_and_lines.<locals>.forward")
    assert step.blocked_s >= 0.04  # the 50 ms sleep, less the tick granularity of the kernel's CPU accounting
    assert step.describe().startswith(f"asyncdbo: ubatch 1 blocked the CPU for {step.blocked_s * 1e3:.1f} ms between yield points 'attn'")


async def test_outside_debug_mode_nothing_is_measured() -> None:
    import time

    from asyncdbo import run_ubatches_with_stats

    async def forward(i: int) -> int:
        time.sleep(0.03)
        await dbo_yield("y")
        return i

    _, stats = await run_ubatches_with_stats(forward, [(0,), (1,)], blocking_s=0.01)
    assert stats.blocking == ()


async def test_a_checker_that_fails_the_run_at_its_end_leaves_no_dispatch_mode_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    before = len(_get_current_dispatch_mode_stack())
    with pytest.raises(YieldMismatchError):
        await run_ubatches(layer({0: ["a", "b"], 1: ["a"]}, []), [(), ()], debug=True)
    assert len(_get_current_dispatch_mode_stack()) == before


# ---------------------------------------------------------------- what a user reads
async def test_a_mismatch_names_both_yield_lines_of_the_users_file() -> None:
    async def uneven(skip_first: bool) -> None:
        if not skip_first:
            await dbo_yield("attention")  # line A
        await dbo_yield("moe")  # line B

    import inspect

    src, first = inspect.getsourcelines(uneven)
    line_a = first + next(i for i, s in enumerate(src) if "# line A" in s)
    line_b = first + next(i for i, s in enumerate(src) if "# line B" in s)
    with pytest.raises(YieldMismatchError) as info:
        await run_ubatches(uneven, [(False,), (True,)], debug=True)
    text = str(info.value)
    assert f"ubatch 1 yield #0 is 'moe' at {__file__}:{line_b} in " in text
    assert f"but ubatch 0 yield #0 was 'attention' at {__file__}:{line_a} in " in text

