"""Functions the runner and demo tests run on RankPool ranks (module level: pickled by name).

A *case* describes one scenario: per-rank steps of chunks ``(request_id, token_ids)``, the runner
config, and per-rank overrides.  :func:`serial_vs_dbo` runs the steps twice on two models with
the same weights and separate KV caches, once with DBO off and once on, so a DBO step can only
read K/V that DBO steps wrote; ``bitwise`` says whether every step's logits were ``torch.equal``.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass, field, replace
from typing import Any

import torch

import asyncdbo
from asyncdbo.backends import LinkSpec
from asyncdbo.models import MiniConfig, MiniModel
from asyncdbo.models.hf.generate import worst_diff
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

# Shape legend: T = tokens, V = vocab.

SMALL = MiniConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2, head_dim=32, num_experts=4,
                   top_k=2, moe_intermediate_size=64, block_size=4, num_kv_blocks=64)
ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)


@dataclass(frozen=True, kw_only=True)
class Case:
    """``steps[rank][i]``: the chunks rank ``rank`` runs in step ``i`` (empty: idle)."""

    steps: tuple[tuple[tuple[tuple[int, tuple[int, ...]], ...], ...], ...]
    model: MiniConfig = SMALL
    runner: RunnerConfig = field(default_factory=lambda: RunnerConfig(thresholds=ALWAYS))
    disabled_ranks: tuple[int, ...] = ()  # these ranks vote no (enabled=False) in the DBO run
    loop: str = "auto"


def tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist())


async def _serial_vs_dbo(rank: int, case: Case) -> dict[str, Any]:
    group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    max_ub = max(case.runner.num_ubatches, 2)
    serial = DBORunner(MiniModel(case.model, ep_group=group, max_ubatches=max_ub), case.runner, dp_group=group)
    dbo = DBORunner(MiniModel(case.model, ep_group=group, max_ubatches=max_ub), case.runner, dp_group=group)
    builder = BatchBuilder(case.model.kv_cache_config)
    out: dict[str, Any] = {"max_abs_diff": 0.0, "bitwise": True, "records": [], "serial_records": [], "num_tokens": []}
    for chunks in case.steps[rank]:
        batch = builder.build([(rid, list(toks)) for rid, toks in chunks])
        s = await serial.step(batch, enabled=False)
        d = await dbo.step(batch, enabled=rank not in case.disabled_ranks)
        assert s.logits_TV.shape == d.logits_TV.shape == (batch.num_tokens, case.model.vocab_size)
        out["bitwise"] &= torch.equal(s.logits_TV, d.logits_TV)
        if batch.num_tokens:
            out["max_abs_diff"] = worst_diff([out["max_abs_diff"], (s.logits_TV - d.logits_TV).abs().max().item()])
        out["records"].append(d.record)
        out["serial_records"].append(s.record)
        out["num_tokens"].append(batch.num_tokens)
    out["stats"] = dbo.stats.summary()
    return out


def serial_vs_dbo(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    return asyncdbo.run(_serial_vs_dbo, rank, case, loop=case.loop)  # type: ignore[arg-type]


async def _fail_mid_step(rank: int, world_size: int) -> None:
    group = torch.distributed.group.WORLD
    runner = DBORunner(MiniModel(SMALL, ep_group=group), RunnerConfig(thresholds=ALWAYS, watchdog_s=None), dp_group=group)
    batch = BatchBuilder(SMALL.kv_cache_config).build([(0, list(tokens(16, rank)))])
    await runner.step(batch)  # one good step on every rank
    if rank == 1:
        raise RuntimeError("rank 1 lost its expert weights")
    await runner.step(batch)  # rank 0 waits in a collective rank 1 never joins


def fail_mid_step(rank: int, world_size: int) -> None:
    asyncdbo.run(_fail_mid_step, rank, world_size)


# A modeled link on which one message's latency (1 ms) outweighs the padding of a decode ubatch's
# fused buffer (SMALL on 2 ranks, 3 tokens: 8 padded rows of 256 B, 0.5 ms at 4 MB/s) but not a
# prefill ubatch's (23 tokens: 48 rows, 3 ms), so ``dispatch="auto"`` fuses the one and splits
# the other (asyncdbo.dist.choose_dispatch).
DISPATCH_LINK = LinkSpec(name="test-latency-bound", latency_s=1e-3, bandwidth_Bps=4e6)


async def _dispatch_per_step(rank: int, case: Case, dp: bool) -> dict[str, Any]:
    """Every step run serially and with DBO under ``case.runner`` (a modeled link): whether the
    logits are equal bit for bit, and which messages each DBO step sent. EP spans the ranks; the
    runners vote over them too, or with ``dp=False`` have no DP group (each plans alone)."""
    group = torch.distributed.group.WORLD
    dp_group = group if dp else None
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        serial = DBORunner(MiniModel(case.model, ep_group=group), replace(case.runner, dispatch="split"),
                           dp_group=dp_group)
        dbo = DBORunner(MiniModel(case.model, ep_group=group), case.runner, dp_group=dp_group)
    builder = BatchBuilder(case.model.kv_cache_config)
    out: dict[str, Any] = {"bitwise": True, "sent": [], "microbatched": [],
                           "warned": [(w.category.__name__, str(w.message)) for w in warned]}
    for chunks in case.steps[rank]:
        batch = builder.build([(rid, list(toks)) for rid, toks in chunks])
        s = await serial.step(batch, enabled=False)
        d = await dbo.step(batch)
        out["bitwise"] &= torch.equal(s.logits_TV, d.logits_TV)
        out["sent"].append(sorted({c.what for c in d.comm}))
        out["microbatched"].append(d.record.microbatched)
    return out


def dispatch_per_step(rank: int, world_size: int, case: Case, dp: bool = True) -> dict[str, Any]:
    return asyncdbo.run(_dispatch_per_step, rank, case, dp)  # type: ignore[arg-type]
