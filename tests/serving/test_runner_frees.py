"""A runner step that raises frees its Batch and every tensor of it once the caller drops the
error, by reference counting alone (no cycle through the exception's traceback), on the kernel's C
and Python loops."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from _model_ranks import SMALL, tokens

from asyncdbo import dbo_current_ubatch_id, dbo_yield
from asyncdbo.models import MiniModel
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


class Boom(Exception):
    pass


class FailsInUbatch1:
    """MiniModel whose ubatch 1 raises after its first layer's worth of work and a yield."""

    def __init__(self, model: MiniModel) -> None:
        self.model = model
        self.max_ubatches = model.max_ubatches

    async def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> torch.Tensor:
        if dbo_current_ubatch_id() == 1:
            h_TD = ids_T.float() * 2  # an intermediate tensor, alive in this frame when it raises
            await dbo_yield("before the failure")
            raise Boom(f"ubatch 1 failed with {h_TD.shape[0]} tokens")
        return await self.model.forward(ids_T, pos_T, attn)


async def test_a_step_that_raises_frees_its_batch_and_tensors_without_gc(kernel_loop: str) -> None:
    cfg = RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=8))
    runner = DBORunner(FailsInUbatch1(MiniModel(SMALL)), cfg)
    builder = BatchBuilder(SMALL.kv_cache_config)
    for attempt in range(3):
        batch = builder.build([(attempt, list(tokens(24, attempt)))])
        refs = [weakref.ref(batch)] + [weakref.ref(t) for t in vars(batch).values() if isinstance(t, torch.Tensor)]
        refs += [weakref.ref(t) for t in vars(batch.attn).values() if isinstance(t, torch.Tensor)]
        assert len(refs) > 4
        gc.collect()
        gc.disable()
        try:
            try:
                await runner.step(batch)
            except Boom as exc:
                assert str(exc) == "ubatch 1 failed with 12 tokens"
            else:
                raise AssertionError("the step did not raise")
            del batch
            alive = [r() for r in refs if r() is not None]
            assert alive == [], [type(a).__name__ for a in alive]
        finally:
            gc.enable()
