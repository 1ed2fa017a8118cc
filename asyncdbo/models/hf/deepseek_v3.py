"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention, the first
``first_k_dense_replace`` layers dense, then MoE layers with sigmoid scores, a selection-only
``e_score_correction_bias``, group-limited top-k (``n_group`` groups scored by their top-2
experts, ``topk_group`` kept), weights renormalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts fused into one MLP.

The multi-token-prediction layers some checkpoints carry (``model.layers.<num_hidden_layers>``)
are not part of the forward and are never read.  FP8 block-quantized checkpoints (the original
release) are refused; use a bf16 conversion.
"""

from __future__ import annotations

from typing import Any

import torch

from ...moe import MoEConfig
from ...moe.config import Schedule
from .common import Rope, WeightSlots, rope_from_hf
from .mla import MLAttention
from .model import Architecture

__all__ = ["DeepseekV3"]


class DeepseekV3(Architecture):
    name = "deepseek-v3"
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"

    def check(self) -> None:
        super().check()
        hf = self.hf
        if hf.num_key_value_heads != hf.num_attention_heads:
            raise ValueError(
                f"deepseek-v3: num_key_value_heads ({hf.num_key_value_heads}) must equal num_attention_heads "
                f"({hf.num_attention_heads}): MLA expands its latent to per-head keys and values"
            )

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= int(self.hf.first_k_dense_replace or 0)

    def moe_config(self, schedule: Schedule) -> MoEConfig:
        hf = self.hf
        return MoEConfig(hidden_size=hf.hidden_size, intermediate_size=hf.moe_intermediate_size,
                         num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok, scoring="sigmoid",
                         norm_topk_prob=bool(hf.norm_topk_prob), n_group=int(hf.n_group or 1),
                         topk_group=int(hf.topk_group or 1), routed_scaling_factor=float(hf.routed_scaling_factor),
                         num_shared_experts=int(hf.n_shared_experts or 0), schedule=schedule)

    def make_attention(self, prefix: str, slots: WeightSlots, *, dtype: torch.dtype, device: Any) -> MLAttention:
        return MLAttention(self.hf, prefix=prefix, slots=slots, dtype=dtype, device=device)

    def rope(self) -> Rope:
        return rope_from_hf(self.hf, int(self.hf.qk_rope_head_dim),
                            interleave=bool(getattr(self.hf, "rope_interleave", True)))

    @classmethod
    def tiny_config(cls, **overrides: Any) -> Any:
        from transformers import DeepseekV3Config

        # yarn RoPE with mscale_all_dim, as the released config has, so the scaled softmax and the
        # scaled cos/sin tables are exercised; q_lora_rank set (the q_a/q_b path).
        kw: dict[str, Any] = dict(
            vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "beta_fast": 32, "beta_slow": 1},
        )
        return DeepseekV3Config(**{**kw, **overrides})
