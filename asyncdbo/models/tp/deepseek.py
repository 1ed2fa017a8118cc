"""DeepSeek-V3 with tensor-parallel attention and expert-parallel MoE layers over the same ranks,
both kinds of comm overlapped by DBO in one step.

Every rank of the group runs the same tokens.  Attention (MLA) is split by heads: this rank's
block of ``q_b_proj`` (``q_proj`` without q-LoRA), ``kv_b_proj`` and ``o_proj``; the latent
projections and norms are replicated, and so is the latent KV cache (one latent per token, shared
by every head).  The residual stream is sequence-parallel (:class:`~asyncdbo.models.tp.TPDenseModel`
with ``sequence_parallel``): a rank keeps ``T / P`` rows of it.  The first
``first_k_dense_replace`` layers' MLPs are tensor-parallel like a dense model's (all-gather,
column/row-parallel, reduce-scatter); the MoE layers are :class:`~asyncdbo.moe.MoELayer` with
the group as their EP group, each rank routing its own ``T / P`` rows to the experts' ranks
(all-to-all dispatch and combine), so no token is sent twice.  In one DBO step a ubatch's
reduce-scatter and all-gather (attention, dense MLP) and its dispatch and combine (MoE) all
overlap the other ubatch's compute, on the same per-ubatch group clones.
"""

# Shape legend: T = tokens, S = T / P rows of this rank (padded), D = hidden, H = heads.

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from ...moe import MoELayer
from ...moe.config import Schedule
from ..hf.deepseek_v3 import DeepseekV3
from ..hf.mla import MLAttention
from ..hf.model import add_moe_slots
from .model import TPDenseModel
from .shards import ShardedSlots, shard_range

__all__ = ["TPDeepseekV3"]

#: MLA tensors split by heads: name suffix -> the dimension that holds the heads.
HEAD_SPLIT = {"q_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0, "o_proj.weight": 1}


class _HeadShards:
    """The slots :class:`MLAttention` registers into, built for ``H / P`` heads: its per-head
    tensors become this rank's block of the checkpoint's (``HEAD_SPLIT``), the rest stay whole."""

    def __init__(self, slots: ShardedSlots, size: int, rank: int) -> None:
        self.slots, self.size, self.rank = slots, size, rank

    def new(self, name: str, *shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        dim = next((d for suffix, d in HEAD_SPLIT.items() if name.endswith(suffix)), None)
        if dim is None:
            return self.slots.new(name, *shape, dtype=dtype, device=device)
        full = list(shape)
        full[dim] *= self.size
        return self.slots.new_shard(name, tuple(full), dim, self.rank * shape[dim], shape[dim], dtype=dtype,
                                    device=device)


class TPDeepseekV3(TPDenseModel):
    """DeepSeek-V3 on one rank (module docstring); the arguments are :class:`TPDenseModel`'s
    (``sequence_parallel`` is always on) plus the MoE layers' ``schedule`` (``ht`` or ``ll``)."""

    def __init__(self, arch: DeepseekV3, *, schedule: Schedule = "ht", **kwargs: Any) -> None:
        hf = arch.hf
        if getattr(hf, "attention_bias", False):
            raise ValueError("deepseek-v3 under TP: attention_bias=True is not supported (o_proj's bias would be "
                             "added on every rank); use a checkpoint without attention biases")
        if kwargs.pop("sequence_parallel", True) is not True:
            raise ValueError("TPDeepseekV3 runs sequence-parallel (its MoE layers take each rank's own rows); "
                             "drop sequence_parallel=False")
        self.schedule: Schedule = schedule
        super().__init__(arch, sequence_parallel=True, **kwargs)  # type: ignore[arg-type]

    def _attention(self, prefix: str) -> Any:
        P = self.tp_comm.size
        shard_range(int(self.hf.num_attention_heads), P, self.tp_comm.rank, "num_attention_heads")
        local = copy.copy(self.hf)  # the config MLA reads, with this rank's heads
        local.num_attention_heads = int(self.hf.num_attention_heads) // P
        return MLAttention(local, prefix=prefix, slots=_HeadShards(self.slots, P, self.tp_comm.rank),  # type: ignore[arg-type]
                           dtype=self.dtype, device=self.device)

    def _ffn(self, layer: int, prefix: str) -> dict[str, Any]:
        arch = self.arch
        assert isinstance(arch, DeepseekV3)
        if not arch.is_moe_layer(layer):
            return super()._ffn(layer, prefix)
        cfg = arch.moe_config(self.schedule)
        cfg = dataclasses.replace(cfg, deterministic=self.deterministic)
        moe = MoELayer(cfg, ep_group=self.tp_comm.group, dtype=self.dtype, max_ubatches=self.max_ubatches,
                       name=prefix, init_weights=False).to(self.device)
        add_moe_slots(self.slots, prefix, moe, DeepseekV3.expert_names)
        return {"moe": moe}

    async def _feed_forward(self, layer: dict[str, Any], h_SD: torch.Tensor, T: int) -> torch.Tensor:
        moe = layer.get("moe")
        if moe is None:
            return await super()._feed_forward(layer, h_SD, T)
        return await moe.forward(h_SD)  # this rank's rows, to the experts' ranks and back

