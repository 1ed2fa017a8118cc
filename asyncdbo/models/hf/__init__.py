"""Hugging Face MoE architectures (Mixtral, Qwen3-MoE, DeepSeek-V3) as ``async def`` models under
DBO with DP + EP, built from a transformers config and its weights (in memory or a local
checkpoint directory).  Needs transformers (the 'hf' extra: ``pip install -e '.[hf]'`` in a clone) for configs."""

from __future__ import annotations

from .model import Architecture, HFMoEModel, Segments, hub_layout
from .registry import ARCHITECTURES, architecture, architecture_for, from_hf_model

__all__ = ["ARCHITECTURES", "Architecture", "HFMoEModel", "Segments", "architecture", "architecture_for",
           "from_hf_model", "hub_layout"]
