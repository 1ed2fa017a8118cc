"""Thresholds and the DP-wide vote: pure rules first, then real gloo groups of 2 and 4 ranks."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncdbo.plan import (
    LocalStepInfo,
    PlanReason,
    PlanStats,
    RankVote,
    StepPlan,
    ThresholdConfig,
    agree_across_dp,
    decide_from_votes,
    plan_step,
    should_microbatch,
)
from asyncdbo.testing import RankPool

LOW = ThresholdConfig(decode_threshold=4, prefill_threshold=8)


def prefill(*lens: int) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


# ---- local rules --------------------------------------------------------------------------------


def test_uniform_decode_uses_the_decode_threshold() -> None:
    decode_32 = list(range(33))  # 32 requests of 1 token
    assert should_microbatch(32, decode_32) == (True, "uniform decode: 32 tokens >= threshold 32")
    assert should_microbatch(31, decode_32[:-1]) == (False, "uniform decode: 31 tokens < threshold 32")
    # With one speculative token, a uniform decode step has 2 query tokens per request.
    spec = list(range(0, 66, 2))
    assert should_microbatch(64, spec, ThresholdConfig(num_spec_tokens=1))[0]
    assert should_microbatch(64, spec) == (False, "mixed/prefill: 64 tokens < threshold 512")


def test_mixed_and_prefill_use_the_prefill_threshold() -> None:
    assert should_microbatch(512, prefill(500, 12)) == (True, "mixed/prefill: 512 tokens >= threshold 512")
    assert should_microbatch(100, prefill(1, 1, 98)) == (False, "mixed/prefill: 100 tokens < threshold 512")


def test_bad_thresholds_are_named() -> None:
    with pytest.raises(ValueError, match=r"^decode_threshold \(-1\) must be >= 0; use 0 to always microbatch$"):
        ThresholdConfig(decode_threshold=-1)
    with pytest.raises(ValueError, match=re.escape(
            "num_spec_tokens (-2) must be >= 0 (the draft tokens each decode request carries); use 0 without "
            "speculative decoding")):
        ThresholdConfig(num_spec_tokens=-2)
    with pytest.raises(ValueError, match=r"num_tokens_padded \(3\) is below num_tokens_unpadded \(5\)"):
        LocalStepInfo(num_tokens_unpadded=5, num_tokens_padded=3, wants_ubatch=True)
    with pytest.raises(ValueError, match=r"max_imbalance \(0\.5\) must be >= 1"):
        agree_across_dp(LocalStepInfo(num_tokens_unpadded=5, wants_ubatch=True), 2, max_imbalance=0.5)


@pytest.mark.parametrize("fields, message", [
    ({"decode_threshold": 32.5}, "ThresholdConfig.decode_threshold must be an int, got float 32.5; write e.g. "
                                 "decode_threshold=32"),
    ({"prefill_threshold": 512.0}, "ThresholdConfig.prefill_threshold must be an int, got float 512.0; write "
                                   "prefill_threshold=512"),
    ({"decode_threshold": math.nan}, "ThresholdConfig.decode_threshold must be an int, got float nan; write e.g. "
                                     "decode_threshold=32"),
    ({"prefill_threshold": True}, "ThresholdConfig.prefill_threshold must be an int, got bool True (True and False "
                                  "are not counts); write e.g. prefill_threshold=512"),
    ({"decode_threshold": "16"}, "ThresholdConfig.decode_threshold must be an int, got str '16'; write "
                                 "decode_threshold=16"),
    ({"num_spec_tokens": None}, "ThresholdConfig.num_spec_tokens must be an int, got NoneType None; write e.g. "
                                "num_spec_tokens=0"),
])
def test_thresholds_of_the_wrong_type_are_refused_naming_the_fix(fields: dict[str, Any], message: str) -> None:
    # a float compared as a threshold, True as one token, and nan (no token count reaches it) made no step microbatch
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        ThresholdConfig(**fields)


def test_numpy_integers_pass_as_thresholds_as_python_ints_do() -> None:
    np = pytest.importorskip("numpy")
    cfg = ThresholdConfig(decode_threshold=np.int64(4), prefill_threshold=np.int32(8), num_spec_tokens=np.int64(1))
    assert should_microbatch(8, [0, 2, 4, 6, 8], cfg) == (True, "uniform decode: 8 tokens >= threshold 4")


def V(rank: int, vote: str, tokens: int, padded: int | None = None,
      reason: PlanReason = PlanReason.MICROBATCHED) -> RankVote:
    return RankVote(rank, vote, reason, tokens, tokens if padded is None else padded)


def test_rules_busy_no_vetoes_idle_follows_imbalance_optional() -> None:
    d = decide_from_votes([V(0, "yes", 600), V(1, "no", 100, reason=PlanReason.BELOW_THRESHOLD)])
    assert (d.should_ubatch, d.reason, d.detail) == (False, PlanReason.RANK_DECLINED, "rank 1: below_threshold")
    d = decide_from_votes([V(0, "yes", 600, 640), V(1, "idle", 0)])
    assert (d.should_ubatch, d.num_tokens_padded, d.detail) == (True, 640, "idle rank(s) [1] run padding-only ubatches")
    d = decide_from_votes([V(0, "yes", 1000), V(1, "yes", 600)], max_imbalance=2.0)
    assert d.should_ubatch and d.num_tokens_across_dp == (1000, 600)
    d = decide_from_votes([V(0, "yes", 1300), V(1, "yes", 600), V(2, "idle", 0)], max_imbalance=2.0)
    assert (d.should_ubatch, d.reason) == (False, PlanReason.IMBALANCE)
    assert d.detail == "rank 0 has 1300 tokens, rank 1 has 600: ratio above max_imbalance 2"
    d = decide_from_votes([V(0, "idle", 0), V(1, "idle", 0)])
    assert (d.should_ubatch, d.reason) == (False, PlanReason.ALL_IDLE)


def test_without_a_group_the_vote_is_local() -> None:
    d = agree_across_dp(LocalStepInfo(num_tokens_unpadded=9, num_tokens_padded=16, wants_ubatch=True), 2)
    assert (d.should_ubatch, d.num_tokens_padded, d.world_size) == (True, 16, 1)
    d = agree_across_dp(LocalStepInfo(num_tokens_unpadded=9, wants_ubatch=False), 2)
    assert (d.should_ubatch, d.reason) == (False, PlanReason.DISABLED)  # a "no" without a reason


def test_plan_step_records_every_reason_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    stats = PlanStats()
    caplog.set_level(logging.DEBUG, logger="asyncdbo.plan")
    plan = plan_step(prefill(5, 7), thresholds=LOW, num_tokens_padded=16, stats=stats)
    assert plan.microbatched and [s.num_tokens for s in plan.slices] == [8, 4]
    assert plan.record.ubatch_num_tokens_padded == (8, 8) and plan.num_tokens_padded == 16
    assert plan_step(prefill(3), thresholds=LOW, stats=stats).record.reason is PlanReason.BELOW_THRESHOLD
    assert plan_step(prefill(9), enabled=False, stats=stats).record.reason is PlanReason.DISABLED
    assert plan_step(prefill(9), num_ubatches=1, stats=stats).record.reason is PlanReason.SINGLE_UBATCH
    refused = plan_step(prefill(9), policy="request", thresholds=LOW, stats=stats).record
    assert refused.reason is PlanReason.POLICY_REFUSED
    assert refused.detail == "request split leaves a ubatch without real tokens (sizes [0, 9])"  # a tie goes left
    assert plan_step([0], thresholds=LOW, stats=stats).record.reason is PlanReason.ALL_IDLE
    assert stats.num_steps == 6 and stats.last is not None and stats.last.step == 5
    assert stats.summary() == ("6 steps, 17% microbatched; all_idle=1; below_threshold=1; disabled=1; "
                               "policy_refused=1; single_ubatch=1")
    assert "step 1: below_threshold (mixed/prefill: 3 tokens < threshold 8)" in caplog.messages[1]


def test_should_microbatch_refuses_a_count_that_is_not_the_batchs() -> None:
    # 600 tokens against a 5-token batch would pass the 512 threshold for a batch that is not there
    with pytest.raises(ValueError, match=r"^num_tokens_unpadded \(600\) disagrees with query_start_loc, whose last "
                                         r"entry says the batch has 5 tokens; pass the real token count of the same batch$"):
        should_microbatch(600, [0, 5])


def test_request_policy_splits_three_ways_when_there_are_three_requests() -> None:
    plan = plan_step(prefill(100, 100, 1000), num_ubatches=3, policy="request", thresholds=LOW)
    assert plan.microbatched and plan.record.ubatch_num_tokens == (100, 100, 1000)
    refused = plan_step(prefill(100, 1000), num_ubatches=3, policy="request", thresholds=LOW).record
    assert refused.reason is PlanReason.POLICY_REFUSED
    assert refused.detail == "request split leaves a ubatch without real tokens (sizes [100, 1000, 0])"


def test_plan_step_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^num_ubatches \(0\) must be at least 1$"):
        plan_step(prefill(4), num_ubatches=0)
    with pytest.raises(ValueError, match=r"^num_ubatches \(9\) exceeds max_ubatches \(4\), the ubatches the model's MoE "
                                         r"layers were built for \(one process-group clone per ubatch\); build them with "
                                         r"max_ubatches >= 9 or plan fewer ubatches$"):
        plan_step(prefill(4), num_ubatches=9, max_ubatches=4)
    with pytest.raises(ValueError, match=r"^min_share \(-0\.1\) must lie in \[0, 0\.5\]$"):
        plan_step(prefill(4), min_share=-0.1)


@pytest.mark.parametrize("flags, message", [
    ({"enabled": "no"}, "plan_step() enabled must be True or False, got str 'no'; use True or False"),
    ({"enabled": 1}, "plan_step() enabled must be True or False, got int 1; use True or False"),
    ({"enabled": None}, "plan_step() enabled must be True or False, got NoneType None; use True or False"),
    ({"is_idle": "yes"}, "plan_step() is_idle must be True or False, got str 'yes'; use True or False"),
])
def test_plan_step_flags_must_be_bools(flags: dict[str, Any], message: str) -> None:
    # any truthy value passed: enabled="no" voted yes and microbatched
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        plan_step(prefill(9), thresholds=LOW, **flags)


def test_plan_step_thresholds_must_be_a_threshold_config() -> None:
    # a dict failed inside the plan with "'dict' object has no attribute 'num_spec_tokens'"
    with pytest.raises(TypeError, match="^" + re.escape(
            "plan_step() thresholds must be an asyncdbo.plan.ThresholdConfig, got dict {'decode_threshold': 8}; "
            "write thresholds=ThresholdConfig(decode_threshold=8)") + "$"):
        plan_step(prefill(9), thresholds={"decode_threshold": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^" + re.escape(
            "plan_step() thresholds must be an asyncdbo.plan.ThresholdConfig, got int 0; "
            "write thresholds=ThresholdConfig(decode_threshold=32, prefill_threshold=512)") + "$"):
        plan_step(prefill(9), thresholds=0)  # type: ignore[arg-type]


def test_plan_step_takes_numpy_bools_as_python_ones() -> None:
    np = pytest.importorskip("numpy")
    assert plan_step(prefill(9), thresholds=LOW, enabled=np.False_).record.reason is PlanReason.DISABLED
    assert plan_step(prefill(9), thresholds=LOW, enabled=np.True_, is_idle=np.False_).microbatched


# ---- real process groups ------------------------------------------------------------------------


def _plan_on_rank(rank: int, world_size: int, qsl_by_rank: list[list[int]], kwargs: dict[str, Any]) -> StepPlan:
    idle = kwargs.pop("idle_ranks", ())
    enabled = rank not in kwargs.pop("disabled_ranks", ())
    padded = kwargs.pop("padded_by_rank", None)
    return plan_step(qsl_by_rank[rank], dp_group=dist.group.WORLD, is_idle=rank in idle, enabled=enabled,
                     num_tokens_padded=None if padded is None else padded[rank], **kwargs)


def _every_ubatch_joins_the_collectives(rank: int, world_size: int, qsl_by_rank: list[list[int]]) -> list[int]:
    """Run one all_reduce per ubatch, as dispatch/combine would: empty ubatches included."""
    plan = plan_step(qsl_by_rank[rank], dp_group=dist.group.WORLD, thresholds=LOW, num_ubatches=3)
    sums = []
    for s in plan.slices:
        t = torch.tensor([s.num_tokens_padded])
        dist.all_reduce(t)
        sums.append(int(t))
    return sums


def _mismatched_num_ubatches(rank: int, world_size: int, counts: list[int]) -> str:
    try:
        plan_step(prefill(100), dp_group=dist.group.WORLD, thresholds=LOW, num_ubatches=counts[rank])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_agree_and_pad_to_the_larger(pool: RankPool) -> None:
    a, b = pool.run(_plan_on_rank, [prefill(10, 10), prefill(5, 4)],
                     {"thresholds": LOW, "padded_by_rank": [24, 9]})
    assert a.microbatched and b.microbatched
    assert a.num_tokens_padded == b.num_tokens_padded == 24
    assert a.record.ubatch_num_tokens_padded == b.record.ubatch_num_tokens_padded == (12, 12)
    assert a.record.ubatch_num_tokens == (12, 8)
    assert b.record.ubatch_num_tokens == (9, 0)  # its last ubatch is padding only, and still runs
    assert a.decision is not None and a.decision.num_tokens_across_dp == (20, 9)
    assert [v.vote for v in a.record.ranks] == ["yes", "yes"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_busy_rank_below_threshold_stops_everyone_and_is_named(pool: RankPool) -> None:
    plans = pool.run(_plan_on_rank, [prefill(600), prefill(100)], {})
    for p in plans:
        assert (p.microbatched, p.record.reason, p.record.detail) == (
            False, PlanReason.RANK_DECLINED, "rank 1: below_threshold")
        assert len(p.slices) == 1
    assert [p.num_tokens_padded for p in plans] == [600, 100]  # unsplit steps keep their own size


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_idle_rank_joins_with_padding_ubatches(pool: RankPool) -> None:
    busy, idle = pool.run(_plan_on_rank, [prefill(300, 300), [0, 1]], {"idle_ranks": (1,), "padded_by_rank": [608, 1]})
    assert busy.microbatched and idle.microbatched
    assert busy.record.detail == idle.record.detail == "idle rank(s) [1] run padding-only ubatches"
    assert idle.record.ubatch_num_tokens == (1, 0) and idle.record.ubatch_num_tokens_padded == (304, 304)
    assert busy.record.ubatch_num_tokens == (304, 296) and busy.record.ubatch_num_tokens_padded == (304, 304)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_imbalance_falls_out_only_when_asked(pool: RankPool) -> None:
    qsls = [prefill(1300), prefill(600)]
    allowed = pool.run(_plan_on_rank, qsls, {})
    assert all(p.microbatched for p in allowed)
    limited = pool.run(_plan_on_rank, qsls, {"max_imbalance": 2.0})
    assert {(p.microbatched, p.record.reason) for p in limited} == {(False, PlanReason.IMBALANCE)}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mismatched_num_ubatches_fails_on_every_rank(pool: RankPool) -> None:
    """A rank planning 1 ubatch still votes (it used to skip the vote and leave its peer waiting in
    the first collective until a timeout): every rank gets the same error, naming every count."""
    for counts in ([2, 3], [1, 2], [2, 1]):
        by_rank = f"rank 0: {counts[0]}, rank 1: {counts[1]}"
        msg = (f"ranks disagree on num_ubatches ({by_rank}); every rank of the DP group must plan the same number "
               "of ubatches: pass one num_ubatches to all of them (a DBORunner: the same RunnerConfig.num_ubatches, "
               "or under tuning='auto' the same AutoConfig.ubatch_counts)")
        assert pool.run(_mismatched_num_ubatches, counts) == [msg, msg], counts


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_four_ranks_busy_idle_and_uneven_padding(pool4: RankPool) -> None:
    qsls = [prefill(40), prefill(10, 10), [0], prefill(3, 3, 3)]
    plans = pool4.run(_plan_on_rank, qsls, {"thresholds": LOW, "policy": "token", "padded_by_rank": [48, 20, 0, 9]})
    assert all(p.microbatched for p in plans)
    assert {p.num_tokens_padded for p in plans} == {48}
    assert {p.record.ubatch_num_tokens_padded for p in plans} == {(24, 24)}
    assert [p.record.ubatch_num_tokens for p in plans] == [(24, 16), (20, 0), (0, 0), (9, 0)]
    assert [v.vote for v in plans[0].record.ranks] == ["yes", "yes", "idle", "yes"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_four_ranks_one_disabled_rank_declines_for_all(pool4: RankPool) -> None:
    qsls = [prefill(40)] * 4
    plans = pool4.run(_plan_on_rank, qsls, {"thresholds": LOW, "disabled_ranks": (1, 3)})
    assert {(p.microbatched, p.record.reason, p.record.detail) for p in plans} == {
        (False, PlanReason.RANK_DECLINED, "rank 1: disabled; rank 3: disabled")}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_four_ranks_every_ubatch_even_empty_joins_each_collective(pool4: RankPool) -> None:
    qsls = [prefill(30), prefill(9), [0], prefill(12)]
    assert pool4.run(_every_ubatch_joins_the_collectives, qsls) == [[40, 40, 40]] * 4


# ---------------------------------------------------------------- vLLM's V2 rule: dp_rule="smallest_rank"
V2 = ThresholdConfig(dp_rule="smallest_rank")


def test_the_v2_rule_tests_the_groups_step_kind_on_its_smallest_busy_rank() -> None:
    """300 uniform decodes beside a 520-token prefill: each rank passes its own threshold (V1, the
    default: every busy rank voted yes), but the group's step is mixed, and its smallest busy rank's
    300 tokens are below the prefill threshold (V2). Where every busy rank runs uniform decode of one
    length, the decode threshold applies; an idle rank follows under both."""
    def votes(*ranks: tuple[str, int, int]) -> list[RankVote]:
        return [RankVote(r, vote, PlanReason.MICROBATCHED, n, n, uniform_len=u) for r, (vote, n, u) in enumerate(ranks)]

    mixed = votes(("yes", 300, 1), ("yes", 520, 0))
    assert decide_from_votes(mixed).should_ubatch
    d = decide_from_votes(mixed, thresholds=V2)
    assert (d.should_ubatch, d.reason, d.detail) == (
        False, PlanReason.BELOW_THRESHOLD, "mixed/prefill step across the DP group: its smallest busy rank (rank 0) "
        "has 300 tokens < threshold 512 (dp_rule='smallest_rank')")
    assert decide_from_votes(votes(("yes", 300, 1), ("yes", 40, 1), ("idle", 0, 0)), thresholds=V2).should_ubatch
    d = decide_from_votes(votes(("yes", 300, 1), ("yes", 31, 1)), thresholds=V2)
    assert d.detail == ("uniform decode step across the DP group: its smallest busy rank (rank 1) has 31 tokens "
                        "< threshold 32 (dp_rule='smallest_rank')")
    d = decide_from_votes(votes(("yes", 300, 1), ("yes", 300, 2)), thresholds=V2)  # two query lengths: not uniform
    assert d.detail.startswith("mixed/prefill step across the DP group")
    d = decide_from_votes([RankVote(0, "yes", PlanReason.MICROBATCHED, 600, 600),  # a rank's own no still vetoes
                           RankVote(1, "no", PlanReason.DISABLED, 700, 700)], thresholds=V2)
    assert (d.should_ubatch, d.reason, d.detail) == (False, PlanReason.RANK_DECLINED, "rank 1: disabled")


def test_dp_rule_is_one_of_the_two_rules() -> None:
    with pytest.raises(ValueError) as err:
        ThresholdConfig(dp_rule="v2")
    assert str(err.value) == ("ThresholdConfig.dp_rule must be one of 'each_rank', 'smallest_rank' (got 'v2'); "
                              "'each_rank' is vLLM's V1 runner's rule, 'smallest_rank' its V2's")


def _mismatched_rules(rank: int, world_size: int) -> str:
    try:
        plan_step(prefill(600), dp_group=dist.group.WORLD, thresholds=V2 if rank else ThresholdConfig())
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_apply_the_v2_rule_through_one_vote_and_refuse_mixed_rules(pool: RankPool) -> None:
    decode_300, prefill_520 = list(range(301)), prefill(520)
    for kwargs, split in (({}, True), ({"thresholds": V2}, False)):
        plans = pool.run(_plan_on_rank, [decode_300, prefill_520], kwargs)
        assert [p.microbatched for p in plans] == [split, split], kwargs
        assert [v.uniform_len for v in plans[0].record.ranks] == [1, 0]
    assert plans[0].record.detail == plans[1].record.detail == (
        "mixed/prefill step across the DP group: its smallest busy rank (rank 0) has 300 tokens < threshold 512 "
        "(dp_rule='smallest_rank')")
    msg = ("ranks vote with different ThresholdConfig.dp_rule (rank 0: 'each_rank', rank 1: 'smallest_rank'); every "
           "rank of the DP group must apply the same rule: pass one ThresholdConfig to all of them")
    assert pool.run(_mismatched_rules) == [msg, msg]


def test_a_callers_uniform_decode_test_plans_as_plan_steps_own() -> None:
    """A runner makes the uniform-decode test once per step and hands it over: the same plans."""
    from asyncdbo.plan import is_uniform_decode

    for qsl in (list(range(41)), prefill(30, 1, 9), list(range(0, 81, 2))):
        for th in (LOW, ThresholdConfig(num_spec_tokens=1, decode_threshold=4)):
            own = plan_step(qsl, thresholds=th)
            given = plan_step(qsl, thresholds=th, uniform_decode=is_uniform_decode(qsl, th.num_spec_tokens))
            assert (given.microbatched, given.slices, given.record) == (own.microbatched, own.slices, own.record)
