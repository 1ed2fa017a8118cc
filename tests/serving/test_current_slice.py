"""``current_slice()``: what a model's ubatch learns of its place in the step, as a specification.

Each ubatch of a runner step holds its plan slice (the model's own coroutine, or, for a
``forward`` that is no ``async def``, the runner's frame around it); a step that falls back holds
the whole-batch slice; outside a step's ubatches, a run one of them starts of its own included,
there is none.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncdbo import dbo_yield, run_ubatches
from asyncdbo.plan import ThresholdConfig, UBatchSlice
from asyncdbo.serving import BatchBuilder, DBORunner, KVCacheConfig, RunnerConfig, current_slice

CACHE = KVCacheConfig(num_layers=1, num_blocks=64, block_size=16, num_heads=1, head_dim=8)
LOW = ThresholdConfig(decode_threshold=1, prefill_threshold=1)


class _Seen:
    """Records, per ubatch, the slice before and after a yield, and what a run it starts sees."""

    max_ubatches = 4

    def __init__(self) -> None:
        self.seen: list[tuple[UBatchSlice | None, UBatchSlice | None, list[UBatchSlice | None]]] = []

    async def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> torch.Tensor:
        before = current_slice()
        await dbo_yield()

        async def inner(_: int) -> UBatchSlice | None:
            await dbo_yield()
            return current_slice()

        nested = await run_ubatches(inner, [(0,), (1,)])
        self.seen.append((before, current_slice(), nested))
        return ids_T.float().unsqueeze(1)


class _Returns:
    """``forward`` a plain function that returns the coroutine of an ``async def``."""

    max_ubatches = 4

    def __init__(self) -> None:
        self.model = _Seen()

    def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> Any:
        return self.model.forward(ids_T, pos_T, attn)


@pytest.mark.asyncio
@pytest.mark.parametrize("wrapped", [False, True])
async def test_each_ubatch_holds_its_plan_slice_and_nothing_outside_the_steps_ubatches(wrapped: bool) -> None:
    holder = _Returns() if wrapped else None
    model: Any = holder if holder is not None else _Seen()
    seen = holder.model.seen if holder is not None else model.seen
    runner = DBORunner(model, RunnerConfig(num_ubatches=3, thresholds=LOW, backend="host"))
    batch = BatchBuilder(CACHE).build([(0, [1, 2, 3, 4, 5]), (1, [6, 7]), (2, [8, 9, 10, 11, 12])])
    assert current_slice() is None
    res = await runner.step(batch)
    assert res.plan.microbatched and len(res.plan.slices) == 3
    assert seen == [(s, s, [None, None]) for s in res.plan.slices]
    assert current_slice() is None
    seen.clear()
    off = await runner.step(batch, enabled=False)  # the fall-back: one whole-batch slice
    assert seen == [(off.plan.slices[0], off.plan.slices[0], [None, None])]
    assert off.plan.slices[0].token_slice == slice(0, 12)
