"""Functions the Hugging Face model tests run on RankPool ranks (module level: pickled by name).

Each rank loads a tiny checkpoint the test saved (its own experts only), then generates greedily
twice over the same prompts, serially and with DBO, each run on its own KV cache and feeding its
own greedy tokens.  The parent compares both with transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import asyncdbo
from asyncdbo.models.hf.checkpoint import load_checkpoint
from asyncdbo.models.hf.generate import Generation, greedy_generate
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

ARCHS = ("mixtral", "qwen3-moe", "deepseek-v3")
ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
DECODE_STEPS = 3
VOCAB = 96  # the tiny configs' vocab_size


@dataclass(frozen=True, kw_only=True)
class Variant:
    """How one architecture runs in a case: the MoE schedule and the runner's DBO settings."""

    schedule: str = "ht"
    stream_policy: str = "role"
    num_ubatches: int = 2

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(thresholds=ALWAYS, stream_policy=self.stream_policy,  # type: ignore[arg-type]
                            num_ubatches=self.num_ubatches)


#: Each architecture gets a different schedule / stream policy / ubatch count, so the three
#: together cover both schedules, both policies and 2 and 3 ubatches.
VARIANTS = {
    "mixtral": Variant(schedule="ht", stream_policy="role", num_ubatches=2),
    "qwen3-moe": Variant(schedule="ll", stream_policy="role", num_ubatches=2),
    "deepseek-v3": Variant(schedule="ht", stream_policy="ubatch", num_ubatches=3),
}


def prompts_for(rank: int, idle_ranks: tuple[int, ...] = ()) -> dict[int, list[int]]:
    """Three requests of uneven lengths per rank (none on an idle rank), seeded by rank."""
    if rank in idle_ranks:
        return {}
    g = torch.Generator().manual_seed(1000 + rank)
    return {r: torch.randint(0, VOCAB, (n,), generator=g).tolist() for r, n in enumerate((7 + rank, 11, 4))}


async def generate_serial_and_dbo(model: Any, variant: Variant, prompts: dict[int, list[int]],
                                  dp_group: Any) -> dict[str, Generation]:
    """Greedy generation twice: serially on ``model``, then with DBO on a twin with a fresh cache."""
    out = {}
    for mode, net in (("serial", model), ("dbo", model.with_fresh_cache())):
        runner = DBORunner(net, variant.runner_config(), dp_group=dp_group)
        (out[mode],) = await greedy_generate([(runner, mode == "dbo")], BatchBuilder(net.kv_cache_config),
                                             prompts, decode_steps=DECODE_STEPS)
    return out


async def _checkpoints_on_ranks(rank: int, ckpts: dict[str, str], idle_ranks: tuple[int, ...]) -> dict[str, Any]:
    group = torch.distributed.group.WORLD
    out: dict[str, Any] = {}
    for name in ARCHS:
        v = VARIANTS[name]
        model, report = load_checkpoint(ckpts[name], model=name, ep_group=group, schedule=v.schedule,  # type: ignore[arg-type]
                                        max_ubatches=3, block_size=4, num_kv_blocks=64)
        out[name] = {**await generate_serial_and_dbo(model, v, prompts_for(rank, idle_ranks), group),
                     "tensors_read": report.tensors_read}
    return out


def checkpoints_on_ranks(rank: int, world_size: int, ckpts: dict[str, str],
                         idle_ranks: tuple[int, ...] = ()) -> dict[str, Any]:
    """Every architecture from its checkpoint on this rank, serial and DBO generations."""
    return asyncdbo.run(_checkpoints_on_ranks, rank, ckpts, idle_ranks)  # type: ignore[arg-type]
