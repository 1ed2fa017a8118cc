"""Multi-head latent attention (DeepSeek-V3) over a paged cache of compressed latents.

MLA projects each token to a ``kv_lora_rank`` latent (RMS-normed) plus one shared rotary key of
``qk_rope_head_dim``; the per-head keys and values are ``kv_b_proj`` of the latent.  The cache
keeps what transformers' cache keeps, and what vLLM's MLA backends keep: the latent and the
rotated shared key, one row of ``kv_lora_rank + qk_rope_head_dim`` per token (a keys-only
:class:`~asyncdbo.models.attention.PagedKVCache` with one head), not per-head keys and values.
The read expands a request's latents into per-head keys and values before attending (the
"naive" form; an absorbed form folds ``kv_b_proj`` into the query and output projections, which
is the same math in another order).

Queries come from ``q_proj`` or, with ``q_lora_rank``, from ``q_b_proj(norm(q_a_proj(h)))``.
RoPE acts on the last ``qk_rope_head_dim`` dims of queries and the shared key, interleaved when
``rope_interleave`` (the default of DeepSeek-V3's config).  The softmax scale is
``qk_head_dim ** -0.5``, times ``mscale**2`` under yarn with ``mscale_all_dim``, as in transformers.
The latent norms use eps 1e-6 whatever ``rms_norm_eps`` says (transformers builds them with the
default).
"""

# Shape legend: T = tokens, D = hidden, H = heads, C = latent + rope dims of one cached row,
# L = kv_lora_rank, N = qk_nope_head_dim, P = qk_rope_head_dim, K = N + P, V = v_head_dim,
# Q = q_lora_rank, S = context length of one request.

from __future__ import annotations

import math
from typing import Any

import torch

from ...plan.metadata import AttentionMetadata
from ..attention import wait_for_earlier_kv
from .common import WeightSlots, apply_rope, linear, paged_attention, rms_norm

__all__ = ["MLAttention", "mla_absorbed_decode", "mla_expand", "mla_project"]

#: eps of transformers' ``q_a_layernorm`` and ``kv_a_layernorm`` (built without ``rms_norm_eps``).
LATENT_NORM_EPS = 1e-6


def mla_project(h_TD: torch.Tensor, w: dict[str, torch.Tensor | None], cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                heads: int, nope: int, lora: int, interleave: bool,
                tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The synchronous piece before the cache write: queries ``q_THK`` (rotary part rotated) and
    the cache rows ``latent_T1C`` = normed latent and rotated shared key (``tile``: exact mode's
    fixed-row-tile GEMMs)."""
    T = h_TD.shape[0]  # may be 0 (an idle rank's ubatch): every view names its sizes
    if w["q_a_proj"] is None:
        q_TF = linear(h_TD, w["q_proj"], None, tile)  # type: ignore[arg-type]
    else:
        q_TQ = rms_norm(linear(h_TD, w["q_a_proj"], w["q_a_bias"], tile), w["q_a_norm"], LATENT_NORM_EPS)  # type: ignore[arg-type]
        q_TF = linear(q_TQ, w["q_b_proj"], None, tile)  # type: ignore[arg-type]
    q_THK = q_TF.view(T, heads, q_TF.shape[1] // heads)
    compressed_TC = linear(h_TD, w["kv_a_proj"], w["kv_a_bias"], tile)  # type: ignore[arg-type]
    latent_TL = rms_norm(compressed_TC[:, :lora], w["kv_a_norm"], LATENT_NORM_EPS)  # type: ignore[arg-type]
    k_rot_T1P = apply_rope(compressed_TC[:, None, lora:], cos_TK, sin_TK, interleave)
    q_THK = torch.cat([q_THK[..., :nope], apply_rope(q_THK[..., nope:], cos_TK, sin_TK, interleave)], dim=-1)
    return q_THK, torch.cat([latent_TL[:, None, :], k_rot_T1P], dim=-1)


def mla_expand(latent_S1C: torch.Tensor, kv_b_FL: torch.Tensor, heads: int, nope: int,
               lora: int, tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys ``[H, S, N+P]`` and values ``[H, S, V]`` of one request's cached latents
    (``tile``: in fixed row tiles, so a cached row expands to the same bits whatever context
    length, or rows of other requests, share the call)."""
    S = latent_S1C.shape[0]
    kv_SHF = linear(latent_S1C[:, 0, :lora], kv_b_FL, None, tile).view(S, heads, -1)
    k_rot_SHP = latent_S1C[:, :, lora:].expand(S, heads, -1)
    k_SHK = torch.cat([kv_SHF[..., :nope], k_rot_SHP], dim=-1)
    return k_SHK.transpose(0, 1), kv_SHF[..., nope:].transpose(0, 1)


class MLAttention:
    """One layer's multi-head latent attention (its weights live in :class:`WeightSlots`)."""

    def __init__(self, hf: Any, *, prefix: str, slots: WeightSlots, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        D, H = hf.hidden_size, hf.num_attention_heads
        self.heads, self.lora, self.rope = H, hf.kv_lora_rank, hf.qk_rope_head_dim
        self.nope, self.v_dim = hf.qk_nope_head_dim, hf.v_head_dim
        K = self.nope + self.rope
        self.interleave = bool(getattr(hf, "rope_interleave", True))
        self.scale = K**-0.5 * _yarn_mscale_squared(dict(getattr(hf, "rope_parameters", None) or {}))
        bias = bool(getattr(hf, "attention_bias", False))

        def new(name: str, *shape: int) -> torch.Tensor:
            return slots.new(f"{prefix}.{name}", *shape, dtype=dtype, device=device)

        q_lora = hf.q_lora_rank
        self.w: dict[str, torch.Tensor | None] = {
            "q_proj": new("q_proj.weight", H * K, D) if q_lora is None else None,
            "q_a_proj": None if q_lora is None else new("q_a_proj.weight", q_lora, D),
            "q_a_bias": new("q_a_proj.bias", q_lora) if bias and q_lora is not None else None,
            "q_a_norm": None if q_lora is None else new("q_a_layernorm.weight", q_lora),
            "q_b_proj": None if q_lora is None else new("q_b_proj.weight", H * K, q_lora),
            "kv_a_proj": new("kv_a_proj_with_mqa.weight", self.lora + self.rope, D),
            "kv_a_bias": new("kv_a_proj_with_mqa.bias", self.lora + self.rope) if bias else None,
            "kv_a_norm": new("kv_a_layernorm.weight", self.lora),
        }
        self.kv_b_FL = new("kv_b_proj.weight", H * (self.nope + self.v_dim), self.lora)
        self.wo_DF = new("o_proj.weight", D, H * self.v_dim)
        self.bo_D = new("o_proj.bias", D) if bias else None

    @property
    def kv_cache_dims(self) -> tuple[int, int, int | None]:
        """One head of latent + rotary key per token, no values (module docstring)."""
        return 1, self.lora + self.rope, 0

    def absorbed_decode(self, q_RHK: torch.Tensor, latent_RS1C: torch.Tensor, visible_RS: torch.Tensor) -> torch.Tensor:
        """The decode requests' attention in the latent space (:func:`mla_absorbed_decode`)."""
        return mla_absorbed_decode(q_RHK, latent_RS1C, visible_RS, self.kv_b_FL, self.heads, self.nope, self.lora,
                                   self.scale)

    async def forward(self, model: Any, layer: int, h_TD: torch.Tensor, positions_T: torch.Tensor,
                      rope_TK: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata) -> torch.Tensor:
        seg, tile = model.segments, model.tile

        def context(latent_S1C: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            return seg.mla_expand(latent_S1C, self.kv_b_FL, self.heads, self.nope, self.lora, tile)

        q_THK, latent_T1C = seg.mla_project(h_TD, self.w, *rope_TK, self.heads, self.nope, self.lora, self.interleave,
                                            tile)
        model.kv_cache.write(layer, latent_T1C[: attn.num_actual_tokens], None, attn.slot_mapping)
        await wait_for_earlier_kv(model, layer)
        o_THV = paged_attention(q_THK, positions_T, model.kv_cache, layer, attn, scale=self.scale,
                                context=context, attend_fn=seg.attend, v_dim=self.v_dim, exact=tile is not None,
                                decode=self.absorbed_decode if model.mla_absorb else None)
        return seg.linear(o_THV.reshape(o_THV.shape[0], self.heads * self.v_dim), self.wo_DF, self.bo_D, tile)


def mla_absorbed_decode(q_RHK: torch.Tensor, latent_RS1C: torch.Tensor, visible_RS: torch.Tensor,
                        kv_b_FL: torch.Tensor, heads: int, nope: int, lora: int, scale: float) -> torch.Tensor:
    """Decode attention in the latent space (DeepSeek's and vLLM's absorbed MLA): each head's
    query is multiplied into the latent once (``q_nope @ W_UK``), scored against the cached
    latents and rotary keys as they are, and the probability-weighted latent is multiplied out by
    ``W_UV`` once per head, so the context is never expanded per head. Returns ``[R, H, V]``.
    Legend: L = latent rank, C = L + rotary dim, N = key dim without rope, V = value dim."""
    w_HFL = kv_b_FL.view(heads, -1, lora)
    w_uk_HNL, w_uv_HVL = w_HFL[:, :nope], w_HFL[:, nope:]
    latent_RSC = latent_RS1C[:, :, 0]
    q_lat_RHL = torch.einsum("rhn,hnl->rhl", q_RHK[..., :nope], w_uk_HNL)
    q_abs_RHC = torch.cat([q_lat_RHL, q_RHK[..., nope:]], dim=-1)
    scores_RHS = torch.einsum("rhc,rsc->rhs", q_abs_RHC, latent_RSC) * scale
    probs_RHS = scores_RHS.masked_fill(~visible_RS[:, None, :], float("-inf")).softmax(dim=-1, dtype=torch.float32)
    o_lat_RHL = torch.einsum("rhs,rsl->rhl", probs_RHS.to(latent_RSC.dtype), latent_RSC[..., :lora])
    return torch.einsum("rhl,hvl->rhv", o_lat_RHL, w_uv_HVL)


def _yarn_mscale_squared(params: dict[str, Any]) -> float:
    """transformers' ``yarn_apply_mscale`` factor: ``mscale(factor, mscale_all_dim) ** 2`` for a
    non-default RoPE with ``mscale_all_dim``, else 1."""
    if params.get("rope_type", "default") == "default" or not params.get("mscale_all_dim"):
        return 1.0
    factor = float(params["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale
