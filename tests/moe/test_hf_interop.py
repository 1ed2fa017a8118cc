"""moe_from_hf: the expert-parallel, overlapped asyncdbo layer reproduces Hugging Face's own
Mixtral and DeepSeek-V3 MoE blocks (tiny random-init configs, no downloads) on 2 and 4 gloo ranks.

Against HF: max-abs-diff <= 1e-5 in fp32, torch's bf16 tolerance in bf16 (rtol 1.6e-2, atol
1e-5). DBO against the serial call of the same layer: ``torch.equal`` (deterministic mode, the CPU
default). Routing against HF's own router: the same expert ids on tie-heavy bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from asyncdbo.moe import route  # noqa: E402
from asyncdbo.moe.hf import moe_from_hf  # noqa: E402

from _hf_ranks import HFCase, hf_all_cases, hf_case, hf_plain_call, hf_vs_asyncdbo, tiny_block  # noqa: E402

from asyncdbo.testing import RankPool  # noqa: E402

pytestmark = pytest.mark.slow


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["nonzero"], (rank, res)
        assert res["hf_close"], (rank, res)
        assert res["dbo_equal"], (rank, res)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_two_ranks_match_the_hf_block(pool: RankPool, kind: str, schedule: str) -> None:
    results = pool.run(hf_vs_asyncdbo, kind, schedule, 24, [10, 14])
    assert [r["local_experts"] for r in results] == [4, 4]
    _check(results)


@pytest.mark.timeout(90)
def test_idle_rank_and_empty_ubatch_match_the_hf_block(pool: RankPool) -> None:
    _check(pool.run(hf_vs_asyncdbo, "deepseek", "ht", 12, [0, 12]))


@pytest.mark.timeout(90)
def test_no_renormalisation_and_three_shared_experts_in_three_ubatch_streams(pool: RankPool) -> None:
    case = HFCase(kind="deepseek", tokens=(30, 21), sizes=((10, 10, 10), (7, 0, 14)), stream_policy="ubatch",
                  block=dict(norm_topk_prob=False, n_shared_experts=3))
    _check(pool.run(hf_case, case))


@pytest.mark.timeout(90)
def test_a_strong_random_correction_bias_in_four_ubatches(pool: RankPool) -> None:
    # bias ~ N(0, 1) against sigmoid scores in (0, 1): the bias, not the score, decides the choice
    case = HFCase(kind="deepseek", tokens=(40, 33), sizes=((10, 10, 10, 10), (1, 2, 30, 0)), schedule="ll",
                  block=dict(bias_scale=1.0))
    _check(pool.run(hf_case, case))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_a_link_slower_on_one_rank_finishes_comm_in_another_order(pool: RankPool, kind: str) -> None:
    # ib400 with 1 ms latency on rank 0 and 15 ms on rank 1: each rank's comm completes in its own
    # order; the per-ubatch process groups keep the collectives paired.
    case = HFCase(kind=kind, tokens=(24, 24), sizes=((8, 8, 8), (12, 6, 6)), latency_s=(1e-3, 15e-3))
    _check(pool.run(hf_case, case))


@pytest.mark.timeout(90)
def test_an_expert_shard_that_receives_zero_rows(pool: RankPool) -> None:
    # A -10 bias on experts 4..7 (rank 1's shard): no token of either rank picks them, so rank 1's
    # experts get zero rows in every ubatch while it still joins every all-to-all.
    case = HFCase(kind="deepseek", tokens=(16, 16), sizes=((8, 8), (5, 11)), block=dict(bias_add={e: -10.0 for e in range(4, 8)}))
    results = pool.run(hf_case, case)
    assert all(max(r["picked"]) < 4 for r in results), results
    _check(results)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_bf16_matches_the_hf_block_and_dbo_is_bitwise(pool: RankPool, kind: str) -> None:
    case = HFCase(kind=kind, tokens=(64, 48), sizes=((20, 44, 0), (16, 16, 16)), dtype="bfloat16", schedule="ll")
    _check(pool.run(hf_case, case))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_a_plain_asyncio_run_of_the_layer_on_a_BSD_input(pool: RankPool, kind: str) -> None:
    for rank, res in enumerate(pool.run(hf_plain_call, kind)):
        assert res["shape"] == (2, 5 + rank, 32)
        assert res["diff"] <= 1e-5, res


@pytest.mark.timeout(120)
def test_four_ranks_match_the_hf_blocks(pool4: RankPool) -> None:
    tokens = [16, 0, 5, 32]
    sizes = [[8, 8], [0, 0], [2, 3], [20, 12]]
    results = pool4.run(hf_all_cases, tokens, sizes, timeout_s=100.0)
    for rank, per_case in enumerate(results):
        assert sorted(per_case) == ["deepseek/ht", "deepseek/ll", "mixtral/ht", "mixtral/ll"]
        for case, res in per_case.items():
            assert res["local_experts"] == 2
            assert res["hf_close"] and res["dbo_equal"], (rank, case, res)


# -- routing in bf16, one process ---------------------------------------------------------------------


def test_mixtral_routes_tie_heavy_bf16_tokens_like_hf() -> None:
    """Router rows that share a large common part put many bf16 logits on exact ties. HF takes the
    logits in bf16 and the softmax in float32, and so must asyncdbo: float32 logits (the old rule)
    break those ties differently and send tokens to other experts."""
    block = tiny_block("mixtral", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        common = torch.randn(32, generator=g)
        block.gate.weight.copy_((common[None, :] + 0.05 * torch.randn(8, 32, generator=g)).to(torch.bfloat16))
        x_TD = torch.randn(4096, 32, generator=g).to(torch.bfloat16)
        logits_TE, hf_w_TK, hf_ids_TK = block.gate(x_TD)
    layer = moe_from_hf(block)
    top_TE = logits_TE.float().sort(dim=-1, descending=True).values
    assert int(((top_TE[:, 0] == top_TE[:, 1]) | (top_TE[:, 1] == top_TE[:, 2])).sum()) > 400  # tie-heavy
    float32_ids_TK = torch.topk(torch.softmax(x_TD.float() @ layer.router_ED.float().t(), -1), 2)[1]
    assert int((float32_ids_TK != hf_ids_TK).any(-1).sum()) > 100
    for deterministic in (False, True):
        w_TK, ids_TK = route(x_TD, layer.router_ED, layer.cfg, deterministic=deterministic)
        assert torch.equal(ids_TK, hf_ids_TK) and torch.equal(w_TK, hf_w_TK), deterministic


def test_deepseek_routes_exact_ties_like_hf() -> None:
    """Pairs of identical experts tie exactly in float32; HF's unsorted top-k decides, and
    asyncdbo's choice must be the same (weights bitwise equal off deterministic mode, where the
    sigmoid is HF's own; within an ulp with it)."""
    block = tiny_block("deepseek", dtype=torch.bfloat16, bias_scale=0.0)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        w_ED = torch.randn(8, 32, generator=g) * 0.2
        w_ED[1::2] = w_ED[0::2]
        block.gate.weight.copy_(w_ED)
        x_TD = torch.randn(4096, 32, generator=g).to(torch.bfloat16)
        _, hf_w_TK, hf_ids_TK = block.gate(x_TD)
    layer = moe_from_hf(block)
    for deterministic in (False, True):
        w_TK, ids_TK = route(x_TD, layer.router_ED, layer.cfg, bias_E=layer.bias_E, deterministic=deterministic)
        assert torch.equal(ids_TK, hf_ids_TK), deterministic
        if deterministic:
            torch.testing.assert_close(w_TK, hf_w_TK, rtol=1e-6, atol=0)
        else:
            assert torch.equal(w_TK, hf_w_TK)


def test_unknown_block_is_refused() -> None:
    block = tiny_block("mixtral").experts
    with pytest.raises(ValueError, match=r"^moe_from_hf does not know MixtralExperts; supported: MixtralSparseMoeBlock"):
        moe_from_hf(block)
