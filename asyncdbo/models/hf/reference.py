"""transformers as the oracle: tiny random models of each architecture (built offline from a
config, nothing downloaded) and their own forward's logits.

The tiny models keep transformers' reference code paths (``attn_implementation="eager"``, the
eager expert loop) in float32.  Their weights are redrawn from a seeded generator with unit-scale
statistics (transformers initialises with std 0.02, which leaves tiny models with near-uniform
logits where a greedy token is decided by noise); the router correction bias gets a non-zero draw
so that it really changes expert choices.
"""

# Shape legend: S = tokens of one sequence, V = vocab.

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .registry import architecture

__all__ = ["hf_logits", "tiny_hf_model"]


def tiny_hf_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A tiny random transformers causal LM of architecture ``name`` (see the module docstring;
    the dense ``llama`` and ``qwen3`` of :mod:`asyncdbo.models.tp` too); ``overrides`` change
    fields of :meth:`Architecture.tiny_config`.  ``dtype`` builds it the
    way ``from_pretrained(..., dtype=...)`` does (the float32 weights of the same seed, rounded;
    what transformers keeps in float32, such as DeepSeek-V3's router and the RoPE frequencies,
    stays float32, which ``model.to(dtype)`` would not do)."""
    from transformers import AutoModelForCausalLM

    from ..tp.arch import DENSE_ARCHITECTURES

    arch = DENSE_ARCHITECTURES[name] if name in DENSE_ARCHITECTURES else architecture(name)
    config = arch.tiny_config(**overrides)
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "embed_tokens" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                base = 0.0 if pname.endswith(".bias") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


@torch.no_grad()
def hf_logits(hf_model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[S, V]`` (float32) of the transformers model's own forward over one sequence."""
    out = hf_model(torch.tensor([list(token_ids)], dtype=torch.int64))
    return out.logits[0].float()
