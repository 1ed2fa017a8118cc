"""Mixtral, Qwen3-MoE and DeepSeek-V3 under DBO give transformers' logits and greedy tokens.

transformers is the oracle: tiny random models of each architecture (built offline), their own
eager fp32 forward over each request's tokens.  asyncdbo's models run a prefill of three uneven
requests per rank and three greedy decode steps on 1, 2 and 4 gloo ranks (DP = EP), serially and
with DBO (every step microbatched, token split: requests straddle ubatches), each run feeding its
own greedy tokens.  Both runs must give transformers' logits within ``HF_TOL`` and exactly its
greedy tokens; DBO must equal serial within ``DBO_TOL`` (the runner's contract on CPU fp32: with
EP the experts' GEMMs see other row sets per ubatch).  One rank builds from the in-memory model's
state dict; 2 and 4 ranks load a sharded checkpoint saved with ``save_pretrained``, each rank
reading its own experts.  The three architectures cover both MoE schedules, both stream policies
and 2 and 3 ubatches between them (``_hf_model_ranks.VARIANTS``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("transformers")

from _hf_model_ranks import (  # noqa: E402
    ARCHS,
    DECODE_STEPS,
    VARIANTS,
    checkpoints_on_ranks,
    generate_serial_and_dbo,
    prompts_for,
)

import asyncdbo  # noqa: E402
from asyncdbo.models.hf import from_hf_model  # noqa: E402
from asyncdbo.models.hf.generate import Generation, compare_with_hf  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402
from asyncdbo.testing import RankPool  # noqa: E402

#: Max |logits diff| against transformers' fp32 forward (measured: <= 3e-6 on these models).
HF_TOL = 2e-5
#: Max |logits diff| between the serial and the DBO run (the runner's CPU fp32 contract).
DBO_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    return {name: tiny_hf_model(name) for name in ARCHS}


@pytest.fixture(scope="module")
def checkpoints(hf_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_ckpt")
    for name, model in hf_models.items():
        model.save_pretrained(root / name, max_shard_size="20KB")  # several shards and an index
    return {name: str(root / name) for name in ARCHS}


def assert_matches_hf(hf_model: Any, runs: dict[str, Generation], *, prompts: dict[int, list[int]]) -> None:
    serial, dbo = runs["serial"], runs["dbo"]
    assert serial.fed.keys() == prompts.keys()
    for gen in (serial, dbo):
        parity = compare_with_hf(hf_model, gen)
        assert parity.max_abs_diff <= HF_TOL, parity
        assert parity.tokens_identical and parity.greedy_total == len(prompts) * (DECODE_STEPS + 1), parity
    assert dbo.greedy == serial.greedy and dbo.fed == serial.fed
    for r in prompts:
        assert (serial.logits[r] - dbo.logits[r]).abs().max().item() <= DBO_TOL
    assert all(rec.microbatched for rec in dbo.records), [rec.reason for rec in dbo.records]
    assert not any(rec.microbatched for rec in serial.records)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ARCHS)
def test_one_rank_from_the_state_dict_matches_transformers(hf_models: dict[str, Any], name: str) -> None:
    v = VARIANTS[name]
    model = from_hf_model(hf_models[name], schedule=v.schedule, max_ubatches=3, block_size=4, num_kv_blocks=64)
    prompts = prompts_for(0)
    runs = asyncdbo.run(generate_serial_and_dbo, model, v, prompts, None)
    assert_matches_hf(hf_models[name], runs, prompts=prompts)
    # prompts of 7, 11 and 4 tokens: the token split cuts request 1 (tokens 7..17) at 11, or at 14
    assert runs["dbo"].records[0].ubatch_num_tokens == {2: (11, 11), 3: (7, 7, 8)}[v.num_ubatches]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_load_their_experts_and_match_transformers(pool: RankPool, hf_models: dict[str, Any],
                                                             checkpoints: dict[str, str]) -> None:
    per_rank = pool.run(checkpoints_on_ranks, checkpoints, timeout_s=170.0)
    for rank, results in enumerate(per_rank):
        for name in ARCHS:
            assert_matches_hf(hf_models[name], results[name], prompts=prompts_for(rank))
    # each rank read only its own experts: Mixtral's 4 experts are 0-1 on rank 0, 2-3 on rank 1
    read = [{n for n in r["mixtral"]["tensors_read"] if ".experts." in n} for r in per_rank]
    assert {n.split(".experts.")[1].split(".")[0] for n in read[0]} == {"0", "1"}
    assert {n.split(".experts.")[1].split(".")[0] for n in read[1]} == {"2", "3"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_four_ranks_with_an_idle_rank_match_transformers(pool4: RankPool, hf_models: dict[str, Any],
                                                          checkpoints: dict[str, str]) -> None:
    per_rank = pool4.run(checkpoints_on_ranks, checkpoints, (2,), timeout_s=220.0)
    for rank, results in enumerate(per_rank):
        for name in ARCHS:
            if rank == 2:  # idle: no requests, yet it joined every step's collectives
                assert results[name]["dbo"].fed == {} and len(results[name]["dbo"].records) == DECODE_STEPS + 1
                continue
            assert_matches_hf(hf_models[name], results[name], prompts=prompts_for(rank))


def test_a_nan_logits_row_makes_the_worst_difference_nan() -> None:
    """A NaN row (issue 45: NaN logits of the shorter requests of a bf16 prefill) must not vanish
    from :func:`compare_with_hf`'s worst difference: Python's ``max(0.0, nan)`` is 0.0, which made
    a check ``max_abs_diff <= tol`` pass on NaN logits. Here every row is transformers' own but one
    row of the second request, and the greedy tokens agree, so only the difference can tell."""
    from asyncdbo.models.hf.generate import Generation
    from asyncdbo.models.hf.reference import hf_logits

    hf = tiny_hf_model("mixtral")
    prompts = prompts_for(0)
    gen = Generation()
    for r, prompt in prompts.items():
        gen.fed[r] = list(prompt)
        gen.logits[r] = hf_logits(hf, prompt).clone()
        gen.greedy[r] = [int(gen.logits[r][-1].argmax())]
    assert compare_with_hf(hf, gen).max_abs_diff == 0.0 and compare_with_hf(hf, gen).tokens_identical
    gen.logits[1][0] = float("nan")
    parity = compare_with_hf(hf, gen)
    assert parity.tokens_identical
    assert math.isnan(parity.max_abs_diff), parity
    assert not parity.max_abs_diff <= HF_TOL


def test_worst_diff_keeps_a_nan_wherever_it_comes() -> None:
    from asyncdbo.models.hf.generate import worst_diff

    assert worst_diff([]) == 0.0 and worst_diff([1.0, 3.0, 2.0]) == 3.0 and worst_diff(iter([0.5])) == 0.5
    for diffs in ([0.1, math.nan, 5.0], [math.nan, 1.0], [1.0, math.nan]):
        assert math.isnan(worst_diff(diffs)), diffs
    assert max(0.0, math.nan) == 0.0  # what it replaces
