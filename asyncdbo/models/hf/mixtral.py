"""Mixtral (``MixtralForCausalLM``): grouped-query attention with RoPE, every layer a MoE layer
with softmax top-k routing renormalised over the chosen experts, no shared expert.

Checkpoint names: the MoE block is ``block_sparse_moe``, an expert's gate/up/down projections are
``w1``/``w3``/``w2`` (transformers 5 calls the block ``mlp`` in memory; :meth:`Mixtral.hub_name`
maps it back).
"""

from __future__ import annotations

from typing import Any

import torch

from ...moe import MoEConfig
from ...moe.config import Schedule
from .common import Rope, WeightSlots, rope_from_hf
from .gqa import GQAttention
from .model import Architecture

__all__ = ["Mixtral"]


class Mixtral(Architecture):
    name = "mixtral"
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    moe_module = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    @property
    def head_dim(self) -> int:
        return int(getattr(self.hf, "head_dim", None) or self.hf.hidden_size // self.hf.num_attention_heads)

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def moe_config(self, schedule: Schedule) -> MoEConfig:
        hf = self.hf
        return MoEConfig(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                         num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok, scoring="softmax",
                         norm_topk_prob=True, schedule=schedule)

    def make_attention(self, prefix: str, slots: WeightSlots, *, dtype: torch.dtype, device: Any) -> GQAttention:
        hf = self.hf
        return GQAttention(prefix=prefix, slots=slots, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                           num_kv_heads=hf.num_key_value_heads, head_dim=self.head_dim, qk_norm=False, bias=False,
                           eps=float(hf.rms_norm_eps), dtype=dtype, device=device)

    def rope(self) -> Rope:
        return rope_from_hf(self.hf, self.head_dim)

    def hub_name(self, name: str) -> str:
        return name.replace(".mlp.", f".{self.moe_module}.")

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        from transformers import MixtralConfig

        kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=4096,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        return MixtralConfig(**{**kw, **overrides})
