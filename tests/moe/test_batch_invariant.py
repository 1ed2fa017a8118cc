"""Deterministic mode, piece by piece: a token's bits do not depend on the other tokens of the call.

Each test computes the same rows inside different calls (other row counts, other neighbours,
another split of a request) and asserts ``torch.equal``. The last group checks the torch facts
the mode is built on, so that a torch or CPU where they fail says so here first.

Legend: M rows, K input features, N output features, T tokens, H heads, D hidden.
"""

from __future__ import annotations

import math

import pytest
import torch

import asyncdbo
from asyncdbo.models import KVCacheConfig, MiniConfig, PagedKVCache, paged_causal_attention
from asyncdbo.models.tiled_attention import QUERY_TILE
from asyncdbo.moe import MoEConfig, MoELayer
from asyncdbo.moe.batch_invariant import ROW_TILE, is_deterministic, linear, sigmoid, silu, swiglu
from asyncdbo.plan import split_attn_metadata, split_tokens
from asyncdbo.serving import BatchBuilder

G = torch.Generator().manual_seed(0)


def test_a_tiled_gemm_row_has_the_same_bits_in_any_call() -> None:
    x_MK, w_NK = torch.randn(300, 64, generator=G), torch.randn(48, 64, generator=G)
    whole_MN = linear(x_MK, w_NK, tile=16)
    for lo, hi in [(0, 1), (5, 8), (17, 60), (1, 300), (299, 300)]:
        assert torch.equal(linear(x_MK[lo:hi], w_NK, tile=16), whole_MN[lo:hi]), (lo, hi)
    torch.testing.assert_close(whole_MN, torch.nn.functional.linear(x_MK, w_NK), rtol=1e-5, atol=1e-5)
    assert linear(x_MK[:0], w_NK, tile=16).shape == (0, 48)


def test_exact_silu_and_sigmoid_do_not_depend_on_the_lane() -> None:
    # Cuts at every length and offset put each element in a vector lane or in the scalar tail.
    x = torch.randn(5000, generator=G) * 4
    for fn in (silu, sigmoid):
        ref = fn(x, True)
        for lo, hi in [(0, n) for n in range(1, 70)] + [(s, s + 1000) for s in range(1, 40)]:
            assert torch.equal(fn(x[lo:hi], True), ref[lo:hi]), (fn.__name__, lo, hi)
        torch.testing.assert_close(ref, fn(x, False), rtol=1e-6, atol=1e-7)


def test_swiglu_rows_are_batch_invariant() -> None:
    x_MD = torch.randn(150, 32, generator=G)
    gate_FD, up_FD, down_DF = (torch.randn(16, 32, generator=G), torch.randn(16, 32, generator=G),
                               torch.randn(32, 16, generator=G))
    whole_MD = swiglu(x_MD, gate_FD, up_FD, down_DF, ROW_TILE)
    for lo, hi in [(0, 1), (3, 6), (10, 40), (70, 150)]:
        assert torch.equal(swiglu(x_MD[lo:hi], gate_FD, up_FD, down_DF, ROW_TILE), whole_MD[lo:hi])


def test_the_default_is_on_for_cpu_tensors_and_the_flag_is_typed() -> None:
    assert is_deterministic(None, torch.zeros(1)) is True
    assert is_deterministic(False, torch.zeros(1)) is False
    with pytest.raises(ValueError, match=r"^MoEConfig\.deterministic must be True, False or None \(on for CPU inputs\) \(got 1\)$"):
        MoEConfig(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2, deterministic=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^MiniConfig\.deterministic must be True, False or None \(got 'yes'\)$"):
        MiniConfig(deterministic="yes")  # type: ignore[arg-type]


# -- attention -------------------------------------------------------------------------------------


H, K = 2, 32


def _write(cache: PagedKVCache, builder: BatchBuilder, chunks: list[tuple[int, int]], g: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, object]:
    batch = builder.build([(rid, [0] * n) for rid, n in chunks])
    T = batch.num_tokens
    cache.write(0, torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g), batch.attn.slot_mapping)
    return torch.randn(T, H, K, generator=g), batch.positions_T, batch.attn


def _dense(q_THK: torch.Tensor, k_SHK: torch.Tensor, v_SHK: torch.Tensor, first_pos: int) -> torch.Tensor:
    t, s = q_THK.shape[0], k_SHK.shape[0]
    scores_HTS = torch.einsum("thk,shk->hts", q_THK, k_SHK) / math.sqrt(K)
    mask_TS = torch.arange(s)[None, :] <= (first_pos + torch.arange(t))[:, None]
    return torch.einsum("hts,shk->thk", scores_HTS.masked_fill(~mask_TS, float("-inf")).softmax(-1), v_SHK)


def test_deterministic_attention_is_causal_attention() -> None:
    cache = PagedKVCache(KVCacheConfig(num_layers=1, num_blocks=64, block_size=4, num_heads=H, head_dim=K))
    builder = BatchBuilder(cache.cfg)
    g = torch.Generator().manual_seed(1)
    q_THK, pos_T, attn = _write(cache, builder, [(0, 150), (1, 3), (2, 70)], g)
    out_THK = paged_causal_attention(q_THK, pos_T, cache, 0, attn, deterministic=True)
    flat_k = cache.k_cache_LNZHK[0].view(-1, H, K)
    flat_v = cache.v_cache_LNZHK[0].view(-1, H, K)
    qsl = attn.query_start_loc_cpu.tolist()
    for r in range(3):
        slots = attn.slot_mapping[qsl[r]:qsl[r + 1]]
        want = _dense(q_THK[qsl[r]:qsl[r + 1]], flat_k[slots], flat_v[slots], 0)
        torch.testing.assert_close(out_THK[qsl[r]:qsl[r + 1]], want, rtol=1e-5, atol=1e-5)


def test_a_query_gets_the_same_bits_whole_split_or_in_other_company() -> None:
    # 150 + 3 + 70 queries, then each token split: a truncated head and a continuation see the
    # context the way a DBO ubatch does; every query must keep its bits.
    cache = PagedKVCache(KVCacheConfig(num_layers=1, num_blocks=64, block_size=4, num_heads=H, head_dim=K))
    builder = BatchBuilder(cache.cfg)
    q_THK, pos_T, attn = _write(cache, builder, [(0, 150), (1, 3), (2, 70)], torch.Generator().manual_seed(2))
    whole_THK = paged_causal_attention(q_THK, pos_T, cache, 0, attn, deterministic=True)
    for n in (2, 3, 4):
        slices = split_tokens(attn.query_start_loc_cpu, n, 223 + 13)
        parts = [paged_causal_attention(q_THK[s.token_slice], pos_T[s.token_slice], cache, 0, meta, deterministic=True)
                 for s, meta in zip(slices, split_attn_metadata(attn, slices))]
        assert torch.equal(torch.cat(parts), whole_THK), n
    alone = split_attn_metadata(attn, split_tokens(attn.query_start_loc_cpu, 1))[0]
    assert torch.equal(paged_causal_attention(q_THK, pos_T, cache, 0, alone, deterministic=True), whole_THK)


# -- the MoE layer, one rank --------------------------------------------------------------------------


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_a_token_gets_the_same_moe_output_in_any_batch(scoring: str) -> None:
    kw = dict(n_group=4, topk_group=2, num_shared_experts=2) if scoring == "sigmoid" else {}
    layer = MoELayer(MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2, scoring=scoring, **kw), seed=4)
    x_TD = torch.randn(50, 32, generator=G)
    whole_TD = asyncdbo.run(layer, x_TD)
    for lo, hi in [(0, 1), (7, 9), (13, 50)]:
        assert torch.equal(asyncdbo.run(layer, x_TD[lo:hi]), whole_TD[lo:hi])


# -- the torch facts deterministic mode relies on ---------------------------------------------------


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bmm_of_query_tiles_gives_a_row_the_same_bits_whatever_the_batching(head_dim: int) -> None:
    """Attention batches its fixed ``[QUERY_TILE, K] x [K, C]`` GEMMs two ways (shared keys as a
    zero-stride batch, or each item's own keys) and over any number of items; at QUERY_TILE rows
    neither may change a row's bits. (At 1-2 rows they do: torch then folds a zero-stride batch
    into one GEMM with other blocking.)"""
    g = torch.Generator().manual_seed(head_dim)
    k_CK, v_CK = torch.randn(64, head_dim, generator=g), torch.randn(64, head_dim, generator=g)
    for n in (1, 3, 40):
        q_NQK = torch.randn(n, QUERY_TILE, head_dim, generator=g)
        p_NQC = torch.randn(n, QUERY_TILE, 64, generator=g)
        one_by_one = torch.stack([q @ k_CK.t() for q in q_NQK])
        assert torch.equal(torch.bmm(q_NQK, k_CK.t().expand(n, head_dim, 64)), one_by_one)
        assert torch.equal(torch.bmm(q_NQK, k_CK.t().expand(n, head_dim, 64).contiguous()), one_by_one)
        pv = torch.stack([p @ v_CK for p in p_NQC])
        assert torch.equal(torch.bmm(p_NQC, v_CK.expand(n, 64, head_dim)), pv)
        assert torch.equal(torch.bmm(p_NQC, v_CK.expand(n, 64, head_dim).contiguous()), pv)


def test_exp_does_not_depend_on_the_lane() -> None:
    x = -torch.rand(5000, generator=G) * 80  # the range softmax feeds it: (-80, 0]
    ref = torch.exp(x)
    for lo, hi in [(0, n) for n in range(1, 70)] + [(s, s + 1000) for s in range(1, 40)]:
        assert torch.equal(torch.exp(x[lo:hi]), ref[lo:hi])
