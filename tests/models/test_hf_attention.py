"""The HF models' batched attention equals the per-request loop it replaced, on ragged batches.

:func:`~asyncdbo.models.hf.common.paged_attention` attends all decode requests in one call and all
other requests in another, padded to the longest query run and context; the loop
(:func:`~asyncdbo.models.hf.common.per_request_attention`) attends one request at a time. Both read
the same random paged cache through the same block tables, with GQA's context (KV heads repeated)
and MLA's (the latent expanded per head by ``kv_b_proj``). They agree within ``TOL`` in float32
(measured: at most 2.4e-7 here; the GEMMs see other shapes, so the bits may differ). MLA's
decode requests can also be attended in the latent space (absorbed), within the same ``TOL``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from asyncdbo.models.hf.common import attend, paged_attention, per_request_attention
from asyncdbo.models.hf.mla import mla_expand
from asyncdbo.serving import BatchBuilder, KVCacheConfig, PagedKVCache

TOL = 1e-5
H, G, K = 4, 2, 16  # query heads, cached (KV) heads, head dim
LORA, ROPE, NOPE, V = 12, 4, 8, 10  # MLA: latent rank, rotary dim, per-head key (no rope) and value dims


def gqa_context(k_SGK: torch.Tensor, v_SGK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    assert v_SGK is not None
    return (k_SGK.transpose(0, 1).repeat_interleave(H // G, dim=0),
            v_SGK.transpose(0, 1).repeat_interleave(H // G, dim=0))


def ragged_batch(builder: BatchBuilder) -> Any:
    """A first step of three prompts, then the step compared: two decode tokens, a chunk that
    continues request 2's prompt, and a new prompt."""
    builder.build([(0, list(range(9))), (1, list(range(3))), (2, list(range(20)))])
    return builder.build([(0, [1]), (2, list(range(7))), (1, [2]), (3, list(range(5)))])


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_batched_attention_equals_the_per_request_loop_on_a_ragged_batch(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    if kind == "gqa":
        cfg = KVCacheConfig(num_layers=1, num_blocks=16, block_size=4, num_heads=G, head_dim=K)
        context, qk_dim, v_dim = gqa_context, K, K
    else:
        cfg = KVCacheConfig(num_layers=1, num_blocks=16, block_size=4, num_heads=1, head_dim=LORA + ROPE, v_head_dim=0)
        kv_b_FL = torch.randn(H * (NOPE + V), LORA, generator=g) / math.sqrt(LORA)

        def context(latent_S1C: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            return mla_expand(latent_S1C, kv_b_FL, H, NOPE, LORA)
        qk_dim, v_dim = NOPE + ROPE, V
    cache = PagedKVCache(cfg)
    for t in (*cache.k_cache_LNZHK, *cache.v_cache_LNZHK):
        t.copy_(torch.randn(t.shape, generator=g))
    batch = ragged_batch(BatchBuilder(cfg))
    pad = 3  # rows past num_actual_tokens: padding, zeros out
    q_THK = torch.randn(batch.num_tokens + pad, H, qk_dim, generator=g)
    positions_T = torch.cat([batch.positions_T, torch.zeros(pad, dtype=torch.int64)])
    kw: dict[str, Any] = dict(scale=qk_dim ** -0.5, context=context, attend_fn=attend, v_dim=v_dim)
    batched = paged_attention(q_THK, positions_T, cache, 0, batch.attn, **kw)
    loop = per_request_attention(q_THK, positions_T, cache, 0, batch.attn, **kw)
    assert batched.shape == loop.shape == (batch.num_tokens + pad, H, v_dim)
    assert (batched - loop).abs().max().item() <= TOL
    assert torch.equal(batched[batch.num_tokens:], torch.zeros(pad, H, v_dim))


def test_a_batch_of_decode_requests_only_and_an_empty_batch() -> None:
    g = torch.Generator().manual_seed(1)
    cfg = KVCacheConfig(num_layers=1, num_blocks=16, block_size=4, num_heads=G, head_dim=K)
    cache = PagedKVCache(cfg)
    for t in (*cache.k_cache_LNZHK, *cache.v_cache_LNZHK):
        t.copy_(torch.randn(t.shape, generator=g))
    builder = BatchBuilder(cfg)
    builder.build([(0, [1, 2, 3]), (1, list(range(13)))])
    batch = builder.build([(0, [4]), (1, [5])])
    q_THK = torch.randn(2, H, K, generator=g)
    kw: dict[str, Any] = dict(scale=K ** -0.5, context=gqa_context, attend_fn=attend, v_dim=K)
    batched = paged_attention(q_THK, batch.positions_T, cache, 0, batch.attn, **kw)
    loop = per_request_attention(q_THK, batch.positions_T, cache, 0, batch.attn, **kw)
    assert (batched - loop).abs().max().item() <= TOL
    empty = builder.build([])
    assert paged_attention(q_THK[:0], batch.positions_T[:0], cache, 0, empty.attn, **kw).shape == (0, H, K)


def test_mla_decode_in_the_latent_space_equals_the_expanded_form() -> None:
    """DeepSeek's absorbed decode (queries multiplied into the latent, no per-head expansion of
    the context) against the per-request loop that expands every cached latent per head."""
    from asyncdbo.models.hf.mla import mla_absorbed_decode

    g = torch.Generator().manual_seed(2)
    cfg = KVCacheConfig(num_layers=1, num_blocks=16, block_size=4, num_heads=1, head_dim=LORA + ROPE, v_head_dim=0)
    kv_b_FL = torch.randn(H * (NOPE + V), LORA, generator=g) / math.sqrt(LORA)
    scale = (NOPE + ROPE) ** -0.5

    def context(latent_S1C: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_expand(latent_S1C, kv_b_FL, H, NOPE, LORA)

    def absorbed(q_RHK: torch.Tensor, latent_RS1C: torch.Tensor, visible_RS: torch.Tensor) -> torch.Tensor:
        return mla_absorbed_decode(q_RHK, latent_RS1C, visible_RS, kv_b_FL, H, NOPE, LORA, scale)

    cache = PagedKVCache(cfg)
    cache.k_cache_LNZHK[0].copy_(torch.randn(cache.k_cache_LNZHK[0].shape, generator=g))
    batch = ragged_batch(BatchBuilder(cfg))  # two decode requests beside a chunk and a prompt
    q_THK = torch.randn(batch.num_tokens, H, NOPE + ROPE, generator=g)
    kw: dict[str, Any] = dict(scale=scale, context=context, attend_fn=attend, v_dim=V)
    got = paged_attention(q_THK, batch.positions_T, cache, 0, batch.attn, decode=absorbed, **kw)
    want = per_request_attention(q_THK, batch.positions_T, cache, 0, batch.attn, **kw)
    assert (got - want).abs().max().item() <= TOL
