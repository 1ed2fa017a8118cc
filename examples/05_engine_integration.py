"""An engine's model runner adopting asyncdbo (docs/integration.md), on a Qwen3-MoE checkpoint.

    python examples/05_engine_integration.py

Two local ranks (DP = EP = 2) each hold a ``ModelRunner`` the way a vLLM or SGLang worker holds
one: built once from a checkpoint directory (each rank reads its own experts), then called
synchronously once per engine step with the requests the scheduler picked.  Inside, the only async
call is ``DBORunner.step``: it votes with the other rank (microbatch or not), splits the batch,
runs the ubatches interleaved on this thread, and merges the logits.  Everything around it stays
synchronous: input preparation, the sampler, the engine loop.  Rank 1's requests finish earlier;
it keeps stepping with an empty batch, because every rank must join every step's collectives.

The checkpoint is a tiny random Qwen3-MoE saved here with ``save_pretrained`` (nothing is
downloaded); at the end the tokens each rank generated are checked against transformers' greedy
choice over the same tokens.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import torch

from asyncdbo.models.hf.checkpoint import load_checkpoint
from asyncdbo.models.hf.reference import hf_logits, tiny_hf_model
from asyncdbo.plan import StepRecord, ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.testing import run_ranks

STEPS = 4


class ModelRunner:
    """One rank's worker: synchronous to the engine, ``async def`` only below ``execute_model``."""

    def __init__(self, checkpoint: str, group: Any) -> None:
        # Building is collective (the MoE layers make one process group per ubatch slot): every
        # rank constructs its runner at the same time, at start-up, outside any step.
        self.model, _ = load_checkpoint(checkpoint, model="qwen3-moe", ep_group=group, max_ubatches=2,
                                        block_size=16, num_kv_blocks=32)
        thresholds = ThresholdConfig(prefill_threshold=16, decode_threshold=2)  # tiny model, tiny steps
        self.dbo = DBORunner(self.model, RunnerConfig(num_ubatches=2, thresholds=thresholds), dp_group=group)
        self.inputs = BatchBuilder(self.model.kv_cache_config)  # block tables, slot mapping, positions
        self.loop = asyncio.Runner()  # one event loop for the worker's lifetime
        self.records: list[StepRecord] = []

    def execute_model(self, scheduled: list[tuple[int, list[int]]]) -> dict[int, int]:
        """One engine step: the scheduler's ``(request id, new tokens)`` -> one sampled token each."""
        batch = self.inputs.build(scheduled)  # sync input prep (an idle rank builds an empty batch)
        result = self.loop.run(self.dbo.step(batch))  # the one async call: plan, ubatches, merge
        self.records.append(result.record)
        last, out = 0, {}
        for rid, tokens in scheduled:  # a greedy sampler over each request's last row
            last += len(tokens)
            out[rid] = int(result.logits_TV[last - 1].argmax())
        return out

    def close(self) -> None:
        self.loop.close()


def worker(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """The engine loop of one rank: prefill, then decode until each request has its tokens."""
    runner = ModelRunner(checkpoint, torch.distributed.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    prompts = {r: torch.randint(0, 96, (n,), generator=g).tolist() for r, n in enumerate([9, 14, 5][: 3 - rank])}
    wanted = {r: STEPS if rank == 0 else 2 for r in prompts}  # rank 1 is done after 2 tokens
    fed = {r: list(p) for r, p in prompts.items()}
    out: dict[int, list[int]] = {r: [] for r in prompts}
    scheduled = [(r, list(p)) for r, p in prompts.items()]
    for _ in range(STEPS):
        for rid, token in runner.execute_model(scheduled).items():
            out[rid].append(token)
        scheduled = [(r, [out[r][-1]]) for r in prompts if len(out[r]) < wanted[r]]
        for rid, tokens in scheduled:
            fed[rid].extend(tokens)
    runner.close()
    steps = [f"{sum(rec.ubatch_num_tokens)} tokens -> ubatches {list(rec.ubatch_num_tokens)}"
             + (f" ({rec.reason.value}: {rec.detail})" if rec.detail else "") for rec in runner.records]
    return {"fed": fed, "out": out, "steps": steps, "stats": runner.dbo.stats.summary()}


if __name__ == "__main__":
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_model = tiny_hf_model("qwen3-moe")
    with tempfile.TemporaryDirectory() as ckpt:
        hf_model.save_pretrained(ckpt)
        results = run_ranks(worker, 2, ckpt, timeout_s=120)
    for rank, res in enumerate(results):
        print(f"rank {rank}: {res['stats']}")
        for i, line in enumerate(res["steps"]):
            print(f"  step {i}: {line}")
        for rid, tokens in res["out"].items():
            ref = hf_logits(hf_model, res["fed"][rid]).argmax(-1).tolist()
            same = ref[len(res["fed"][rid]) - len(tokens):] == tokens
            print(f"  request {rid}: generated {tokens}, transformers' greedy tokens {'identical' if same else 'DIFFER'}")
            assert same, (rank, rid)
