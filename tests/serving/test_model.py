"""The mini model and its paged attention: equal to dense causal attention, chunk-invariant,
padding-inert, deterministic from the seed, and strict about bad configuration."""

from __future__ import annotations

import math

import pytest
import torch

from asyncdbo.models import (
    KVCacheConfig,
    MiniConfig,
    PagedKVCache,
    paged_causal_attention,
)
from asyncdbo.serving import BatchBuilder

# Shape legend: T = tokens, S = context length, H = heads, K = head dim, V = vocab.

H, K = 2, 8


def _dense_causal(q_THK: torch.Tensor, k_SHK: torch.Tensor, v_SHK: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Reference: query i sits at position first_pos + i and sees keys 0..first_pos + i."""
    t, s = q_THK.shape[0], k_SHK.shape[0]
    scores_HTS = torch.einsum("thk,shk->hts", q_THK, k_SHK) / math.sqrt(K)
    mask_TS = torch.arange(s)[None, :] <= (first_pos + torch.arange(t))[:, None]
    probs_HTS = scores_HTS.masked_fill(~mask_TS, float("-inf")).softmax(-1)
    return torch.einsum("hts,shk->thk", probs_HTS, v_SHK)


def _cache(num_blocks: int = 16, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(KVCacheConfig(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_heads=H, head_dim=K))


def _attend(cache: PagedKVCache, builder: BatchBuilder, chunks: list[tuple[int, list[int]]],
            kv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Write the chunks' K/V (taken from per-request full tensors by position) and attend."""
    batch = builder.build(chunks)
    pos = batch.positions_T
    rids = [rid for rid, toks in chunks for _ in toks]
    q = torch.stack([kv[r][0][p] for r, p in zip(rids, pos.tolist())]) if rids else torch.zeros(0, H, K)
    k = torch.stack([kv[r][1][p] for r, p in zip(rids, pos.tolist())]) if rids else torch.zeros(0, H, K)
    v = torch.stack([kv[r][2][p] for r, p in zip(rids, pos.tolist())]) if rids else torch.zeros(0, H, K)
    cache.write(0, k, v, batch.attn.slot_mapping)
    return paged_causal_attention(q, pos, cache, 0, batch.attn)


def _random_requests(lengths: dict[int, int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return {r: tuple(torch.randn(n, H, K, generator=g) for _ in range(3)) for r, n in lengths.items()}  # type: ignore[misc]


def test_paged_attention_equals_dense_causal_attention_per_request() -> None:
    lengths = {7: 5, 3: 9, 11: 1}
    kv = _random_requests(lengths)
    out = _attend(_cache(), BatchBuilder(_cache().cfg), [(r, [0] * n) for r, n in lengths.items()], kv)
    expected = torch.cat([_dense_causal(*kv[r], first_pos=0) for r in lengths])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_chunked_prefill_continuation_attends_over_the_cached_prefix() -> None:
    kv = _random_requests({0: 11, 1: 6})
    cache, builder = _cache(), BatchBuilder(_cache().cfg)
    first = _attend(cache, builder, [(0, [0] * 4), (1, [0] * 6)], kv)
    second = _attend(cache, builder, [(0, [0] * 7)], kv)  # continuation: positions 4..10
    whole0 = _dense_causal(*kv[0], first_pos=0)
    torch.testing.assert_close(torch.cat([first[:4], second]), whole0, rtol=0, atol=1e-6)
    torch.testing.assert_close(first[4:], _dense_causal(*kv[1], first_pos=0), rtol=0, atol=1e-6)


def test_padding_rows_write_nothing_and_get_zeros() -> None:
    kv = _random_requests({0: 3})
    cache, builder = _cache(), BatchBuilder(_cache().cfg)
    batch = builder.build([(0, [0, 0, 0])])
    q = torch.cat([kv[0][0], torch.randn(2, H, K)])  # two padding rows after the real ones
    pos = torch.cat([batch.positions_T, torch.zeros(2, dtype=torch.int64)])
    cache.write(0, kv[0][1], kv[0][2], batch.attn.slot_mapping)
    before = cache.k_cache_LNZHK[0].clone()
    cache.write(0, torch.randn(2, H, K), torch.randn(2, H, K), torch.tensor([-1, -1]))
    assert torch.equal(cache.k_cache_LNZHK[0], before)
    out = paged_causal_attention(q, pos, cache, 0, batch.attn)
    assert torch.equal(out[3:], torch.zeros(2, H, K))
    torch.testing.assert_close(out[:3], _dense_causal(*kv[0], first_pos=0), rtol=0, atol=1e-6)


def test_batch_builder_tracks_context_blocks_and_slots() -> None:
    builder = BatchBuilder(KVCacheConfig(num_layers=1, num_blocks=4, block_size=4, num_heads=1, head_dim=2))
    first = builder.build([(5, [1, 2, 3]), (9, [4, 5, 6, 7, 8])])
    assert first.positions_T.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert first.attn.slot_mapping.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert first.attn.block_table.tolist() == [[0, 0], [1, 2]]
    second = builder.build([(9, [9]), (5, [10])])  # one decode token each
    assert second.positions_T.tolist() == [5, 3]
    assert second.attn.seq_lens_cpu.tolist() == [6, 4]
    assert second.attn.slot_mapping.tolist() == [9, 3]
    idle = builder.build([])
    assert idle.num_tokens == 0 and idle.attn.num_reqs == 0
    with pytest.raises(ValueError, match=r"the KV cache is full \(4 blocks of 4, 1 free, this batch needs 3 more\); "
                                          r"raise MiniConfig.num_kv_blocks"):
        builder.build([(1, list(range(9)))])
    with pytest.raises(ValueError, match="request 2 appears twice in one batch"):
        builder.build([(2, [1]), (2, [2])])


def test_batch_builder_frees_a_finished_requests_blocks_for_the_next() -> None:
    builder = BatchBuilder(KVCacheConfig(num_layers=1, num_blocks=4, block_size=4, num_heads=1, head_dim=2))
    builder.build([(5, [1, 2, 3]), (9, [4, 5, 6, 7, 8])])  # 5 holds block 0, 9 holds 1 and 2
    assert builder.num_free_blocks == 1
    assert builder.free(9) == 2 and builder.num_free_blocks == 3
    with pytest.raises(ValueError, match=r"request 9 holds no KV blocks \(never built, or freed already\)"):
        builder.free(9)
    again = builder.build([(9, [1, 2, 3, 4, 5, 6, 7, 8, 9])])  # a new request 9 from position 0, lowest blocks first
    assert again.positions_T.tolist() == list(range(9))
    assert again.attn.block_table.tolist() == [[1, 2, 3]]
    assert builder.num_free_blocks == 0
    builder.free(5)
    builder.free(9)
    assert builder.num_free_blocks == 4 and builder.blocks == {} and builder.num_computed == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 9, "num_experts": 8}, r"top_k \(9\) exceeds num_experts \(8\); pick top_k <= num_experts"),
        ({"schedule": "fast"}, r"unknown MoE schedule 'fast'; use one of \('ht', 'll'\)"),
        ({"scoring": "relu"}, r"unknown router scoring 'relu'"),
        ({"hidden_size": 0}, r"MiniConfig.hidden_size must be >= 1 \(got 0\)"),
        ({"head_dim": 7}, r"head_dim \(7\) must be even"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MiniConfig(**kwargs)


def test_uniform_decode_batch_equals_per_request_attention() -> None:
    # Contexts of 5, 9 and 1 tokens, then one decode token each: the batched decode path must
    # match dense causal attention per request (it masks each padded context by its seq_len).
    lengths = {7: 6, 3: 10, 11: 2}
    kv = _random_requests(lengths)
    cache, builder = _cache(), BatchBuilder(_cache().cfg)
    _attend(cache, builder, [(r, [0] * (n - 1)) for r, n in lengths.items()], kv)
    out = _attend(cache, builder, [(r, [0]) for r in lengths], kv)
    expected = torch.cat([_dense_causal(*kv[r], first_pos=0)[-1:] for r in lengths])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_uniform_decode_padding_reads_only_each_requests_own_written_slots() -> None:
    # The batched decode pads every context to the longest; the padding re-reads the request's own
    # last slot. Here every slot nobody wrote holds NaN: a padding read through the block table's
    # unused columns (another request's block) or of the unwritten rest of the request's own block
    # would turn a masked-out weight into 0 * NaN = NaN.
    lengths = {7: 6, 3: 10, 11: 2}
    kv = _random_requests(lengths)
    cache, builder = _cache(), BatchBuilder(_cache().cfg)
    for t in (*cache.k_cache_LNZHK, *cache.v_cache_LNZHK):
        t.fill_(float("nan"))
    _attend(cache, builder, [(r, [0] * (n - 1)) for r, n in lengths.items()], kv)
    out = _attend(cache, builder, [(r, [0]) for r in lengths], kv)
    expected = torch.cat([_dense_causal(*kv[r], first_pos=0)[-1:] for r in lengths])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
