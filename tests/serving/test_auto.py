"""The "auto" tuning (issue 26, item 2): per step-shape bucket it runs the configuration its
measurements favour, explores a bounded schedule from the fixed rule's prior, does not flap
under noise, falls back to off where DBO loses, says why in every record, and every DP rank
runs the same configuration. Step times come from an injected clock: no test reads wall time."""

from __future__ import annotations

import dataclasses
import random

import pytest
from _auto_ranks import CACHE, ClockedModel, agree, decode_batches

from asyncdbo.lowlevel import VirtualClock
from asyncdbo.plan import PlanReason, ThresholdConfig
from asyncdbo.serving import OFF, Arm, AutoConfig, AutoPolicy, BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.testing import RankPool

N2, N3, N4 = Arm(2), Arm(3), Arm(4)
SMALL_SPACE = AutoConfig(splits=("token",), dispatches=("auto",))  # off, N = 2, 3, 4


def _drive(policy: AutoPolicy, cost: dict[Arm, float], steps: int, *, jitter: float, seed: int,
           bucket: str = "decode 64-127") -> list[Arm]:
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        arm, _ = policy.choose(bucket)
        chosen.append(arm)
        policy.observe(bucket, arm, cost[arm] * 1e-6 * (1 + rng.uniform(-jitter, jitter)))  # us per token
    return chosen


def test_explores_the_schedule_from_the_prior_then_runs_the_fastest() -> None:
    policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
    cost = {OFF: 1.0, N2: 0.9, N3: 0.8, N4: 0.85}
    chosen = _drive(policy, cost, 40, jitter=0.0, seed=0)
    # prior first, then off, then the other counts: warmup + samples = 4 steps each
    assert chosen[:16] == [N2] * 4 + [OFF] * 4 + [N3] * 4 + [N4] * 4
    assert chosen[16:] == [N3] * 24
    arm, why = policy.choose("decode 64-127")
    assert arm == N3
    assert why == "decode 64-127: best N=3 token auto 0.80 us/token (8); N=2 token auto 0.90 (3); off 1.00 (3); N=4 token auto 0.85 (3)"


def test_noise_below_the_margin_never_flips_the_choice() -> None:
    # N = 2 and N = 3 within 1%, every sample +-2%: whichever wins the exploration stays
    cost = {OFF: 1.0, N2: 0.80, N3: 0.792, N4: 0.9}
    for seed in range(20):
        policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
        chosen = _drive(policy, cost, 200, jitter=0.02, seed=seed)
        tail = chosen[16:]
        assert len(set(tail)) == 1 and tail[0] in (N2, N3), (seed, set(tail))
        assert policy.buckets["decode 64-127"].switches <= 1


def test_falls_back_to_off_where_dbo_loses_and_says_why() -> None:
    policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
    chosen = _drive(policy, {OFF: 1.0, N2: 1.2, N3: 1.3, N4: 1.4}, 30, jitter=0.01, seed=3)
    assert chosen[16:] == [OFF] * 14
    arm, why = policy.choose("decode 64-127")
    assert arm == OFF and why.startswith("decode 64-127: best off ")


def test_a_prior_of_off_still_tries_dbo_and_takes_it_where_it_wins() -> None:
    policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: OFF)
    chosen = _drive(policy, {OFF: 1.0, N2: 0.7, N3: 0.75, N4: 0.8}, 24, jitter=0.0, seed=0)
    assert chosen[:8] == [OFF] * 4 + [N2] * 4 and chosen[16:] == [N2] * 8


def test_climbing_skips_what_cannot_win_and_climb_false_tries_everything() -> None:
    losing = {OFF: 1.0, N2: 1.2, N3: 1.3, N4: 1.4}
    # N = 2 lost to off: N = 3 and 4 are not tried (N = k only while N = k - 1 leads)
    assert _drive(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), losing, 16, jitter=0.0, seed=0) == [N2] * 4 + [OFF] * 12
    flat = dataclasses.replace(SMALL_SPACE, climb=False)
    assert _drive(AutoPolicy(flat, prior=lambda b: N2), losing, 20, jitter=0.0, seed=0) == (
        [N2] * 4 + [OFF] * 4 + [N3] * 4 + [N4] * 4 + [OFF] * 4)
    # what climbing gives up: N = 4 would win here, but N = 3 lost to N = 2, so N = 4 is never tried
    dip = {OFF: 1.0, N2: 0.8, N3: 0.9, N4: 0.7}
    assert _drive(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), dip, 20, jitter=0.0, seed=0) == (
        [N2] * 4 + [OFF] * 4 + [N3] * 4 + [N2] * 8)
    # the other splits are tried only where DBO leads off
    both = AutoConfig(ubatch_counts=(2,), splits=("token", "balanced"), dispatches=("auto",))
    bal = Arm(2, "balanced")
    assert _drive(AutoPolicy(both, prior=lambda b: N2), {OFF: 1.0, N2: 1.1, bal: 0.5}, 12, jitter=0.0, seed=0) == (
        [N2] * 4 + [OFF] * 8)
    assert _drive(AutoPolicy(both, prior=lambda b: N2), {OFF: 1.0, N2: 0.9, bal: 0.5}, 16, jitter=0.0, seed=0) == (
        [N2] * 4 + [OFF] * 4 + [bal] * 8)


def test_the_same_measurements_give_the_same_choices() -> None:
    cost = {OFF: 1.0, N2: 0.82, N3: 0.8, N4: 0.81}
    runs = [_drive(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), cost, 60, jitter=0.03, seed=7) for _ in range(2)]
    assert runs[0] == runs[1]


def test_exploration_is_bounded_and_pins_override() -> None:
    cfg = AutoConfig(max_arms=2, samples=2, warmup=0, pin=(("mixed 512-1023", OFF),))
    policy = AutoPolicy(cfg, prior=lambda bucket: Arm(2))
    assert len(policy.bucket("decode 64-127").schedule) == 3
    chosen = _drive(policy, {a: 1.0 for a in cfg.arms()}, 20, jitter=0.0, seed=0)
    assert len(set(chosen[6:])) == 1  # 3 arms x 2 samples, then one configuration
    assert policy.choose("mixed 512-1023") == (OFF, "mixed 512-1023: pinned by AutoConfig.pin")


def test_bad_auto_configs_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"ubatch_counts \(1, 2\) must be ubatch counts >= 2"):
        AutoConfig(ubatch_counts=(1, 2))
    with pytest.raises(ValueError, match=r"splits \('tokens',\): use some of"):
        AutoConfig(splits=("tokens",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"margin \(1.5\) must lie in \[0, 1\)"):
        AutoConfig(margin=1.5)
    with pytest.raises(ValueError, match="unknown tuning 'on'; use 'fixed' or 'auto'"):
        RunnerConfig(tuning="on")  # type: ignore[arg-type]


# ------------------------------------------------------------------- the runner, one process


@pytest.mark.asyncio
async def test_runner_converges_to_what_its_steps_measured_and_records_the_evidence() -> None:
    clock = VirtualClock()
    model = ClockedModel(clock, {1: 1.0e-3, 2: 0.9e-3, 3: 0.7e-3, 4: 0.8e-3}, jitter=0.02, seed=1)
    cfg = RunnerConfig(tuning="auto", auto=SMALL_SPACE, thresholds=ThresholdConfig(decode_threshold=32))
    runner = DBORunner(model, cfg, clock=clock)
    records = []
    for batch in decode_batches(BatchBuilder(CACHE), [64 + i % 40 for i in range(24)]):
        records.append((await runner.step(batch)).record)
    assert [r.config for r in records[:16:4]] == ["N=2 token auto", "off", "N=3 token auto", "N=4 token auto"]
    last = records[-1]
    assert last.config == "N=3 token auto" and last.microbatched and len(last.ubatch_num_tokens) == 3
    assert last.evidence.startswith("decode 64-127: best N=3 token auto 70")
    off = records[4]
    assert off.reason is PlanReason.AUTO_OFF and off.detail.startswith("decode 64-127: exploring 2/4")
    assert runner.report().startswith("24 steps: N=3 token auto 12 steps")
    assert runner.report().endswith("fell out: auto_off=4")


@pytest.mark.asyncio
async def test_runner_turns_dbo_off_where_it_loses_and_a_caller_can_still_force_off() -> None:
    clock = VirtualClock()
    model = ClockedModel(clock, {1: 1.0e-3, 2: 1.3e-3, 3: 1.4e-3, 4: 1.5e-3}, jitter=0.02, seed=2)
    runner = DBORunner(model, RunnerConfig(tuning="auto", auto=SMALL_SPACE,
                                           thresholds=ThresholdConfig(decode_threshold=32)), clock=clock)
    batches = decode_batches(BatchBuilder(CACHE), [64] * 21)
    records = [(await runner.step(b)).record for b in batches[:20]]
    assert {r.config for r in records[16:]} == {"off"}
    assert all(r.reason is PlanReason.AUTO_OFF and "best off" in r.detail for r in records[16:])
    forced = (await runner.step(batches[20], enabled=False)).record
    assert forced.config == "off" and forced.reason is PlanReason.DISABLED


def test_auto_refuses_a_model_built_for_fewer_ubatches() -> None:
    class Two(ClockedModel):
        max_ubatches = 2

    with pytest.raises(ValueError, match=r"tuning='auto' may run 4 ubatches .* max_ubatches=2"):
        DBORunner(Two(VirtualClock(), {}), RunnerConfig(tuning="auto"))


# ------------------------------------------------------------------- DP ranks agree


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_dp_rank_runs_the_same_configuration_every_step(pool: RankPool) -> None:
    r0, r1 = pool.run(agree, 40, timeout_s=150.0)
    assert [r.config for r in r0["records"]] == [r.config for r in r1["records"]]
    assert [r.evidence for r in r0["records"]] == [r.evidence for r in r1["records"]]
    # the group's slowest rank (rank 1: N = 3 costs it 5% more) still favours N = 3
    assert r0["records"][-1].config == "N=3 token auto"
