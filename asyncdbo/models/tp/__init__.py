"""Dense Hugging Face decoders (Llama, Qwen3) as ``async def`` models, tensor-parallel over a
process group, their row-parallel all-reduces overlapped by DBO (:mod:`asyncdbo.dist.tp`).
Needs transformers (the 'hf' extra) for configs."""

from __future__ import annotations

from .arch import DENSE_ARCHITECTURES, DenseArchitecture, Llama, Qwen3, dense_architecture, dense_architecture_for
from .loading import load_tp_checkpoint, tp_from_hf_model
from .model import TPAttention, TPDenseModel

__all__ = ["DENSE_ARCHITECTURES", "DenseArchitecture", "Llama", "Qwen3", "TPAttention", "TPDenseModel",
           "dense_architecture", "dense_architecture_for", "load_tp_checkpoint", "tp_from_hf_model"]
