"""A model whose step time is set by the test (an injected clock), for the "auto" tuning's tests;
and the function its DP test runs on RankPool ranks (module level: pickled by name)."""

from __future__ import annotations

import random
from typing import Any

import torch

import asyncdbo
from asyncdbo import dbo_num_ubatches, dbo_yield
from asyncdbo.lowlevel import VirtualClock
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import AutoConfig, BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.serving.kv_cache import KVCacheConfig

# Shape legend: T = tokens, V = vocab.

CACHE = KVCacheConfig(num_layers=1, num_blocks=256, block_size=4, num_heads=1, head_dim=4)
VOCAB = 8


class ClockedModel:
    """Each ubatch's forward advances ``clock`` by ``cost[N] * tokens * noise`` (N: the run's
    ubatch count; ``noise``: a factor drawn from ``rng`` in [1 - jitter, 1 + jitter]); no compute."""

    def __init__(self, clock: VirtualClock, cost: dict[int, float], *, jitter: float = 0.0, seed: int = 0) -> None:
        self.clock, self.cost, self.jitter = clock, cost, jitter
        self.rng = random.Random(seed)

    async def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> torch.Tensor:
        noise = 1.0 + self.rng.uniform(-self.jitter, self.jitter)
        self.clock.advance(self.cost[dbo_num_ubatches()] * ids_T.numel() * noise)
        await dbo_yield("layer")  # a hand-over, as a model's MoE layer has
        return torch.zeros(ids_T.numel(), VOCAB)


def decode_batches(builder: BatchBuilder, sizes: list[int]) -> list[Any]:
    out = []
    for n in sizes:
        builder.reset()
        out.append(builder.build([(rid, [1]) for rid in range(n)]))
    return out


async def _agree(rank: int, steps: int) -> dict[str, Any]:
    # Each rank's step times differ (its own costs and noise); the group's slowest decides.
    clock = VirtualClock()
    cost = {1: 1.0e-3, 2: 0.9e-3, 3: 0.8e-3 * (1 + 0.05 * rank), 4: 0.85e-3}
    model = ClockedModel(clock, cost, jitter=0.02, seed=rank)
    cfg = RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32))
    runner = DBORunner(model, cfg, dp_group=torch.distributed.group.WORLD, clock=clock)
    builder = BatchBuilder(CACHE)
    records = []
    for i, batch in enumerate(decode_batches(builder, [64 + (i * 7 + rank * 13) % 60 for i in range(steps)])):
        records.append((await runner.step(batch)).record)
    return {"records": records, "report": runner.report()}


def agree(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    return asyncdbo.run(_agree, rank, steps)  # type: ignore[arg-type]


def auto_groups(rank: int, world_size: int) -> dict[str, Any]:
    """What an "auto" runner over a model whose EP spans every rank says of each DP group: none, a
    one-rank group (each rank votes alone), the whole world."""
    from _model_ranks import SMALL

    from asyncdbo.models import MiniModel

    model = MiniModel(SMALL)  # EP over the default group: both ranks (a collective, as built on both)
    alone = [torch.distributed.new_group([r]) for r in range(world_size)][rank]  # new_group: a collective
    out: dict[str, Any] = {}
    for name, group in (("none", None), ("alone", alone), ("world", torch.distributed.group.WORLD)):
        try:
            DBORunner(model, RunnerConfig(tuning="auto"), dp_group=group)
            out[name] = "ok"
        except ValueError as exc:
            out[name] = str(exc)
    DBORunner(model, RunnerConfig(), dp_group=None)  # a fixed runner plans from its thresholds: not refused
    return out


async def _mismatched(rank: int, case: str) -> str:
    """One step of runners whose ranks were configured apart (``case``), voting over both ranks:
    the error every rank raises."""
    clock = VirtualClock()
    model = ClockedModel(clock, {1: 1.0e-3, 2: 0.9e-3, 3: 0.8e-3, 4: 0.85e-3})
    auto = RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32))
    cfg = {"tuning": [auto, RunnerConfig(thresholds=ThresholdConfig(decode_threshold=32))],
           "margin": [auto, RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32),
                                         auto=AutoConfig(margin=0.05))],
           "counts": [auto, RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32),
                                         auto=AutoConfig(ubatch_counts=(2, 3)))]}[case][rank]
    runner = DBORunner(model, cfg, dp_group=torch.distributed.group.WORLD, clock=clock)
    try:
        await runner.step(decode_batches(BatchBuilder(CACHE), [64])[0])
    except ValueError as exc:
        return str(exc)
    return "ok"


def mismatched(rank: int, world_size: int, case: str) -> str:
    return asyncdbo.run(_mismatched, rank, case)  # type: ignore[arg-type]


async def _agree_change(rank: int, steps: int, change: int) -> dict[str, Any]:
    # DBO loses on both ranks (off settles); at step ``change`` rank 1's link gets slower: its off
    # steps 1.6x, N = 2 0.85x of that. The group's slowest time moves, so both ranks see the change.
    clock = VirtualClock()
    model = ClockedModel(clock, {1: 1.0e-3, 2: 1.3e-3, 3: 1.4e-3, 4: 1.5e-3}, jitter=0.05, seed=rank)
    small = AutoConfig(splits=("token",), dispatches=("auto",))
    cfg = RunnerConfig(tuning="auto", auto=small, thresholds=ThresholdConfig(decode_threshold=32))
    runner = DBORunner(model, cfg, dp_group=torch.distributed.group.WORLD, clock=clock)
    records = []
    for i, batch in enumerate(decode_batches(BatchBuilder(CACHE), [64 + (i * 7 + rank * 13) % 60 for i in range(steps)])):
        if i == change and rank == 1:
            model.cost = {1: 1.6e-3, 2: 1.36e-3, 3: 1.5e-3, 4: 1.6e-3}
        records.append((await runner.step(batch)).record)
    return {"records": records, "report": runner.report()}


def agree_change(rank: int, world_size: int, steps: int, change: int) -> dict[str, Any]:
    return asyncdbo.run(_agree_change, rank, steps, change)  # type: ignore[arg-type]
