"""Functions the measurement and auto-policy tests run on RankPool ranks (module level: pickled
by name)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from _model_ranks import ALWAYS, SMALL, tokens

import asyncdbo
from asyncdbo.backends import LinkSpec
from asyncdbo.models import MiniModel
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

# A slow modeled link: each message costs 2 ms of latency, so a step's comm is long next to the
# small model's compute and a ubatch parked on it leaves the other ubatch time to compute.
SLOW_LINK = LinkSpec(name="test-slow", latency_s=2e-3, bandwidth_Bps=1e9)


async def _timed_steps(rank: int) -> dict[str, Any]:
    group = torch.distributed.group.WORLD
    cfg = RunnerConfig(thresholds=ALWAYS, backend="host", link=SLOW_LINK, dispatch="split")
    runner = DBORunner(MiniModel(replace(SMALL, num_layers=4), ep_group=group), cfg, dp_group=group)
    builder = BatchBuilder(SMALL.kv_cache_config)
    out: dict[str, Any] = {"dbo": [], "off": []}
    for i in range(2):
        batch = builder.build([(2 * i, list(tokens(12, i))), (2 * i + 1, list(tokens(12, i + 7)))])
        out["dbo"].append((await runner.step(batch)).record)
        batch = builder.build([(100 + 2 * i, list(tokens(12, i))), (101 + 2 * i, list(tokens(12, i + 7)))])
        out["off"].append((await runner.step(batch, enabled=False)).record)
    out["report"] = runner.report()
    return out


def timed_steps(rank: int, world_size: int) -> dict[str, Any]:
    return asyncdbo.run(_timed_steps, rank)  # type: ignore[arg-type]
