"""moe_from_hf: the expert-parallel, overlapped asyncdbo layer reproduces Hugging Face's own
Mixtral and DeepSeek-V3 MoE blocks (tiny random-init configs, no downloads) on 2 and 4 gloo ranks,
serial and with 2 DBO ubatches, to max-abs-diff <= 1e-5 in fp32."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_ranks import hf_all_cases, hf_vs_asyncdbo, tiny_block  # noqa: E402

from asyncdbo.testing import RankPool, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_two_ranks_match_the_hf_block(pool: RankPool, kind: str, schedule: str) -> None:
    results = pool.run(hf_vs_asyncdbo, kind, schedule, 24, [10, 14])
    for res in results:
        assert res["local_experts"] == 4 and res["nonzero"]
        assert res["serial"] <= 1e-5 and res["dbo"] <= 1e-5, res


@pytest.mark.timeout(90)
def test_idle_rank_and_empty_ubatch_match_the_hf_block(pool: RankPool) -> None:
    a = pool.run(hf_vs_asyncdbo, "deepseek", "ht", 12, [0, 12])
    assert all(r["serial"] <= 1e-5 and r["dbo"] <= 1e-5 for r in a), a


@pytest.mark.timeout(120)
def test_four_ranks_match_the_hf_blocks() -> None:
    tokens = [16, 0, 5, 32]
    sizes = [[8, 8], [0, 0], [2, 3], [20, 12]]
    results = run_ranks(hf_all_cases, 4, tokens, sizes, timeout_s=100.0)
    for rank, per_case in enumerate(results):
        assert sorted(per_case) == ["deepseek/ht", "deepseek/ll", "mixtral/ht", "mixtral/ll"]
        for case, res in per_case.items():
            assert res["local_experts"] == 2
            assert res["serial"] <= 1e-5 and res["dbo"] <= 1e-5, (rank, case, res)


def test_unknown_block_is_refused() -> None:
    from asyncdbo.moe.hf import moe_from_hf

    block = tiny_block("mixtral").experts
    with pytest.raises(ValueError, match=r"^moe_from_hf does not know MixtralExperts; supported: MixtralSparseMoeBlock"):
        moe_from_hf(block)
