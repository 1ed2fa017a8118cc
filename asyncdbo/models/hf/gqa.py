"""Grouped-query attention over the paged KV cache: Mixtral's, and Qwen3-MoE's with its per-head
RMSNorm on queries and keys.

Per layer and ubatch: one synchronous piece projects queries, keys and values (plus the q/k norms
and RoPE), the new keys and values go into this rank's cache, the read waits for the earlier
ubatches' writes when this ubatch continues one of their requests
(:func:`~asyncdbo.models.attention.wait_for_earlier_kv`), then each request attends over its
context.  The cache keeps ``num_key_value_heads`` heads; each KV head serves
``num_attention_heads / num_key_value_heads`` consecutive query heads, as in transformers'
``repeat_kv``.
"""

# Shape legend: T = tokens, D = hidden, H = query heads, G = KV heads, K = head dim,
# S = context length of one request.

from __future__ import annotations

from typing import Any

import torch

from ...plan.metadata import AttentionMetadata
from ..attention import wait_for_earlier_kv
from .common import WeightSlots, apply_rope, linear, paged_attention, rms_norm

__all__ = ["GQAttention", "gqa_context", "gqa_qkv"]


def gqa_context(num_heads: int, num_kv_heads: int, k_SGK: torch.Tensor,
                v_SGK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys and values ``[S, G, K]`` as ``[H, S, K]``: each of the ``G`` KV heads repeated
    for the ``H / G`` query heads that read it."""
    assert v_SGK is not None
    rep = num_heads // num_kv_heads
    return (k_SGK.transpose(0, 1).repeat_interleave(rep, dim=0),
            v_SGK.transpose(0, 1).repeat_interleave(rep, dim=0))


def gqa_qkv(h_TD: torch.Tensor, wq_FD: torch.Tensor, bq_F: torch.Tensor | None, wk_FD: torch.Tensor,
            bk_F: torch.Tensor | None, wv_FD: torch.Tensor, bv_F: torch.Tensor | None,
            q_norm_K: torch.Tensor | None, k_norm_K: torch.Tensor | None, cos_TK: torch.Tensor,
            sin_TK: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
            eps: float, tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The synchronous piece before the cache write: ``(q_THK, k_TGK, v_TGK)`` with RoPE applied
    (``tile``: exact mode's fixed-row-tile GEMMs, :func:`~asyncdbo.models.hf.common.linear`)."""
    T = h_TD.shape[0]  # may be 0 (an idle rank's ubatch): every view names its sizes
    q_THK = linear(h_TD, wq_FD, bq_F, tile).view(T, heads, head_dim)
    k_TGK = linear(h_TD, wk_FD, bk_F, tile).view(T, kv_heads, head_dim)
    v_TGK = linear(h_TD, wv_FD, bv_F, tile).view(T, kv_heads, head_dim)
    if q_norm_K is not None and k_norm_K is not None:
        q_THK, k_TGK = rms_norm(q_THK, q_norm_K, eps), rms_norm(k_TGK, k_norm_K, eps)
    return apply_rope(q_THK, cos_TK, sin_TK, False), apply_rope(k_TGK, cos_TK, sin_TK, False), v_TGK


class GQAttention:
    """One layer's grouped-query attention (its weights live in :class:`WeightSlots`)."""

    def __init__(self, *, prefix: str, slots: WeightSlots, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, qk_norm: bool, bias: bool, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.scale = head_dim**-0.5

        def new(name: str, *shape: int) -> torch.Tensor:
            return slots.new(f"{prefix}.{name}", *shape, dtype=dtype, device=device)

        def maybe(name: str, *shape: int) -> torch.Tensor | None:
            return new(name, *shape) if bias else None

        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.wq_FD, self.bq_F = new("q_proj.weight", q, hidden_size), maybe("q_proj.bias", q)
        self.wk_FD, self.bk_F = new("k_proj.weight", kv, hidden_size), maybe("k_proj.bias", kv)
        self.wv_FD, self.bv_F = new("v_proj.weight", kv, hidden_size), maybe("v_proj.bias", kv)
        self.wo_DF, self.bo_D = new("o_proj.weight", hidden_size, q), maybe("o_proj.bias", hidden_size)
        self.q_norm_K = new("q_norm.weight", head_dim) if qk_norm else None
        self.k_norm_K = new("k_norm.weight", head_dim) if qk_norm else None

    @property
    def kv_cache_dims(self) -> tuple[int, int, int | None]:
        """``(heads, head_dim, v_head_dim)`` of this attention's cache."""
        return self.num_kv_heads, self.head_dim, None

    def _context(self, k_SGK: torch.Tensor, v_SGK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return gqa_context(self.num_heads, self.num_kv_heads, k_SGK, v_SGK)

    async def forward(self, model: Any, layer: int, h_TD: torch.Tensor, positions_T: torch.Tensor,
                      rope_TK: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata) -> torch.Tensor:
        seg, tile = model.segments, model.tile
        q_THK, k_TGK, v_TGK = seg.gqa_qkv(h_TD, self.wq_FD, self.bq_F, self.wk_FD, self.bk_F, self.wv_FD, self.bv_F,
                                          self.q_norm_K, self.k_norm_K, *rope_TK, self.num_heads, self.num_kv_heads,
                                          self.head_dim, self.eps, tile)
        n = attn.num_actual_tokens  # rows past n are padding: they write no K/V
        model.kv_cache.write(layer, k_TGK[:n], v_TGK[:n], attn.slot_mapping)
        await wait_for_earlier_kv(model, layer)
        o_THK = paged_attention(q_THK, positions_T, model.kv_cache, layer, attn, scale=self.scale,
                                context=self._context, attend_fn=seg.attend, v_dim=self.head_dim,
                                exact=tile is not None)
        return seg.linear(o_THK.reshape(o_THK.shape[0], self.num_heads * self.head_dim), self.wo_DF, self.bo_D, tile)
