"""Functions the HF interop tests run on RankPool ranks: tiny random-init transformers MoE blocks
(no downloads) against the expert-parallel asyncdbo layer built from them.

Legend (shape suffixes): T tokens on this rank, D hidden.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import asyncdbo
from asyncdbo.moe.hf import moe_from_hf


def tiny_block(kind: str) -> nn.Module:
    """The same random block on every rank (seeded), hidden 32, 8 experts."""
    torch.manual_seed(0)
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config: Any = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        config._experts_implementation = "eager"  # a standalone block: HF's own expert loop
        block: nn.Module = MixtralSparseMoeBlock(config)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        config = DeepseekV3Config(
            hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        )
        config._experts_implementation = "eager"
        block = DeepseekV3MoE(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for b in block.buffers():  # DeepSeek's e_score_correction_bias
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return block.eval()


def hf_all_cases(rank: int, world_size: int, tokens_per_rank: list[int], sizes_per_rank: list[list[int]]) -> dict[str, Any]:
    """Both blocks and both schedules in one call (for the costly 4-rank pool)."""
    return {
        f"{kind}/{schedule}": hf_vs_asyncdbo(rank, world_size, kind, schedule, tokens_per_rank[rank], sizes_per_rank[rank])
        for kind in ("mixtral", "deepseek")
        for schedule in ("ht", "ll")
    }


def hf_vs_asyncdbo(rank: int, world_size: int, kind: str, schedule: str, tokens: int, sizes: list[int]) -> dict[str, Any]:
    """This rank's tokens through the HF block and through the EP layer (serial and DBO)."""
    block = tiny_block(kind)
    layer = moe_from_hf(block, schedule=schedule)  # type: ignore[arg-type]
    x_TD = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        ref_TD = block(x_TD.view(1, tokens, 32)).view(tokens, 32)
    serial_TD = asyncdbo.run(layer, x_TD)

    async def dbo() -> list[torch.Tensor]:
        return await asyncdbo.run_ubatches(layer, [(p,) for p in torch.split(x_TD, sizes)], backend="host")

    dbo_TD = torch.cat(asyncdbo.run(dbo))
    return {
        "local_experts": layer.experts_per_rank,
        "serial": float((serial_TD - ref_TD).abs().max()) if tokens else 0.0,
        "dbo": float((dbo_TD - ref_TD).abs().max()) if tokens else 0.0,
        "nonzero": bool(ref_TD.abs().sum() > 0) if tokens else True,
    }
