"""How much memory one rank of an :class:`~asyncdbo.models.hf.HFMoEModel` needs, from its config
alone, before any rank starts or reads a weight; and the refusal of a run that would not fit.

* **weights**: exact.  Every tensor of the checkpoint (:func:`~asyncdbo.models.hf.real_dims.checkpoint_tensors`,
  transformers' names and shapes) in the model's dtype, except those transformers keeps in
  float32 in a low-precision model (DeepSeek-V3's router and correction bias), which the model
  keeps in float32 too; routed experts count once per EP rank that owns them (``experts / ranks``).
* **KV cache**: exact, the :class:`~asyncdbo.serving.kv_cache.PagedKVCache` the model allocates
  (keys and values per head for GQA, one latent row per token for MLA).
* **loading**: the block of rows the loader holds as read before copying it into its slot: the
  largest checkpoint tensor, or ``READ_BLOCK_BYTES`` if that is smaller
  (:mod:`~asyncdbo.models.hf.checkpoint`).
* **activations**: the largest step's tensors, added up as if all were alive at once (errs
  high): logits, the residual stream, one request's attention (its context keys and values and
  its score matrices), the MoE rows a rank can receive from every rank, a dense MLP's hidden.
* **base**: what the caller says the process itself takes (torch, gloo): the CLI measured
  ``asyncdbo.cli.inputs.PROCESS_BASE_BYTES``.

A rank's peak is ``base + weights + KV cache + max(loading, activations)``: loading ends before the
first step.  The benchmark ``benchmarks/real_dims.py`` prints this estimate next to each rank's
measured peak RSS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint import READ_BLOCK_BYTES
from .real_dims import checkpoint_tensors

__all__ = ["MemoryEstimate", "check_fits", "estimate_memory", "gib"]

#: A routed expert's tensor in the Hub layout (owned by one EP rank).
EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")


def gib(n: float) -> str:
    """``n`` bytes in GiB, as the estimates are written (``"6.28 GiB"``)."""
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one rank needs (module docstring), and how many ranks run on this machine."""

    ranks: int
    weights: int
    kv_cache: int
    loading: int
    activations: int
    base: int

    @property
    def per_rank(self) -> int:
        return self.base + self.weights + self.kv_cache + max(self.loading, self.activations)

    @property
    def total(self) -> int:
        return self.ranks * self.per_rank

    def describe(self) -> str:
        return (f"{self.ranks} rank(s) x {gib(self.per_rank)} = {gib(self.total)} (per rank: weights "
                f"{gib(self.weights)}, KV cache {gib(self.kv_cache)}, the larger of loading {gib(self.loading)} "
                f"and step activations {gib(self.activations)}, process {gib(self.base)})")


def estimate_memory(config: Any, *, ranks: int, dtype: torch.dtype, num_kv_blocks: int, block_size: int,
                    step_tokens: int, longest_context: int, checkpoint_dtype: torch.dtype = torch.bfloat16,
                    base: int = 0) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of one rank of ``ranks`` (each an EP and DP rank) running
    ``config`` in ``dtype`` with a KV cache of ``num_kv_blocks`` x ``block_size`` tokens, steps of
    at most ``step_tokens`` tokens on a rank and requests of at most ``longest_context`` tokens,
    loaded from a checkpoint saved in ``checkpoint_dtype``."""
    if ranks < 1 or step_tokens < 1 or longest_context < 1:
        raise ValueError(f"ranks, step_tokens and longest_context must be >= 1 (got {ranks}, {step_tokens}, "
                         f"{longest_context})")
    specs = checkpoint_tensors(config, checkpoint_dtype)

    def kept_bytes(s: Any) -> int:
        kept = torch.float32 if s.dtype == torch.float32 and checkpoint_dtype != torch.float32 else dtype
        return s.nbytes // s.dtype.itemsize * kept.itemsize

    replicated = sum(kept_bytes(s) for s in specs if not EXPERT_TENSOR.search(s.name))
    experts = sum(kept_bytes(s) for s in specs if EXPERT_TENSOR.search(s.name))
    weights = replicated + experts // ranks  # every rank owns the same number of experts
    return MemoryEstimate(
        ranks=ranks, weights=weights, kv_cache=_kv_cache_bytes(config, dtype, num_kv_blocks, block_size),
        loading=min(max(s.nbytes for s in specs), READ_BLOCK_BYTES),
        activations=_activation_bytes(config, dtype, ranks, step_tokens, longest_context), base=base,
    )


def _attention_dims(hf: Any) -> tuple[int, int, int, int]:
    """(query heads, query/key head dim, value head dim, cached values per token and layer)."""
    H = int(hf.num_attention_heads)
    if getattr(hf, "kv_lora_rank", None):  # MLA: one latent + shared rotary key per token
        return H, hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim, hf.kv_lora_rank + hf.qk_rope_head_dim
    K = int(getattr(hf, "head_dim", None) or hf.hidden_size // H)
    return H, K, K, 2 * hf.num_key_value_heads * K


def _kv_cache_bytes(hf: Any, dtype: torch.dtype, num_blocks: int, block_size: int) -> int:
    per_token = _attention_dims(hf)[3]
    return hf.num_hidden_layers * num_blocks * block_size * per_token * dtype.itemsize


def _activation_bytes(hf: Any, dtype: torch.dtype, ranks: int, T: int, S: int) -> int:
    b, f32 = dtype.itemsize, 4
    D, V = hf.hidden_size, hf.vocab_size
    H, K, Vd, _ = _attention_dims(hf)
    top_k = int(hf.num_experts_per_tok)
    F = int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
    logits = T * V * (b + f32)
    stream = 16 * T * D * f32
    queries = T * H * (K + Vd) * f32 * 2
    context = S * H * (K + Vd) * b * 3
    scores = 3 * H * min(T, S) * S * f32
    moe = ranks * T * top_k * (4 * D + 3 * F) * b
    dense = 3 * T * int(hf.intermediate_size) * b
    return logits + stream + queries + context + scores + moe + dense


def check_fits(estimate: MemoryEstimate, available: int, *, what: str, fix: str) -> None:
    """Refuse (ValueError with the estimate) a run whose ranks would need more than ``available``
    bytes; ``what`` names the run, ``fix`` says what to change."""
    if estimate.total > available:
        raise ValueError(f"{what} needs about {estimate.describe()}, but {gib(available)} is available; {fix}")
