"""The "auto" tuning (issue 26, item 2): per step-shape bucket it runs the configuration its
measurements favour, explores a bounded schedule from the fixed rule's prior, does not flap
under noise, falls back to off where DBO loses, says why in every record, and every DP rank
runs the same configuration. Step times come from an injected clock: no test reads wall time."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import statistics
from typing import Any

import pytest
import torch
from _auto_ranks import CACHE, ClockedModel, agree, auto_groups, decode_batches, mismatched

from asyncdbo.dist import DispatchOptions, current_dispatch_options
from asyncdbo.lowlevel import VirtualClock
from asyncdbo.plan import PlanReason, ThresholdConfig
from asyncdbo.serving import OFF, Arm, AutoConfig, AutoPolicy, BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.serving.auto import Comparison, compare, compare_paired, decisive
from asyncdbo.testing import RankPool

N2, N3, N4 = Arm(2), Arm(3), Arm(4)
SMALL_SPACE = AutoConfig(splits=("token",), dispatches=("auto",))  # off, N = 2, 3, 4


def _drive(policy: AutoPolicy, cost: dict[Arm, float], steps: int, *, jitter: float, seed: int,
           bucket: str = "decode 64-127") -> list[Arm]:
    return [arm for arm, _ in _drive_why(policy, cost, steps, jitter=jitter, seed=seed, bucket=bucket)]


def _drive_why(policy: AutoPolicy, cost: dict[Arm, float], steps: int, *, jitter: float, seed: int,
               bucket: str = "decode 64-127") -> list[tuple[Arm, str]]:
    """``steps`` steps of ``bucket``: each costs ``cost[arm]`` us per token times a factor drawn
    uniformly from [1 - jitter, 1 + jitter] (the injected clock); the choices and their reasons."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        arm, why = policy.choose(bucket)
        out.append((arm, why))
        policy.observe(bucket, arm, cost[arm] * 1e-6 * (1 + rng.uniform(-jitter, jitter)))  # us per token
    return out


def _trial(incumbent: Arm, trial: Arm, pairs: int = 3, warmup: int = 1) -> list[Arm]:
    """One comparison's steps: the trial's warm-up, then trial and incumbent alternately."""
    return [trial] * warmup + [trial, incumbent] * pairs


def _explored(chosen: list[tuple[Arm, str]]) -> int:
    """Steps up to and including the last one that was still exploring."""
    return max((i + 1 for i, (_, why) in enumerate(chosen) if ": exploring " in why), default=0)


def test_explores_the_schedule_from_the_prior_then_runs_the_fastest() -> None:
    policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
    cost = {OFF: 1.0, N2: 0.9, N3: 0.8, N4: 0.85}
    chosen = _drive(policy, cost, 40, jitter=0.0, seed=0)
    # the prior's warm-up, then off, then the other counts, each trial's warm-up and then trial and
    # incumbent alternately, 3 pairs (no noise: every comparison separates at its first 3 pairs)
    assert chosen[:22] == [N2] + _trial(N2, OFF) + _trial(N2, N3) + _trial(N3, N4)
    assert chosen[22:] == [N3] * 18
    arm, why = policy.choose("decode 64-127")
    assert arm == N3
    assert why == ("decode 64-127: best N=3 token auto 0.80±0.00 us/token (8); "
                   "N=2 token auto 0.90±0.00 (3, slower vs N=3 token auto 0.80±0.00 (3), ratio 1.125); "
                   "off 1.00±0.00 (3, slower vs N=2 token auto 0.90±0.00 (3), ratio 1.111); "
                   "N=4 token auto 0.85±0.00 (3, slower vs N=3 token auto 0.80±0.00 (3), ratio 1.062)")


def test_compare_separates_medians_by_the_margin_and_their_standard_errors() -> None:
    # default: median 1.0, IQR 0.1 (inclusive quartiles 0.95, 1.05), relative sigma 0.1 / 1.349;
    # other: median 0.65, a smaller relative sigma: the larger one applies to both sides. With 3 + 3
    # samples (4 degrees of freedom) the 2.5 standard errors become t = 2.5 + (2.5**3 + 2.5) / 16
    sigma, t = 0.1 / 1.349, 2.5 + (2.5**3 + 2.5) / 16
    se = 1.2533 * sigma * math.sqrt(1 / 3 + 1 / 3)
    c = compare([1.0, 1.1, 0.9], [0.6, 0.65, 0.7], margin=0.03, separation=2.5)
    assert (c.outcome, c.slower) == ("other", "default")
    assert c.gain == pytest.approx(0.35) and c.se == pytest.approx(se) and 0.35 > t * se
    # a gain of 0.25 clears 2.5 normal standard errors but not t of them: not separated yet
    assert 2.5 * se < 0.25 < t * se
    assert compare([1.0, 1.1, 0.9], [0.7, 0.75, 0.8], margin=0.03, separation=2.5).outcome is None
    # an early look of a test that may go on to 6 samples each needs more: t se x (2/3) / sqrt(1/3)
    early = compare([1.0, 1.1, 0.9], [0.6, 0.65, 0.7], margin=0.03, separation=2.5, final_n=6)
    assert early.outcome is None and 0.35 < t * 1.2533 * sigma * (2 / 3) / math.sqrt(1 / 3)
    # the bucket's pooled noise, where larger than the two sides' own, widens the bar too
    assert compare([1.0, 1.1, 0.9], [0.6, 0.65, 0.7], margin=0.03, separation=2.5, noise=0.2).outcome is None
    # the other cannot be faster by the margin even at gain + 2.5 se: the default wins, the other is slower
    ruled_out = compare([1.0, 1.01, 0.99], [1.05, 1.06, 1.04], margin=0.03, separation=2.5)
    assert (ruled_out.outcome, ruled_out.slower) == ("default", "other")
    # faster by less than the margin, without noise: the default wins, and neither is "slower"
    assert compare([1.0] * 3, [0.99] * 3, margin=0.03, separation=2.5) == Comparison(
        "default", pytest.approx(0.01), 0.0, None)
    # one outlier step moves neither the median nor the spread (IQR, not the range)
    assert compare([1.0, 1.0, 1.0, 1.0, 9.0], [0.8] * 5, margin=0.03, separation=2.5).outcome == "other"


def test_compare_paired_takes_the_ratios_of_the_pairs_so_a_common_load_cancels() -> None:
    # the load moves between pairs (1.0, 1.3, 1.1), the trial is 10% faster inside every pair: the
    # ratios are all 0.9, no spread, separated at the first look
    default, other = [1.0, 1.3, 1.1], [0.9, 1.17, 0.99]
    c = compare_paired(default, other, margin=0.03, separation=2.0, final_n=6)
    assert (c.outcome, c.slower) == ("other", "default") and c.gain == pytest.approx(0.1) and c.se == pytest.approx(0.0)
    # the same samples compared as two unpaired groups do not separate: the load's spread is in both
    assert compare(default, other, margin=0.03, separation=2.0, final_n=6).outcome is None
    # ratios 0.85, 0.95, 1.05 (median 0.95, IQR 0.1): se = 1.2533 * (0.1 / 1.349 / 0.95) * 0.95 / sqrt(3);
    # t for 2 degrees of freedom is 2 + (8 + 2) / 8; gain + t * se clears the margin, so not ruled out
    noisy = compare_paired([1.0, 1.0, 1.0], [0.85, 0.95, 1.05], margin=0.03, separation=2.0, final_n=6)
    assert noisy.outcome is None and noisy.gain == pytest.approx(0.05)
    assert noisy.se == pytest.approx(1.2533 * 0.1 / 1.349 / math.sqrt(3))
    # a trial clearly slower in every pair is ruled out and called slower
    assert compare_paired([1.0, 1.3, 1.1], [1.2, 1.56, 1.32], margin=0.03, separation=2.0, final_n=6) == Comparison(
        "default", pytest.approx(-0.2), pytest.approx(0.0), "other")


def test_noisy_samples_converge_to_what_the_measurements_favour_within_the_bound() -> None:
    # +-10% per step, N = 3 is 25% faster than N = 2
    cfg = SMALL_SPACE
    bound = cfg.warmup + cfg.max_arms * (cfg.warmup + 2 * cfg.max_samples)
    cost = {OFF: 1.0, N2: 0.8, N3: 0.6, N4: 0.75}
    for seed in range(20):
        policy = AutoPolicy(cfg, prior=lambda bucket: N2)
        chosen = _drive_why(policy, cost, 120, jitter=0.10, seed=seed)
        explored = _explored(chosen)
        assert explored <= bound, (seed, explored)
        assert {arm for arm, _ in chosen[explored:]} == {N3}, seed


def test_noise_below_the_margin_never_flips_the_choice() -> None:
    # N = 2 and N = 3 within 1%, every sample +-2%: whichever wins the exploration stays
    cost = {OFF: 1.0, N2: 0.80, N3: 0.792, N4: 0.9}
    for seed in range(20):
        policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
        chosen = _drive_why(policy, cost, 200, jitter=0.02, seed=seed)
        tail = {arm for arm, _ in chosen[_explored(chosen):]}
        assert tail == {N2}, (seed, tail)  # a near-tie goes to the incumbent
        assert policy.buckets["decode 64-127"].switches == 0


def test_dbo_that_loses_to_off_by_less_than_the_noise_falls_back_to_off_and_says_why() -> None:
    # ib400 decode-small: every DBO configuration 5% slower than off, each step +-10% (a sigma of
    # 5.8%). Over 20 seeds the noise-aware comparison of pairs ends off in all 20 (in 19 when it
    # compared back-to-back blocks); a 3-pair median comparison with the 3% margin alone
    # (separation=0) keeps a DBO configuration in 4 (it has two chances: N = 3 is tried after N = 2 lost)
    cost = {OFF: 1.0, N2: 1.05, N3: 1.05, N4: 1.05}
    finals, naive_finals = [], []
    for seed in range(20):
        policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
        chosen = _drive_why(policy, cost, 150, jitter=0.10, seed=seed)
        explored = _explored(chosen)
        assert explored <= 40 and len({arm for arm, _ in chosen[explored:]}) == 1, seed  # no flapping after
        finals.append(chosen[-1][0])
        if chosen[-1][0] == OFF:
            last_policy = policy
        naive = AutoPolicy(dataclasses.replace(SMALL_SPACE, separation=0.0, max_samples=3), prior=lambda bucket: N2)
        naive_finals.append(_drive(naive, cost, 150, jitter=0.10, seed=seed)[-1])
    assert finals.count(OFF) == 20 and naive_finals.count(OFF) == 16
    arm, why = last_policy.choose("decode 64-127")
    assert arm == OFF and re.fullmatch(r"decode 64-127: best off \d\.\d\d±\d\.\d\d us/token \(\d\); "
                                       r"N=2 token auto \d\.\d\d±\d\.\d\d \(\d, (tie|slower) vs off "
                                       r"\d\.\d\d±\d\.\d\d \(\d\), ratio \d\.\d\d\d\).*", why), why


def test_falls_back_to_off_where_dbo_loses_and_says_why() -> None:
    policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: N2)
    chosen = _drive(policy, {OFF: 1.0, N2: 1.2, N3: 1.3, N4: 1.4}, 30, jitter=0.01, seed=3)
    # N = 2 clearly slower: N = 3 is still tried (step_over=1), also clearly slower: N = 4 is not
    assert chosen == [N2] + _trial(N2, OFF) + _trial(OFF, N3) + [OFF] * 15
    arm, why = policy.choose("decode 64-127")
    assert arm == OFF and re.fullmatch(r"decode 64-127: best off 1\.0\d±0\.0\d us/token \(8\); N=2 token auto "
                                       r"1\.2\d±0\.0\d \(3, slower vs off 1\.0\d±0\.0\d \(3\), ratio 1\.\d\d\d\); "
                                       r"N=3 token auto 1\.3\d±0\.0\d \(3, slower vs off 1\.0\d±0\.0\d \(3\), ratio 1\.\d\d\d\)",
                                       why), why


def test_a_prior_of_off_still_tries_dbo_and_takes_it_where_it_wins() -> None:
    policy = AutoPolicy(SMALL_SPACE, prior=lambda bucket: OFF)
    chosen = _drive(policy, {OFF: 1.0, N2: 0.7, N3: 0.75, N4: 0.8}, 24, jitter=0.0, seed=0)
    assert chosen == [OFF] + _trial(OFF, N2) + _trial(N2, N3) + [N2] * 9


def test_a_comparison_that_does_not_separate_asks_for_more_pairs() -> None:
    # off (the prior) then N = 2, the pairs' ratios 0.86-1.07 (median 0.96): after 3 pairs they overlap, so
    # the trial and off alternate on, a pair at a time, up to max_samples pairs
    cfg = AutoConfig(ubatch_counts=(2,), splits=("token",), dispatches=("auto",), max_samples=5)
    us = {OFF: iter([0.0, 1.0, 1.1, 0.9, 1.05, 0.95]), N2: iter([0.0, 0.86, 1.06, 0.96, 0.91, 1.01])}  # warm-up first
    policy = AutoPolicy(cfg, prior=lambda bucket: OFF)
    steps = []
    for _ in range(12):
        arm, why = policy.choose("b")
        steps.append((arm, why.split("; ")[0]))
        policy.observe("b", arm, next(us[arm]) * 1e-6)
    assert steps == [
        (OFF, "b: exploring 1/2 (warm-up 1/1 of off)"), (N2, "b: exploring 2/2 (warm-up 1/1 of N=2 token auto)"),
        (N2, "b: exploring 2/2 (sample 1/5 of N=2 token auto)"),
        (OFF, "b: exploring 2/2 (sample 1/5 of off, paired with N=2 token auto)"),
        (N2, "b: exploring 2/2 (sample 2/5 of N=2 token auto)"),
        (OFF, "b: exploring 2/2 (sample 2/5 of off, paired with N=2 token auto)"),
        (N2, "b: exploring 2/2 (sample 3/5 of N=2 token auto)"),
        (OFF, "b: exploring 2/2 (sample 3/5 of off, paired with N=2 token auto)"),
        (N2, "b: exploring 2/2 (not separated yet: sample 4/5 of N=2 token auto)"),
        (OFF, "b: exploring 2/2 (not separated yet: sample 4/5 of off, paired with N=2 token auto)"),
        (N2, "b: exploring 2/2 (not separated yet: sample 5/5 of N=2 token auto)"),
        (OFF, "b: exploring 2/2 (not separated yet: sample 5/5 of off, paired with N=2 token auto)"),
    ]
    # after 5 pairs still a 4% gain within the ratios' spread: a tie, and ties go to off
    b = policy.buckets["b"]
    assert b.incumbent == OFF and b.verdicts == {N2: "tie"} and policy.choose("b") == (
        OFF, "b: best off 1.00±0.05 us/token (5); N=2 token auto 0.96±0.05 (5, tie vs off 1.00±0.05 (5), ratio 0.964)")


def test_a_load_step_between_two_configurations_does_not_flip_the_choice() -> None:
    # N = 2 (the prior) and N = 3 cost the same, off 1.5x; at some step the machine turns 25%
    # slower or faster (another job starts or ends). Run back to back, as the blocks of the earlier
    # schedule did, N = 2's samples before the step and N = 3's after it differ by 20%: that
    # separates, and a load drop would have flipped the choice to N = 3
    space = AutoConfig(ubatch_counts=(2, 3), splits=("token",), dispatches=("auto",))
    before, after = [1.25, 1.2625, 1.2375], [1.0, 1.01, 0.99]
    blocks = compare(before, after, margin=space.margin, separation=space.separation, final_n=space.max_samples)
    assert blocks.outcome == "other" and blocks.gain == pytest.approx(0.2)
    # interleaved and compared pair by pair, a step wherever it falls (inside a pair at most once)
    # moves both sides: the prior keeps the bucket, N = 3 ties and off is slower
    cost = {OFF: 1.5, N2: 1.0, N3: 1.0}
    for load_before, load_after in ((1.25, 1.0), (1.0, 1.25)):
        for step in range(24):
            policy = AutoPolicy(space, prior=lambda bucket: N2)
            for i in range(30):
                arm, _ = policy.choose("b")
                load = load_before if i < step else load_after
                policy.observe("b", arm, cost[arm] * load * (1 + 0.01 * (i % 3 - 1)) * 1e-6)
            b = policy.buckets["b"]
            assert (b.incumbent, b.switches, b.verdicts) == (N2, 0, {OFF: "slower", N3: "tie"}), (load_before, step)


def test_climbing_does_not_stop_after_a_loss_within_the_noise() -> None:
    # ib400 prefill-heavy: N = 2 token within the noise of off, N = 2 balanced 35% faster
    space = AutoConfig(ubatch_counts=(2,), splits=("token", "balanced"), dispatches=("auto",))
    bal = Arm(2, "balanced")
    for seed in range(10):
        policy = AutoPolicy(space, prior=lambda b: N2)
        chosen = _drive_why(policy, {OFF: 1.0, N2: 0.97, bal: 0.65}, 80, jitter=0.15, seed=seed)
        assert {arm for arm, _ in chosen[_explored(chosen):]} == {bal}, seed


def test_climbing_skips_what_cannot_win_and_climb_false_tries_everything() -> None:
    losing = {OFF: 1.0, N2: 1.2, N3: 1.3, N4: 1.4}
    # N = 2 clearly slower than off: N = 3 is tried once more (step_over=1), N = 4 is not (N = k only
    # where N = k - 1 leads or tied, or off leads and no more than step_over smaller counts lost)
    assert _drive(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), losing, 23, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + _trial(OFF, N3) + [OFF] * 8)
    assert _drive(AutoPolicy(dataclasses.replace(SMALL_SPACE, step_over=0), prior=lambda b: N2), losing, 16,
                  jitter=0.0, seed=0) == [N2] + _trial(N2, OFF) + [OFF] * 8
    flat = dataclasses.replace(SMALL_SPACE, climb=False)
    assert _drive(AutoPolicy(flat, prior=lambda b: N2), losing, 26, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + _trial(OFF, N3) + _trial(OFF, N4) + [OFF] * 4)
    # what climbing gives up: N = 4 would win here, but N = 3 was clearly slower than N = 2 (a loss
    # after DBO led off ends the climb: step_over applies only while off leads)
    dip = {OFF: 1.0, N2: 0.8, N3: 0.9, N4: 0.7}
    assert _drive(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), dip, 20, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + _trial(N2, N3) + [N2] * 5)
    # the other splits are tried only where DBO leads off or tied with it
    both = AutoConfig(ubatch_counts=(2,), splits=("token", "balanced"), dispatches=("auto",))
    bal = Arm(2, "balanced")
    assert _drive(AutoPolicy(both, prior=lambda b: N2), {OFF: 1.0, N2: 1.1, bal: 0.5}, 12, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + [OFF] * 4)
    # (balanced's every pair 0.556 of N = 2's, beyond 1 / (1 + decisive): decided at its second pair)
    assert _drive(AutoPolicy(both, prior=lambda b: N2), {OFF: 1.0, N2: 0.9, bal: 0.5}, 18, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + _trial(N2, bal, pairs=2) + [bal] * 5)


def test_prune_skips_the_base_variants_where_the_base_measured_far_behind_the_incumbent() -> None:
    # the default space: off, N = 2, 3, 4 token auto, N = 2 balanced auto, N = 2 token split
    space = AutoConfig()
    bal, spl = Arm(2, "balanced"), Arm(2, "token", "split")
    cost = {OFF: 1.0, N2: 0.85, N3: 0.7, N4: 0.75, bal: 0.9, spl: 0.9}
    climb = [N2] + _trial(N2, OFF) + _trial(N2, N3) + _trial(N3, N4)
    policy = AutoPolicy(space, prior=lambda b: N2)
    assert _drive(policy, cost, 30, jitter=0.0, seed=0) == climb + [N3] * 8
    arm, why = policy.choose("decode 64-127")
    assert arm == N3
    assert why.endswith("; N=2 balanced auto skipped (N=2 token auto measured 1.214x N=3 token auto, above 1 + prune 0.15)"
                        "; N=2 token split skipped (N=2 token auto measured 1.214x N=3 token auto, above 1 + prune 0.15)")
    # prune=None (and climb=False) try them: 14 more exploring steps, the same final choice
    for off_value in (dataclasses.replace(space, prune=None), dataclasses.replace(space, climb=False)):
        assert _drive(AutoPolicy(off_value, prior=lambda b: N2), cost, 44, jitter=0.0, seed=0) == (
            climb + _trial(N3, bal) + _trial(N3, spl) + [N3] * 8)
    # the ratio multiplies along the chain of comparisons: N = 2 tied off (1.0), off lost to N = 3 (1.429)
    chain = {**cost, N2: 1.0}
    policy = AutoPolicy(space, prior=lambda b: N2)
    assert _drive(policy, chain, 30, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + _trial(OFF, N3) + _trial(N3, N4) + [N3] * 8)
    assert "N=2 token split skipped (N=2 token auto measured 1.429x N=3 token auto" in policy.choose("decode 64-127")[1]
    # the base within 1 + prune of the incumbent (N = 3 6% faster): the variants are still tried
    close = {**cost, N2: 0.75, N4: 0.8}
    assert _drive(AutoPolicy(space, prior=lambda b: N2), close, 44, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + _trial(N2, N3) + _trial(N3, N4) + _trial(N3, bal) + _trial(N3, spl) + [N3] * 8)


def _patterned(cfg: AutoConfig, cost: dict[Arm, float], steps: int, prior: Arm = N2) -> tuple[list[Arm], AutoPolicy]:
    """``steps`` steps of one bucket from ``prior``, step i costing ``cost[arm]`` times
    1 + 0.1 * ((7 i mod 5) - 2) / 2 (a fixed +-10% pattern, no draw); the choices and the policy."""
    policy, out = AutoPolicy(cfg, prior=lambda b: prior), []
    for i in range(steps):
        arm, _ = policy.choose("b")
        out.append(arm)
        policy.observe("b", arm, cost[arm] * (1 + 0.1 * ((i * 7) % 5 - 2) / 2) * 1e-6)
    return out, policy


def test_pairs_that_all_put_one_side_far_behind_decide_at_the_second_pair() -> None:
    # mixed-arrivals' 256-511-token steps (benchmarks/results/auto_measured_cpu-2c_2026-12-03_run11.md):
    # the fixed thresholds' prior is off, which runs 2.8 times as long as N = 2 per token. Every pair
    # of N = 2's first two is below 1 / (1 + decisive): N = 2 wins there, and off runs 2 paired steps
    # after its warm-up, not 3. N = 3 (0.70 of N = 2) and N = 4 (0.87 of N = 3) are within the gap
    # in some pair and go the statistical way (5 and 6 pairs under this +-10% pattern).
    space = AutoConfig(splits=("token",), dispatches=("auto",))
    far = {OFF: 4.6, N2: 1.65, N3: 1.15, N4: 1.0}
    chosen, policy = _patterned(space, far, 30, prior=OFF)
    assert chosen == [OFF] + _trial(OFF, N2, pairs=2) + _trial(N2, N3, pairs=5) + _trial(N3, N4, pairs=6)
    b = policy.buckets["b"]
    assert b.incumbent == N4 and b.verdicts == {OFF: "slower", N2: "slower", N3: "slower"}
    # off's pairs: steps 3 and 5 (factors 0.95, 0.9) after N = 2's steps 2 and 4 (1.1, 1.05)
    winner, off_xs, n2_xs, ratio = b.compared[OFF]
    assert winner == N2 and off_xs == pytest.approx((4.6e-6 * 0.95, 4.6e-6 * 0.9), rel=1e-12)
    assert n2_xs == pytest.approx((1.65e-6 * 1.1, 1.65e-6 * 1.05), rel=1e-12)
    assert ratio == pytest.approx(1 / statistics.median([1.65 * 1.1 / (4.6 * 0.95), 1.65 * 1.05 / (4.6 * 0.9)]), rel=1e-12)
    # without it (decisive=None), off's comparison runs its first 3 pairs, as every other one does
    chosen, _ = _patterned(dataclasses.replace(space, decisive=None), far, 30, prior=OFF)
    assert chosen[:8] == [OFF] + _trial(OFF, N2, pairs=3)
    # a gap within decisive in the pairs: N = 2 1.3 times off, pairs 1.12 and 1.11 under this pattern,
    # runs the usual first 3 pairs
    chosen, policy = _patterned(space, {OFF: 1.0, N2: 1.3, N3: 1.3, N4: 1.3}, 8)
    assert chosen == [N2] + _trial(N2, OFF, pairs=3)
    # losing by more than decisive in every pair: off over N = 2 (here the prior) at its second pair, slower
    chosen, policy = _patterned(dataclasses.replace(space, ubatch_counts=(2,)), {OFF: 2.0, N2: 1.0}, 10)
    assert chosen == [N2] + _trial(N2, OFF, pairs=2) + [N2] * 4
    assert policy.buckets["b"].verdicts == {OFF: "slower"}


@pytest.mark.parametrize(("pairs", "decided"), [
    (([1.0], [1.6]), None),                    # one pair: never decisive
    (([1.0, 1.0], [1.6, 1.4]), None),          # one of two within the gap
    (([1.0, 1.0], [1.6, 1.7]), ("default", "other")),  # every pair: the other 1.5 times slower or more
    (([1.0, 1.0], [0.6, 0.66]), ("other", "default")),  # every pair: the default 1.5 times slower or more
    (([1.0, 1.0, 1.0], [0.6, 0.66, 0.7]), None),  # the third pair within the gap
    (([0.0, 1.0], [1.6, 1.7]), None),          # a zero time decides nothing
])
def test_decisive_needs_two_pairs_all_beyond_the_gap(pairs: tuple[list[float], list[float]],
                                                    decided: tuple[str, str] | None) -> None:
    c = decisive(*pairs, 0.5)
    assert (c.outcome, c.slower) == decided if c is not None else decided is None
    assert decisive(*pairs, None) is None


def test_a_trial_not_even_ahead_after_its_first_pairs_stops_there() -> None:
    # off and N = 2, 3 within 2% under +-10%: not separated after 3 pairs. stop_behind ends a
    # comparison at the first look (from 3 pairs on) where the side that would have to win is not
    # ahead: N = 2 after 4 pairs (off's pairs ahead of it); N = 3 stays ahead by less than the bar and
    # runs to 6 pairs, a tie to off: 23 exploring steps; without stop_behind N = 2 runs to 6 pairs too
    space = AutoConfig(ubatch_counts=(2, 3), splits=("token",), dispatches=("auto",))
    near = {OFF: 1.0, N2: 1.02, N3: 1.02}
    chosen, policy = _patterned(space, near, 30)
    assert chosen == [N2] + _trial(N2, OFF, pairs=4) + _trial(OFF, N3, pairs=6) + [OFF] * 7
    assert policy.buckets["b"].verdicts == {N2: "tie", N3: "tie"}
    longer, _ = _patterned(dataclasses.replace(space, stop_behind=False), near, 30)
    assert longer == [N2] + _trial(N2, OFF, pairs=6) + _trial(OFF, N3, pairs=6) + [OFF] * 3


def test_a_trial_ruled_out_far_behind_ends_the_climb_one_within_the_noise_does_not() -> None:
    # N = 2 30% slower than off under +-10%: ruled out (not separated at 5 pairs, the ratio's bar is
    # wide) with its pairs' median ratio above 1 + behind (15%): 'behind', so (step_over=0) N = 3 is not tried
    space = AutoConfig(ubatch_counts=(2, 3), splits=("token",), dispatches=("auto",), stop_behind=False, step_over=0)
    chosen, policy = _patterned(space, {OFF: 1.0, N2: 1.3, N3: 1.3}, 20)
    assert chosen == [N2] + _trial(N2, OFF, pairs=5) + [OFF] * 8
    b = policy.buckets["b"]
    assert b.verdicts == {N2: "behind"} and b.compared[N2][3] > 1 + space.behind
    # 10% slower: within 'behind', a tie: the climb goes on to N = 3, which wins
    chosen, policy = _patterned(space, {OFF: 1.0, N2: 1.1, N3: 0.8}, 30)
    assert chosen[:14] == [N2] + _trial(N2, OFF, pairs=6) and N3 in chosen and policy.buckets["b"].incumbent == N3
    assert policy.buckets["b"].verdicts == {N2: "tie", OFF: "slower"}


def test_n_3_is_still_tried_where_n_2_loses_to_off() -> None:
    # eth100's decode steps (benchmarks/results/auto_measured_cpu-2c_2026-12-02_run6.md): N = 2 30%
    # slower than off, N = 3 15% faster. The climb steps over N = 2's loss (step_over=1): N = 3 wins
    # against off, N = 4 is tried against N = 3 and loses, N = 3 stays
    cost = {OFF: 1.0, N2: 1.3, N3: 0.85, N4: 1.0}
    policy = AutoPolicy(SMALL_SPACE, prior=lambda b: N2)
    chosen = _drive_why(policy, cost, 30, jitter=0.0, seed=0)
    assert [arm for arm, _ in chosen] == [N2] + _trial(N2, OFF) + _trial(OFF, N3) + _trial(N3, N4) + [N3] * 8
    b = policy.buckets["decode 64-127"]
    assert b.verdicts == {N2: "slower", OFF: "slower", N4: "slower"}
    assert chosen[8][1].startswith("decode 64-127: exploring 3/4 (warm-up 1/1 of N=3 token auto); best off 1.00±0.00 "
                                   "us/token (3); N=2 token auto 1.30±0.00 (3, slower vs off 1.00±0.00 (3), ratio 1.300)")
    # under noise: N = 3 in all 20 seeds at +-5%, in 19 at +-10% (one comparison with off does not
    # separate in 6 pairs: a tie, which goes to off); step_over=0 ends off in all 20 at either level
    for jitter, n3_seeds in ((0.05, 20), (0.1, 19)):
        finals = [_drive(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), cost, 60, jitter=jitter, seed=seed)[-1]
                  for seed in range(20)]
        assert (finals.count(N3), finals.count(OFF)) == (n3_seeds, 20 - n3_seeds), jitter
    # step_over=0 ends the climb at N = 2's loss: off, 15% slower than the N = 3 it never tried
    stop = dataclasses.replace(SMALL_SPACE, step_over=0)
    assert _drive(AutoPolicy(stop, prior=lambda b: N2), cost, 30, jitter=0.0, seed=0) == (
        [N2] + _trial(N2, OFF) + [OFF] * 22)
    assert {_drive(AutoPolicy(stop, prior=lambda b: N2), cost, 60, jitter=0.1, seed=seed)[-1] for seed in range(20)} == {OFF}


def test_the_same_measurements_give_the_same_choices() -> None:
    cost = {OFF: 1.0, N2: 0.82, N3: 0.8, N4: 0.81}
    runs = [_drive_why(AutoPolicy(SMALL_SPACE, prior=lambda b: N2), cost, 80, jitter=0.1, seed=7) for _ in range(2)]
    assert runs[0] == runs[1]


def test_exploration_is_bounded_and_pins_override() -> None:
    cfg = AutoConfig(max_arms=2, samples=2, max_samples=2, warmup=0, pin=(("mixed 512-1023", OFF),))
    policy = AutoPolicy(cfg, prior=lambda bucket: Arm(2))
    assert len(policy.bucket("decode 64-127").schedule) == 3
    chosen = _drive(policy, {a: 1.0 for a in cfg.arms()}, 20, jitter=0.0, seed=0)
    assert chosen[:8] == _trial(Arm(2), OFF, pairs=2, warmup=0) + _trial(OFF, Arm(3), pairs=2, warmup=0)
    assert set(chosen[8:]) == {OFF}  # 2 trials x 2 pairs, then one configuration (ties go to off)
    assert policy.choose("mixed 512-1023") == (OFF, "mixed 512-1023: pinned by AutoConfig.pin")
    # pure noise (+-10%), every configuration tried (climb=False): each comparison ends by
    # max_samples, and ties go to off
    wide = AutoConfig(climb=False)
    bound = wide.warmup + wide.max_arms * (wide.warmup + 2 * wide.max_samples)
    finals = []
    for seed in range(10):
        noisy = _drive_why(AutoPolicy(wide, prior=lambda b: Arm(2)), {a: 1.0 for a in wide.arms()}, 120,
                           jitter=0.10, seed=seed)
        assert _explored(noisy) <= bound, seed
        finals.append(noisy[-1][0])
    assert finals.count(OFF) == 7  # 3 of 10 keep a configuration as fast as off: a lucky separation


def test_bad_auto_configs_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"prune \(-0.1\) must be >= 0 \(a share of the incumbent's time\) or None"):
        AutoConfig(prune=-0.1)
    with pytest.raises(ValueError, match=r"ubatch_counts \(1, 2\) must be ubatch counts >= 2"):
        AutoConfig(ubatch_counts=(1, 2))
    with pytest.raises(ValueError, match=r"splits \('tokens',\): use some of"):
        AutoConfig(splits=("tokens",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("behind (-0.1) must be >= 0 (a share of the winner's time)")):
        AutoConfig(behind=-0.1)
    with pytest.raises(ValueError, match=r"margin \(1.5\) must lie in \[0, 1\)"):
        AutoConfig(margin=1.5)
    with pytest.raises(ValueError, match=re.escape("samples (3) must be >= 1, warmup (1) >= 0 and samples <= "
                                                   "max_samples (2) <= window (8)")):
        AutoConfig(max_samples=2)
    with pytest.raises(ValueError, match=re.escape("separation (-1.0) must be >= 0 (standard errors; 0 compares "
                                                   "medians only)")):
        AutoConfig(separation=-1.0)
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
    assert [r.config for r in records[:22]] == [a.label for a in [N2] + _trial(N2, OFF) + _trial(N2, N3) + _trial(N3, N4)]
    last = records[-1]
    assert last.config == "N=3 token auto" and last.microbatched and len(last.ubatch_num_tokens) == 3
    assert last.evidence.startswith("decode 64-127: best N=3 token auto 70")
    off = records[4]
    assert off.reason is PlanReason.AUTO_OFF and off.detail.startswith("decode 64-127: exploring 2/4")
    assert runner.report().startswith("24 steps: N=3 token auto 9 steps")
    assert runner.report().endswith('ran unsplit: 4 steps where tuning="auto" measured or expected DBO slower (auto_off)')


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


class _DispatchSeen(ClockedModel):
    """Records per ubatch forward the dispatch bound the runner declared (None: the MoE layers split)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(clock, {n: 1.0e-3 for n in (1, 2, 3, 4)})
        self.seen: list[DispatchOptions | None] = []

    async def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> torch.Tensor:
        self.seen.append(current_dispatch_options())
        return await super().forward(ids_T, pos_T, attn)


@pytest.mark.asyncio
@pytest.mark.parametrize("dispatch", ["auto", "fused"])
@pytest.mark.parametrize("tuning", ["fixed", "auto"])
async def test_without_a_dp_group_the_runner_declares_no_dispatch_bound_in_any_mode(tuning: str, dispatch: str) -> None:
    """A fused buffer is sized from the DP vote every rank shares; without a ``dp_group`` there is
    none, so every step splits (RunnerConfig), ``tuning="auto"`` (its one-rank vote is no shared
    one) as the fixed one, on DBO steps and unsplit ones alike."""
    clock = VirtualClock()
    model = _DispatchSeen(clock)
    pin = AutoConfig(pin=(("decode 64-127", Arm(2, "token", dispatch)),))  # type: ignore[arg-type]
    cfg = RunnerConfig(tuning=tuning, dispatch=dispatch, auto=pin, thresholds=ThresholdConfig(decode_threshold=32))  # type: ignore[arg-type]
    runner = DBORunner(model, cfg, clock=clock)
    batches = decode_batches(BatchBuilder(CACHE), [64, 70, 100, 64])
    records = [(await runner.step(b)).record for b in batches[:3]]
    records.append((await runner.step(batches[3], enabled=False)).record)
    assert [len(r.ubatch_num_tokens) for r in records] == [2, 2, 2, 1]
    assert model.seen == [None] * 7


@pytest.mark.asyncio
async def test_without_a_dp_group_auto_explores_no_dispatch_variant() -> None:
    """Without a DP group every step splits, so configurations that differ only in the dispatch
    mode run alike: the runner explores ``AutoConfig.dispatches[0]`` only (the default space's
    N=2 token split would cost a comparison that measures nothing)."""
    clock = VirtualClock()
    model = ClockedModel(clock, {1: 1.0e-3, 2: 0.9e-3, 3: 0.95e-3, 4: 1.0e-3})  # N = 2 leads: the climb tries the variants
    runner = DBORunner(model, RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32)), clock=clock)
    records = [(await runner.step(b)).record for b in decode_batches(BatchBuilder(CACHE), [64] * 30)]
    trace = [N2] + _trial(N2, OFF) + _trial(N2, N3) + _trial(N2, Arm(2, "balanced")) + [N2] * 8
    assert [r.config for r in records] == [a.label for a in trace]
    assert records[-1].evidence == (
        "decode 64-127: best N=2 token auto 900.00±0.00 us/token (8); off 1000.00±0.00 (3, slower vs N=2 token auto "
        "900.00±0.00 (3), ratio 1.111); N=3 token auto 950.00±0.00 (3, slower vs N=2 token auto 900.00±0.00 (3), "
        "ratio 1.056); N=2 balanced auto 900.00±0.00 (3, tie vs N=2 token auto 900.00±0.00 (3), ratio 1.000)")


@pytest.mark.asyncio
async def test_a_settled_steps_evidence_says_what_the_policy_knew_at_that_step_when_read_later() -> None:
    """The runner leaves a settled choice's evidence to be put in words when read (issue 46): a
    record read after later steps says what it said read at its own step (two runners alike,
    one read at each step, one at the end), while the choice's samples change step by step."""
    texts = []
    for read_at_once in (True, False):
        clock = VirtualClock()
        model = ClockedModel(clock, {1: 1.0e-3, 2: 0.9e-3, 3: 0.95e-3, 4: 1.0e-3}, jitter=0.02, seed=5)
        runner = DBORunner(model, RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32)),
                           clock=clock)
        records, seen = [], []
        for batch in decode_batches(BatchBuilder(CACHE), [64] * 30):
            records.append((await runner.step(batch)).record)
            if read_at_once:
                seen.append(records[-1].evidence)
        texts.append(seen if read_at_once else [r.evidence for r in records])
    assert texts[0] == texts[1]
    settled = [t for t in texts[1] if ": best " in t]
    assert len(settled) >= 8 and len(set(settled)) > 1  # the choice's samples moved


@pytest.mark.asyncio
async def test_a_step_off_by_the_policys_choice_says_why_in_its_detail_when_read_later() -> None:
    """Settled on off, a step's detail (and its plan's decision's) is that choice's evidence, put
    in words when read: read after later steps it says what it said at its own step."""
    texts = []
    for read_at_once in (True, False):
        clock = VirtualClock()
        model = ClockedModel(clock, {1: 0.8e-3, 2: 1.0e-3, 3: 1.1e-3, 4: 1.2e-3}, jitter=0.02, seed=7)  # off is fastest
        runner = DBORunner(model, RunnerConfig(tuning="auto", thresholds=ThresholdConfig(decode_threshold=32)),
                           clock=clock)
        results, seen = [], []
        for batch in decode_batches(BatchBuilder(CACHE), [64] * 30):
            results.append(await runner.step(batch))
            if read_at_once:
                seen.append((results[-1].record.detail, results[-1].plan.decision.detail))
        texts.append(seen if read_at_once else [(r.record.detail, r.plan.decision.detail) for r in results])
    assert texts[0] == texts[1]
    off = [(d, dd) for (d, dd), r in zip(texts[1], results) if r.record.reason is PlanReason.AUTO_OFF]
    settled = [(d, dd) for d, dd in off if ": best off " in d]
    assert all(type(d) is str and d == dd for d, dd in off) and len(settled) >= 8
    assert len({d for d, _ in settled}) > 1  # off's samples moved


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


@pytest.mark.timeout(120)
def test_auto_refuses_ep_peers_that_would_choose_alone(pool: RankPool) -> None:
    """EP peers that choose different ubatch counts issue different all-to-alls: an "auto" runner
    needs a DP vote that every EP rank is in (asyncdbo.serving.runner_config.check_ep_group)."""
    r0, r1 = pool.run(auto_groups, timeout_s=90.0)
    for rank, out in enumerate((r0, r1)):
        assert out["none"] == (
            "tuning='auto' with an EP group of 2 ranks [0, 1] needs dp_group: without it each rank "
            "chooses its configuration from its own step times, and EP peers that choose different ubatch counts "
            "issue different all-to-alls; pass dp_group= a group holding every EP rank (e.g. the EP group itself), "
            "or use tuning='fixed'")
        assert out["alone"] == (
            f"tuning='auto': EP ranks [{1 - rank}] (EP group [0, 1]) are not in dp_group "
            f"(ranks [{rank}]), so they would choose their configuration from other votes and issue different "
            "all-to-alls; pass a dp_group that holds every EP rank")
        assert out["world"] == "ok"


@pytest.mark.timeout(120)
def test_dp_ranks_configured_apart_are_refused_on_every_rank_not_left_to_abort(pool: RankPool) -> None:
    """An auto runner's vote carries more than a fixed one's: gloo aborts an all_reduce of unequal
    sizes, so every vote has the same size and says how much of it its rank uses; and it carries
    a fingerprint of what the policy chooses from (asyncdbo.plan.dp, DBORunner._plan_auto)."""
    assert pool.run(mismatched, "tuning", timeout_s=60.0) == [
        "ranks vote with different extra entries (rank 0: 4, rank 1: 0); every rank of the DP group must plan "
        "the same way: a DBORunner on every rank with the same RunnerConfig.tuning ('auto' votes 4 extra "
        "entries, 'fixed' none)"] * 2
    margin = pool.run(mismatched, "margin", timeout_s=60.0)
    assert margin[0] == margin[1]
    assert re.fullmatch(r"the DP ranks' tuning='auto' runners have different settings \(fingerprints rank 0: "
                        r"[0-9a-f]{8}, rank 1: [0-9a-f]{8}\); every rank must choose from the same "
                        r"RunnerConfig.auto, thresholds and min_share", margin[0]), margin[0]
    assert pool.run(mismatched, "counts", timeout_s=60.0) == [
        "ranks disagree on num_ubatches (rank 0: 4, rank 1: 3); every rank of the DP group must plan the same "
        "number of ubatches: pass one num_ubatches to all of them (a DBORunner: the same "
        "RunnerConfig.num_ubatches, or under tuning='auto' the same AutoConfig.ubatch_counts)"] * 2
