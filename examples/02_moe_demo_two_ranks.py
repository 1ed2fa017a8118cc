"""Two local ranks (DP=2, EP=2) run the mini MoE model with Dual Batch Overlap and check it
against the single-batch run.

    python examples/02_moe_demo_two_ranks.py

Each rank owns its requests and KV cache; the experts are split over both ranks, so every MoE
layer does an all-to-all dispatch and combine.  ``DBORunner.step`` plans the step with the other
rank (one all-reduce), cuts the batch into two ubatches, runs them interleaved on one thread, and
merges the logits.  Rank 1 has fewer tokens: it pads to rank 0's size so both run the same
collectives.  On a CPU the model runs in deterministic mode (the default), so the merged logits
are bitwise equal to the single-batch ones.
"""

from __future__ import annotations

import torch

import asyncdbo
from asyncdbo.models import MiniConfig, MiniModel
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.testing import run_ranks

CFG = MiniConfig(hidden_size=128, num_layers=2, num_experts=4, top_k=2)


async def rank_main(rank: int) -> str:
    group = torch.distributed.group.WORLD
    runner_cfg = RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=64))
    serial = DBORunner(MiniModel(CFG, ep_group=group), runner_cfg, dp_group=group)
    dbo = DBORunner(MiniModel(CFG, ep_group=group), runner_cfg, dp_group=group)
    g = torch.Generator().manual_seed(rank)
    lengths = [50, 70] if rank == 0 else [30, 40]  # rank 0: 120 tokens, rank 1: 70 (pads to 120)
    chunks = [(r, torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()) for r, n in enumerate(lengths)]
    batch = BatchBuilder(CFG.kv_cache_config).build(chunks)
    a = await serial.step(batch, enabled=False)
    b = await dbo.step(batch)
    assert torch.equal(a.logits_TV, b.logits_TV), (a.logits_TV - b.logits_TV).abs().max()
    rec = b.record
    return (f"rank {rank}: {batch.num_tokens} tokens -> ubatches {list(rec.ubatch_num_tokens)} real / "
            f"{list(rec.ubatch_num_tokens_padded)} padded ({rec.reason.value}), {b.num_switches} switches, "
            f"logits bitwise equal to the serial step")


def on_rank(rank: int, world_size: int) -> str:
    return asyncdbo.run(rank_main, rank)


if __name__ == "__main__":
    for line in run_ranks(on_rank, 2, timeout_s=120):
        print(line)
