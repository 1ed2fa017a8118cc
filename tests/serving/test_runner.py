"""DBORunner: the overlapped step equals the single-batch step, and every fall-back says why.

In-process tests (one rank, no DP group) cover the split itself, straddling requests and local
fall-backs; a 2-rank gloo pool covers DP+EP: both MoE schedules, both stream policies, 2 to 4
ubatches, uneven/empty ubatches, an idle rank, decode steps, a declining rank, and a rank that
fails mid-step; one test runs 4 ranks.  Equality is ``torch.equal``: on a CPU the model runs in
deterministic mode by default (batch-invariant GEMMs and attention), so the overlapped step
computes the serial step's bits.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from _model_ranks import (
    ALWAYS,
    DISPATCH_LINK,
    SMALL,
    Case,
    dispatch_per_step,
    fail_mid_step,
    serial_vs_dbo,
    tokens,
)

from asyncdbo import dbo_current_ubatch_id, run_ubatches
from asyncdbo.models import MiniConfig, MiniModel
from asyncdbo.observe import Tracer
from asyncdbo.plan import (
    AttentionMetadata,
    PlanReason,
    ThresholdConfig,
    merge_outputs,
    split_attn_metadata,
    split_tokens,
)
from asyncdbo.serving import OFF, AutoConfig, Batch, BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.testing import RankError, RankPool


# ------------------------------------------------------------------------- one process, no DP


async def _pair(cfg: RunnerConfig, steps: list[list[tuple[int, list[int]]]], model: MiniConfig = SMALL
                ) -> tuple[list, list]:
    """Run steps serially on one model and with cfg on another (separate KV caches)."""
    serial, dbo = DBORunner(MiniModel(model), cfg), DBORunner(MiniModel(model), cfg)
    builder = BatchBuilder(model.kv_cache_config)
    outs_s, outs_d = [], []
    for chunks in steps:
        batch = builder.build(chunks)
        outs_s.append(await serial.step(batch, enabled=False))
        outs_d.append(await dbo.step(batch))
    return outs_s, outs_d


@pytest.mark.asyncio
async def test_token_split_with_a_straddling_request_equals_serial() -> None:
    # 13 + 20 tokens split at 16: request 1 straddles; its tail in ubatch 1 attends over the
    # prefix ubatch 0 wrote to the KV cache in the same layer.
    steps = [[(0, list(tokens(13, 1))), (1, list(tokens(20, 2)))]]
    (s,), (d,) = await _pair(RunnerConfig(thresholds=ALWAYS), steps)
    assert d.record.microbatched and d.record.reason is PlanReason.MICROBATCHED
    first, second = d.plan.slices
    assert (first.last_is_truncated, second.first_is_continuation) == (True, True)
    assert d.record.ubatch_num_tokens == (16, 17)
    assert d.num_switches > 0
    assert torch.equal(s.logits_TV, d.logits_TV)


@pytest.mark.asyncio
async def test_last_token_logits_are_the_full_heads_rows_and_a_token_split_computes_the_serial_rows() -> None:
    # 13 + 20 + 1 tokens split at 16: request 1 straddles, so ubatch 0's last row (request 1's
    # 3rd token) is not its last token of the step and is not computed under DBO either.
    cfg = RunnerConfig(thresholds=ALWAYS)
    chunks = [(0, list(tokens(13, 1))), (1, list(tokens(20, 2))), (2, list(tokens(1, 3)))]
    runners = {name: DBORunner(MiniModel(SMALL, logits=name), cfg) for name in ("all", "last")}
    dbo_last = DBORunner(MiniModel(SMALL, logits="last"), cfg)
    batch = BatchBuilder(SMALL.kv_cache_config).build(chunks)
    full = (await runners["all"].step(batch, enabled=False)).logits_TV
    last = (await runners["last"].step(batch, enabled=False)).logits_TV
    split = await dbo_last.step(batch)
    assert split.record.microbatched and split.plan.slices[0].last_is_truncated
    rows = [12, 32, 33]  # each request's last token
    assert torch.equal(last[rows], full[rows])  # batch-invariant GEMMs: the same bits on 3 rows as on 34
    others = [t for t in range(batch.num_tokens) if t not in rows]
    assert torch.equal(last[others], torch.zeros(len(others), SMALL.vocab_size))
    assert torch.equal(split.logits_TV, last)
    with pytest.raises(ValueError, match=r"^MiniModel\(logits='first'\): use one of \('all', 'last'\)$"):
        MiniModel(SMALL, logits="first")


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["ht", "ll"])
async def test_continuations_wait_for_a_late_first_ubatch_in_every_layer(schedule: str) -> None:
    # One request over three ubatches; ubatch 0 starts late (parked on a timer, as on a late comm
    # completion), so ubatches 1 and 2 reach layer 0's attention first. They must wait for the
    # K/V of every earlier ubatch, not read an empty cache (nor only ubatch 1's part).
    builder = BatchBuilder(SMALL.kv_cache_config)
    batch = builder.build([(0, list(tokens(30, 9)))])
    cfg = replace(SMALL, schedule=schedule)
    expected_TV = await MiniModel(cfg).forward(batch.input_ids_T, batch.positions_T, batch.attn)
    model = MiniModel(cfg)
    slices = split_tokens(batch.attn.query_start_loc_cpu, 3)
    metas = split_attn_metadata(batch.attn, slices)
    order: list[int] = []

    async def ubatch(ids_T: torch.Tensor, pos_T: torch.Tensor, meta: AttentionMetadata, delay_s: float) -> torch.Tensor:
        if delay_s:
            await asyncio.sleep(delay_s)
        order.append(dbo_current_ubatch_id())
        return await model.forward(ids_T, pos_T, meta)

    args = [(batch.input_ids_T[s.token_slice], batch.positions_T[s.token_slice], m, 0.05 if k == 0 else 0.0)
            for k, (s, m) in enumerate(zip(slices, metas))]
    outs = await run_ubatches(ubatch, args, backend="host")
    assert order == [1, 2, 0]  # ubatch 0 really came last
    assert torch.equal(merge_outputs(outs, slices, 30), expected_TV)


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "stream_policy", "num_ubatches"), [("ht", "role", 3), ("ll", "ubatch", 4)])
async def test_prefill_then_decode_through_dbo_equals_serial_bit_for_bit(schedule: str, stream_policy: str,
                                                                         num_ubatches: int) -> None:
    prefill = [(r, list(tokens(7 + 5 * r, r))) for r in range(4)]
    decode = [[(r, [int(tokens(1, 100 + 10 * i + r)[0])]) for r in range(4)] for i in range(2)]
    cfg = RunnerConfig(thresholds=ALWAYS, num_ubatches=num_ubatches, stream_policy=stream_policy)  # type: ignore[arg-type]
    outs_s, outs_d = await _pair(cfg, [prefill, *decode], replace(SMALL, schedule=schedule))
    sizes = {3: [(19, 19, 20), (1, 1, 2), (1, 1, 2)], 4: [(14, 14, 14, 16), (1, 1, 1, 1), (1, 1, 1, 1)]}
    assert [d.record.ubatch_num_tokens for d in outs_d] == sizes[num_ubatches]
    for s, d in zip(outs_s, outs_d):
        assert torch.equal(s.logits_TV, d.logits_TV)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["request", "balanced"])
async def test_request_aligned_policies_equal_serial(policy: str) -> None:
    steps = [[(0, list(tokens(9, 3))), (1, list(tokens(11, 4))), (2, list(tokens(6, 5)))]]
    (s,), (d,) = await _pair(RunnerConfig(thresholds=ALWAYS, policy=policy), steps)  # type: ignore[arg-type]
    assert d.record.microbatched
    assert torch.equal(s.logits_TV, d.logits_TV)


@pytest.mark.asyncio
async def test_below_threshold_falls_back_to_one_batch_and_says_why() -> None:
    steps = [[(0, list(tokens(40, 6)))]]
    (s,), (d,) = await _pair(RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=64)), steps)
    assert not d.record.microbatched
    assert d.record.reason is PlanReason.BELOW_THRESHOLD
    assert d.record.detail == "mixed/prefill: 40 tokens < threshold 64"
    assert d.record.ubatch_num_tokens == (40,)
    assert torch.equal(s.logits_TV, d.logits_TV)


@pytest.mark.asyncio
async def test_steps_are_counted_and_traced_with_their_record() -> None:
    cfg = RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=20))
    runner = DBORunner(MiniModel(SMALL), cfg)
    builder = BatchBuilder(SMALL.kv_cache_config)
    tracer = Tracer()
    await runner.step(builder.build([(0, list(tokens(30, 7)))]), instrument=tracer)
    await runner.step(builder.build([(1, list(tokens(10, 8)))]), instrument=tracer)
    assert runner.stats.summary() == "2 steps, 50% microbatched; below_threshold=1"
    assert [(n.microbatched, n.reason, n.num_ubatches) for n in tracer.step_numbers()] == [
        (True, "microbatched", 2),
        (False, "below_threshold", 1),
    ]


def test_bad_runner_config_and_batch_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"num_ubatches \(0\) must be at least 1"):
        RunnerConfig(num_ubatches=0)
    with pytest.raises(ValueError, match=r"unknown split policy 'halves'"):
        RunnerConfig(policy="halves")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stream_policy must be 'role' or 'ubatch' \(got 'both'\)"):
        RunnerConfig(stream_policy="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^unknown dispatch 'both'; use 'auto', 'fused' or 'split'$"):
        RunnerConfig(dispatch="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown link 'carrier-pigeon'"):
        RunnerConfig(backend="host", link="carrier-pigeon").make_backend()
    with pytest.raises(ValueError, match=r"^num_ubatches \(9\) exceeds max_ubatches \(4\), the ubatches the model's MoE layers"):
        DBORunner(MiniModel(SMALL), RunnerConfig(num_ubatches=9))  # MiniModel's default max_ubatches is 4
    attn = BatchBuilder(SMALL.kv_cache_config).build([(0, [1, 2, 3])]).attn
    with pytest.raises(ValueError, match=r"input_ids \(2,\) and positions \(3,\) must both have shape \(3,\)"):
        Batch(input_ids_T=torch.zeros(2, dtype=torch.int64), positions_T=torch.arange(3), attn=attn)


# ------------------------------------------------------------------------- 2 ranks, DP + EP


def _prefill_case(**kw: object) -> Case:
    # Rank 0: 3 requests, 30 tokens; rank 1: 2 requests, 21 tokens -> both pad to 30.
    steps = (
        (((0, tokens(12, 10)), (1, tokens(11, 11)), (2, tokens(7, 12))),),
        (((0, tokens(5, 20)), (1, tokens(16, 21))),),
    )
    return Case(steps=steps, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("schedule", "stream_policy", "num_ubatches", "loop"),
    [("ht", "role", 2, "uvloop"), ("ll", "role", 4, "asyncio"), ("ht", "ubatch", 3, "asyncio"), ("ll", "ubatch", 4, "uvloop")],
)
def test_dp_ep_prefill_equals_serial(pool: RankPool, schedule: str, stream_policy: str, num_ubatches: int, loop: str) -> None:
    case = _prefill_case(
        model=replace(SMALL, schedule=schedule),
        runner=RunnerConfig(thresholds=ALWAYS, stream_policy=stream_policy, num_ubatches=num_ubatches),  # type: ignore[arg-type]
        loop=loop,
    )
    r0, r1 = pool.run(serial_vs_dbo, case)
    for r in (r0, r1):
        (rec,) = r["records"]
        assert rec.microbatched and rec.num_tokens_padded == 30
        assert r["bitwise"], r["max_abs_diff"]
    even = 30 // num_ubatches
    assert r0["records"][0].ubatch_num_tokens_padded == (even,) * (num_ubatches - 1) + (30 - even * (num_ubatches - 1),)
    assert r0["records"][0].ranks == r1["records"][0].ranks  # one vote, the same table everywhere


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_ranks_give_padding_only_ubatches_and_an_idle_rank_follows(pool: RankPool) -> None:
    # Step 0: rank 0 has 6 tokens, rank 1 has 40 -> rank 0's ubatch 1 is padding only.
    # Step 1: rank 1 is idle (no requests) -> it runs two padding-only ubatches.
    steps = (
        (((0, tokens(6, 30)),), ((1, tokens(40, 31)),)),  # rank 0: 6 tokens, then 40
        (((0, tokens(40, 32)),), ()),  # rank 1: 40 tokens, then idle
    )
    r0, r1 = pool.run(serial_vs_dbo, Case(steps=steps))
    assert r0["records"][0].ubatch_num_tokens == (6, 0)
    assert r0["records"][0].ubatch_num_tokens_padded == (20, 20)
    assert r1["records"][0].ubatch_num_tokens == (20, 20)
    assert r1["records"][1].microbatched and r1["records"][1].ubatch_num_tokens == (0, 0)
    assert r1["records"][1].ubatch_num_tokens_padded == (20, 20)
    assert r1["records"][1].detail == "idle rank(s) [1] run padding-only ubatches"
    assert r0["bitwise"] and r1["bitwise"]


def _decode_steps(rank: int, num_reqs: int = 6) -> tuple:
    prefill = tuple((r, tokens(5 + r, 40 + rank * 10 + r)) for r in range(num_reqs))
    decode = tuple(tuple((r, tokens(1, 60 + rank * 100 + i * 10 + r)) for r in range(num_reqs)) for i in range(3))
    return (prefill, *decode)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "stream_policy", "num_ubatches"), [("ht", "role", 2), ("ll", "ubatch", 3)])
def test_decode_steps_over_a_prefilled_context_equal_serial(pool: RankPool, schedule: str, stream_policy: str,
                                                            num_ubatches: int) -> None:
    case = Case(steps=(_decode_steps(0), _decode_steps(1)), model=replace(SMALL, schedule=schedule),
                runner=RunnerConfig(thresholds=ALWAYS, stream_policy=stream_policy, num_ubatches=num_ubatches))  # type: ignore[arg-type]
    r0, r1 = pool.run(serial_vs_dbo, case)
    for r in (r0, r1):
        assert [rec.ubatch_num_tokens for rec in r["records"][1:]] == [(3, 3) if num_ubatches == 2 else (2, 2, 2)] * 3
        assert r["bitwise"], r["max_abs_diff"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "num_ubatches"), [("ll", 2), ("ht", 3)])
def test_auto_dispatch_fuses_decode_and_splits_prefill_on_the_link_model_with_serial_numbers(
        pool: RankPool, schedule: str, num_ubatches: int) -> None:
    runner = RunnerConfig(thresholds=ALWAYS, backend="host", link=DISPATCH_LINK, num_ubatches=num_ubatches)  # "auto"
    case = Case(steps=(_decode_steps(0), _decode_steps(1)), model=replace(SMALL, schedule=schedule), runner=runner)
    for r in pool.run(dispatch_per_step, case):
        assert r["microbatched"] == [True] * 4
        assert r["sent"] == [["combine", "counts", "dispatch"]] + [["combine", "dispatch+counts"]] * 3
        assert r["bitwise"]  # fused DBO steps == split serial steps


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_auto_dispatch_splits_the_ht_schedule_with_two_ubatches(pool: RankPool) -> None:
    """ht sends its counts before the dispatch yield; with 2 ubatches fusing measured no gain or a
    loss (asyncdbo.dist.fused), so ``auto`` splits there whatever the link model says."""
    runner = RunnerConfig(thresholds=ALWAYS, backend="host", link=DISPATCH_LINK)  # "auto", 2 ubatches
    case = Case(steps=(_decode_steps(0), _decode_steps(1)), model=replace(SMALL, schedule="ht"), runner=runner)
    for r in pool.run(dispatch_per_step, case):
        assert r["microbatched"] == [True] * 4
        assert r["sent"] == [["combine", "counts", "dispatch"]] * 4 and r["bitwise"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_split_dispatch_never_fuses(pool: RankPool) -> None:
    runner = RunnerConfig(thresholds=ALWAYS, backend="host", link=DISPATCH_LINK, dispatch="split")
    for r in pool.run(dispatch_per_step, Case(steps=(_decode_steps(0), _decode_steps(1)), runner=runner)):
        assert r["sent"] == [["combine", "counts", "dispatch"]] * 4 and r["bitwise"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_auto_tunings_off_dispatches_as_a_fixed_runners_off_step(pool: RankPool) -> None:
    """``tuning="auto"``'s off is the off it is compared with: a step it runs unsplit takes
    ``RunnerConfig.dispatch`` ("auto": fused where the link model prices one message below two),
    as a fixed runner's unsplit step does, not the split dispatch (one more message per MoE layer)."""
    pin = AutoConfig(ubatch_counts=(2,), pin=(("mixed 32-63", OFF), ("decode 4-7", OFF)))
    runner = RunnerConfig(tuning="auto", auto=pin, backend="host", link=DISPATCH_LINK)  # dispatch "auto"
    case = Case(steps=(_decode_steps(0), _decode_steps(1)), model=replace(SMALL, schedule="ll"), runner=runner)
    for r in pool.run(dispatch_per_step, case):
        assert r["microbatched"] == [False] * 4
        assert r["sent"] == [["combine", "counts", "dispatch"]] + [["combine", "dispatch+counts"]] * 3
        assert r["bitwise"]  # fused off steps == split serial steps


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_a_dp_group_every_dispatch_mode_splits_where_ranks_carry_different_tokens(pool: RankPool) -> None:
    """A fused buffer is sized from the DP vote every rank shares; with no ``dp_group`` there is
    none, so the runner splits in every mode (RunnerConfig). EP spans both ranks, each plans alone,
    and they carry different token counts: a buffer sized from a rank's own tokens would not match
    its peer's. (``tuning="auto"`` refuses EP peers outside its vote, tests/serving/test_auto.py;
    its split rule without a vote is checked on one rank there.)"""
    runner = RunnerConfig(thresholds=ALWAYS, backend="host", dispatch="fused")
    steps = ((((0, tokens(40, 70)),), ((1, tokens(36, 71)),)),  # rank 0: 40 tokens, then 36
             (((0, tokens(50, 72)),), ((1, tokens(60, 73)),)))  # rank 1: 50, then 60
    for r in pool.run(dispatch_per_step, Case(steps=steps, runner=runner), False, timeout_s=60.0):
        # both runners: safe here only because thresholds 0 split every step alike on both ranks
        assert r["warned"] == [("DeprecationWarning", (
            "DBORunner with an EP group of 2 ranks [0, 1] needs dp_group: without it each rank plans from its "
            "own batch, and EP peers that choose different ubatch counts issue different all-to-alls; pass "
            "dp_group= a group holding every EP rank (e.g. the EP group itself); this will raise ValueError in "
            "the next release"))] * 2
        assert r["microbatched"] == [True, True]
        assert r["sent"] == [["combine", "counts", "dispatch"]] * 2
        assert r["bitwise"]  # DBO steps == serial steps


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_four_ranks_prefill_and_decode_equal_serial_bit_for_bit(pool4: RankPool) -> None:
    """DP = EP = 4: one expert per rank, prefill then decode, low-latency schedule, per-ubatch
    streams, 4 ubatches."""
    case = Case(steps=tuple(_decode_steps(rank, 8) for rank in range(4)), model=replace(SMALL, schedule="ll"),
                runner=RunnerConfig(thresholds=ALWAYS, stream_policy="ubatch", num_ubatches=4))
    results = pool4.run(serial_vs_dbo, case, timeout_s=120.0)
    for r in results:
        assert all(rec.microbatched for rec in r["records"])
        assert r["bitwise"], r["max_abs_diff"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_declining_rank_makes_every_rank_fall_back_with_the_reason(pool: RankPool) -> None:
    case = _prefill_case(disabled_ranks=(0,))
    r0, r1 = pool.run(serial_vs_dbo, case)
    for r in (r0, r1):
        (rec,) = r["records"]
        assert not rec.microbatched
        assert rec.reason is PlanReason.RANK_DECLINED
        assert rec.detail == "rank 0: disabled"
        assert r["bitwise"]
    assert r1["stats"] == "1 steps, 0% microbatched; rank_declined=1"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_that_fails_mid_step_fails_the_group_in_bounded_time_naming_it(pool: RankPool) -> None:
    # Runs last: a failure closes the pool (ranks may be stuck half-way through a collective).
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] failed during fail_mid_step") as info:
        pool.run(fail_mid_step, timeout_s=30.0)
    assert "RuntimeError: rank 1 lost its expert weights" in info.value.details[1]
