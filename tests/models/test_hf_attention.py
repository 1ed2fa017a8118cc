"""The HF models' batched attention equals the per-request loop it replaced, on ragged batches.

:func:`~asyncdbo.models.hf.common.paged_attention` attends all decode requests in one call and all
other requests in another, padded to the longest query run and context; the loop
(:func:`~asyncdbo.models.hf.common.per_request_attention`) attends one request at a time. Both read
the same random paged cache through the same block tables, with GQA's context (KV heads repeated)
and MLA's (the latent expanded per head by ``kv_b_proj``). They agree within ``TOL`` in float32
(measured: at most 2.4e-7 here; the GEMMs see other shapes, so the bits may differ).
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
