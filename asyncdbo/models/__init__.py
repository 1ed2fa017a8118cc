"""Models for DBO tests, examples and the demo: a small DeepSeek-like MoE model and its paged
attention.  Hugging Face architectures (Mixtral, Qwen3-MoE, DeepSeek-V3) live in
:mod:`asyncdbo.models.hf`, imported on its own (it needs transformers for configs)."""

from __future__ import annotations

from .attention import KVCacheConfig, PagedKVCache, paged_causal_attention
from .mini import MiniConfig, MiniModel

__all__ = ["KVCacheConfig", "MiniConfig", "MiniModel", "PagedKVCache", "paged_causal_attention"]
