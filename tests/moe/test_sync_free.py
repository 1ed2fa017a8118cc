"""The sync-free MoE path (``MoEConfig.sync_free``): counts, offsets and splits stay on the device,
so one DBO step issues no host sync between its yields (checked on CPU tensors with
:class:`asyncdbo.syncs.HostSyncs` in its forbidding mode, which refuses every op that
would make the host wait on an accelerator), and every output is bitwise the exact path's."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from _moe_ranks import DEEPSEEK_LIKE, MIXTRAL_LIKE, moe_sync_free_vs_exact, moe_sync_free_without_bound

import asyncdbo
from asyncdbo.syncs import HostSyncs
from asyncdbo.dist import dispatch_options
from asyncdbo.dist.fused import padded_window
from asyncdbo.moe import MoEConfig, MoELayer
from asyncdbo.testing import RankPool

SIZES = [[5, 3], [0, 7]]  # uneven ubatches and an empty one; max_tokens is the largest call (7)


def _layers(cfg: dict[str, Any], schedule: str) -> tuple[MoELayer, MoELayer]:
    return (MoELayer(MoEConfig(**cfg, schedule=schedule), seed=7),
            MoELayer(MoEConfig(**cfg, schedule=schedule, sync_free=True), seed=7))


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["role", "ubatch"])
@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("cfg", [MIXTRAL_LIKE, DEEPSEEK_LIKE], ids=["mixtral", "deepseek"])
async def test_one_rank_dbo_step_issues_no_host_sync_and_gives_the_exact_numbers(
        cfg: dict[str, Any], schedule: str, policy: str) -> None:
    exact, free = _layers(cfg, schedule)
    x_TD = torch.randn(100, 32, generator=torch.Generator().manual_seed(1))
    ref_TD = await exact(x_TD)
    with HostSyncs(forbid=True) as syncs:
        serial_TD = await free(x_TD)
        outs = await asyncdbo.run_ubatches(free, [(x_TD[:37],), (x_TD[37:37],), (x_TD[37:],)], backend="host",
                                           stream_policy=policy)
    assert syncs.count == 0
    assert torch.equal(serial_TD, ref_TD) and torch.equal(torch.cat(outs), ref_TD)


@pytest.mark.asyncio
async def test_the_exact_path_syncs_where_the_issue_counted() -> None:
    # The CPU default (sync_free off): 11 syncing ops and a .tolist() per forward at EP 1, none
    # of them from the dispatch plan any more (its counts come from the sorted ids).
    exact, _ = _layers(MIXTRAL_LIKE, "ht")
    x_TD = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with HostSyncs() as syncs:
        await exact(x_TD)
    assert syncs.by_op() == {"aten.nonzero": 8, "aten.repeat_interleave": 1, "aten._unique2": 1, "Tensor.tolist": 1}
    assert {r.where.rsplit("/", 2)[-2] for r in syncs.records} == {"moe", "dist"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["split", "fused"])
@pytest.mark.parametrize("policy", ["role", "ubatch"])
@pytest.mark.parametrize("schedule", ["ht", "ll"])
def test_two_ranks_dbo_step_issues_no_host_sync_and_gives_the_exact_numbers(
        pool: RankPool, schedule: str, policy: str, mode: str) -> None:
    for r in pool.run(moe_sync_free_vs_exact, dict(DEEPSEEK_LIKE, schedule=schedule), SIZES, policy, mode):
        assert r["equal"] and r["syncs"] == 0
        per_ubatch = ["dispatch+counts"] if mode == "fused" else ["counts", "dispatch"]
        assert r["sent"] == sorted(["combine", *per_ubatch] * 2)


@pytest.mark.timeout(60)
def test_sync_free_under_ep_without_a_declared_bound_is_refused(pool: RankPool) -> None:
    for msg in pool.run(moe_sync_free_without_bound):
        assert msg == (
            "MoE layer sf: sync_free=True under expert parallelism (2 ranks) needs the most tokens any rank's call "
            "carries, to size the blocks alike on every rank: run it inside asyncdbo.dist.dispatch_options(max_tokens=...)"
        )


def test_the_bound_sizes_the_blocks_and_a_call_above_it_is_refused_before_anything_is_sent() -> None:
    kw = dict(top_k=2, experts_per_rank=4, ranks=2, required=True)
    with dispatch_options(8):
        assert padded_window("L0", 8, **kw) == (16, 8)  # C = max_tokens * min(K, L), M = max_tokens
        with pytest.raises(ValueError, match=re.escape(
                "MoE layer L0: a call of 9 tokens inside dispatch_options(max_tokens=8); raise max_tokens to the "
                "most tokens any rank's call carries")):
            padded_window("L0", 9, **kw)
    assert padded_window("L0", 9, **dict(kw, ranks=1)) == (18, 9)  # one rank: the call itself is the bound
    assert padded_window("L0", 9, **dict(kw, required=False)) is None  # auto without a bound: exact splits


@pytest.mark.asyncio
async def test_a_routing_that_picks_one_expert_twice_is_refused_on_the_device() -> None:
    _, free = _layers(MIXTRAL_LIKE, "ht")

    def twice(x_TD: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        T = x_TD.shape[0]
        return torch.full((T, 2), 0.5), torch.zeros((T, 2), dtype=torch.int64)

    free._route = twice
    with pytest.raises(RuntimeError, match=re.escape(
            "MoE dispatch: a token picked one expert twice, so an expert got more rows than the 4 tokens of the "
            "call; the sync-free layout holds at most 4 rows per (rank, expert) and 8 per rank")):
        await free(torch.randn(4, 32))


def test_sync_free_must_be_a_bool_or_none() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "MoEConfig.sync_free must be True, False or None (on for accelerator inputs) (got 'yes')")):
        MoEConfig(**MIXTRAL_LIKE, sync_free="yes")  # type: ignore[arg-type]
