"""The real architectures a prediction models, from their published ``config.json``, read through
the library's own architecture classes (:mod:`asyncdbo.models.hf`).

Each entry is the config a transformers ``from_pretrained`` would read (the fields the model
uses), so :func:`architecture_config` gives the same routing rule and sizes
(:meth:`Architecture.moe_config`) and the same dense/MoE layer split as the model code itself,
without transformers installed: the architecture classes read configs by attribute.

* ``deepseek-v3``: deepseek-ai/DeepSeek-V3 ``config.json`` (MLA, 256 routed experts of 2048,
  top-8 in 4 of 8 groups, one shared expert; released in FP8, which SGLang serves as is).
* ``mixtral``: mistralai/Mixtral-8x7B-v0.1 ``config.json`` (GQA 32/8, 8 experts of 14336, top-2).
* ``qwen3-moe``: Qwen/Qwen3-235B-A22B ``config.json`` (GQA 64/4 with head_dim 128, 128 experts of
  1536, top-8).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

__all__ = ["REAL_CONFIGS", "architecture_config"]

REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_hidden_layers=61, first_k_dense_replace=3, vocab_size=129280, hidden_act="silu", weights="fp8",
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=32, vocab_size=32000,
        hidden_act="silu", weights="bf16",
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, num_hidden_layers=94, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        hidden_act="silu", weights="bf16",
    ),
}


def architecture_config(name: str) -> tuple[Any, Any]:
    """``(architecture, config)`` of a real model: the library's :class:`Architecture` built from
    the published config (a namespace with the same fields)."""
    from ..models.hf.registry import architecture

    try:
        fields = REAL_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(REAL_CONFIGS)}") from None
    cfg = SimpleNamespace(**fields)
    return architecture(name)(cfg), cfg
