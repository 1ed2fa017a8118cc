"""Functions the HF interop tests run on RankPool ranks: tiny random-init transformers MoE blocks
(no downloads) against the expert-parallel asyncdbo layer built from them.

Legend (shape suffixes): T tokens on this rank, D hidden, B batch, S sequence, E experts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import asyncdbo
from asyncdbo.backends.host import HostBackend
from asyncdbo.moe.hf import moe_from_hf

D = 32


def tiny_block(kind: str, *, dtype: torch.dtype = torch.float32, n_shared_experts: int = 1,
               norm_topk_prob: bool = True, bias_scale: float = 0.05, bias_add: dict[int, float] | None = None) -> nn.Module:
    """The same random block on every rank (seeded), hidden 32, 8 experts. DeepSeek only:
    ``bias_scale`` scales the random correction bias, ``bias_add`` adds to chosen experts' bias.
    In bf16, DeepSeek's router weight and bias stay float32, as ``from_pretrained`` keeps them."""
    torch.manual_seed(0)
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config: Any = MixtralConfig(hidden_size=D, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        config._experts_implementation = "eager"  # a standalone block: HF's own expert loop
        block: nn.Module = MixtralSparseMoeBlock(config)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        config = DeepseekV3Config(
            hidden_size=D, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, n_shared_experts=n_shared_experts, routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
        )
        config._experts_implementation = "eager"
        block = DeepseekV3MoE(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for b in block.buffers():  # DeepSeek's e_score_correction_bias
            b.copy_(torch.randn(b.shape, generator=g) * bias_scale)
            for e, add in (bias_add or {}).items():
                b[e] += add
    block = block.eval().to(dtype)
    if kind == "deepseek" and dtype != torch.float32:
        block.gate.float()
    return block


@dataclass(frozen=True, kw_only=True)
class HFCase:
    """One scenario: the block, this rank's tokens and ubatch sizes, how the ubatches run."""

    kind: str
    tokens: tuple[int, ...]  # per rank
    sizes: tuple[tuple[int, ...], ...]  # ubatch sizes per rank
    schedule: str = "ht"
    stream_policy: str = "role"
    latency_s: tuple[float, ...] | None = None  # a modeled ib400 link with this latency per rank
    dtype: str = "float32"
    block: dict[str, Any] = field(default_factory=dict)


def _input(rank: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def hf_case(rank: int, world_size: int, case: HFCase) -> dict[str, Any]:
    """This rank's tokens through the HF block, the EP layer called serially, and DBO."""
    dtype = getattr(torch, case.dtype)
    block = tiny_block(case.kind, dtype=dtype, **case.block)
    layer = moe_from_hf(block, schedule=case.schedule)  # type: ignore[arg-type]
    x_TD = _input(rank, case.tokens[rank], dtype)
    with torch.no_grad():
        ref_TD = block(x_TD.view(1, -1, D)).view(-1, D)
        picked = block.gate(x_TD)[-1]  # expert ids each token chose (the routers return them last)
    serial_TD = asyncdbo.run(layer, x_TD)
    link = None if case.latency_s is None else asyncdbo.link_spec("ib400", latency_s=case.latency_s[rank])

    async def dbo() -> list[torch.Tensor]:
        parts = [(p,) for p in torch.split(x_TD, list(case.sizes[rank]))]
        return await asyncdbo.run_ubatches(layer, parts, backend=HostBackend(link=link), stream_policy=case.stream_policy)

    dbo_TD = torch.cat(asyncdbo.run(dbo))
    return {
        "local_experts": layer.experts_per_rank,
        "hf_diff": float((serial_TD.float() - ref_TD.float()).abs().max()) if len(x_TD) else 0.0,
        "hf_close": _close(serial_TD, ref_TD),
        "dbo_equal": torch.equal(dbo_TD, serial_TD),
        "nonzero": bool(ref_TD.abs().sum() > 0) if len(x_TD) else True,
        "picked": sorted(set(picked.flatten().tolist())),
    }


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: max abs diff <= 1e-5; bf16: torch's bf16 tolerance (rtol 1.6e-2, atol 1e-5)."""
    if got.dtype == torch.float32:
        return bool((got - want).abs().max() <= 1e-5) if got.numel() else True
    return bool(torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-5))


def hf_plain_call(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """``asyncio.run(layer(x))`` on a ``[B, S, D]`` input, no asyncdbo entry point: a collective
    MoE layer called like any torch module from plain asyncio on every rank."""
    block = tiny_block(kind)
    layer = moe_from_hf(block)
    x_BSD = torch.randn(2, 5 + rank, D, generator=torch.Generator().manual_seed(7 + rank))
    with torch.no_grad():
        ref_BSD = block(x_BSD)
    out_BSD = asyncio.run(layer(x_BSD))
    return {"shape": tuple(out_BSD.shape), "diff": float((out_BSD - ref_BSD).abs().max())}


def hf_vs_asyncdbo(rank: int, world_size: int, kind: str, schedule: str, tokens: int, sizes: list[int]) -> dict[str, Any]:
    """This rank's tokens through the HF block and through the EP layer (serial and DBO)."""
    per_rank_sizes = tuple(tuple(sizes) for _ in range(world_size))
    res = hf_case(rank, world_size, HFCase(kind=kind, tokens=(tokens,) * world_size, sizes=per_rank_sizes,
                                           schedule=schedule))
    return res


def hf_all_cases(rank: int, world_size: int, tokens_per_rank: list[int], sizes_per_rank: list[list[int]]) -> dict[str, Any]:
    """Both blocks and both schedules in one call (for the costly 4-rank pool)."""
    return {
        f"{kind}/{schedule}": hf_case(rank, world_size, HFCase(
            kind=kind, tokens=tuple(tokens_per_rank), sizes=tuple(tuple(s) for s in sizes_per_rank), schedule=schedule))
        for kind in ("mixtral", "deepseek")
        for schedule in ("ht", "ll")
    }
