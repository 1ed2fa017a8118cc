"""Qwen3-MoE (``Qwen3MoeForCausalLM``): grouped-query attention with a per-head RMSNorm on queries
and keys before RoPE, an explicit ``head_dim``, softmax top-k routing renormalised only with
``norm_topk_prob`` and then rounded to the model's dtype (``MoEConfig.round_topk_weights``), and dense MLP layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say
so.  No shared expert.
"""

from __future__ import annotations

from typing import Any

import torch

from ...moe import MoEConfig
from ...moe.config import Schedule
from .common import Rope, WeightSlots, rope_from_hf
from .gqa import GQAttention
from .model import Architecture

__all__ = ["Qwen3Moe"]


class Qwen3Moe(Architecture):
    name = "qwen3-moe"
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"

    @property
    def head_dim(self) -> int:
        return int(getattr(self.hf, "head_dim", None) or self.hf.hidden_size // self.hf.num_attention_heads)

    def is_moe_layer(self, layer: int) -> bool:
        hf = self.hf
        return (layer not in (hf.mlp_only_layers or ()) and hf.num_experts > 0
                and (layer + 1) % hf.decoder_sparse_step == 0)

    def moe_config(self, schedule: Schedule) -> MoEConfig:
        hf = self.hf
        return MoEConfig(hidden_size=hf.hidden_size, intermediate_size=hf.moe_intermediate_size,
                         num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, scoring="softmax",
                         norm_topk_prob=bool(hf.norm_topk_prob), round_topk_weights=True, schedule=schedule)

    def make_attention(self, prefix: str, slots: WeightSlots, *, dtype: torch.dtype, device: Any) -> GQAttention:
        hf = self.hf
        return GQAttention(prefix=prefix, slots=slots, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                           num_kv_heads=hf.num_key_value_heads, head_dim=self.head_dim, qk_norm=True,
                           bias=bool(getattr(hf, "attention_bias", False)), eps=float(hf.rms_norm_eps),
                           dtype=dtype, device=device)

    def rope(self) -> Rope:
        return rope_from_hf(self.hf, self.head_dim)

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        from transformers import Qwen3MoeConfig

        # head_dim 16 with hidden 32 / 4 heads: the explicit head_dim is what counts.  Layer 1 is
        # a dense MLP (mlp_only_layers), layer 0 a MoE layer.
        kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                                  max_position_embeddings=4096,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return Qwen3MoeConfig(**{**kw, **overrides})
