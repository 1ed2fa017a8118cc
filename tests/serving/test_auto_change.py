"""The "auto" tuning after a bucket settled (issue 47): change detection on the settled choice's
step time (a two-sided CUSUM against the reference it measured after settling) explores the bucket
again when the workload changes, in both directions (DBO starting to pay, DBO ceasing to pay);
probing the runners-up of a near-tie sees a change that leaves the settled choice's own time where
it was; stationary noise, uniform or heavy-tailed, raises no false alarm; the records and the
report say when and why. Step times come from an injected clock: no test reads wall time."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
from _auto_ranks import CACHE, ClockedModel, agree_change, decode_batches

from asyncdbo.lowlevel import VirtualClock
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import OFF, Arm, AutoConfig, AutoPolicy, BatchBuilder, DBORunner, RunnerConfig
from asyncdbo.testing import RankPool

N2, N3 = Arm(2), Arm(3)
BUCKET = "decode 64-127"


def costs(off: float, dbo: float, **special: float) -> dict[Arm, float]:
    """Over the default search space: off ``off``, every DBO configuration ``dbo`` times off, bar
    those named (``N2``: N = 2 token auto) at their own share."""
    named = {f"N={k[1:]} token auto": v for k, v in special.items()}
    return {a: off if a == OFF else off * named.get(a.label, dbo) for a in AutoConfig().arms()}


def noise(rng: random.Random, heavy: bool) -> float:
    """+-10% uniform; ``heavy``: and 4% of the steps 10x slower."""
    f = 1 + rng.uniform(-0.1, 0.1)
    return f * 10 if heavy and rng.random() < 0.04 else f


def drive(policy: AutoPolicy, before: dict[Arm, float], after: dict[Arm, float], change: int, steps: int, *,
          seed: int, heavy: bool = False) -> list[Arm]:
    """``steps`` steps of one bucket, costs ``before`` until step ``change`` and ``after`` from it;
    the bucket's choice after each step."""
    rng = random.Random(seed)
    out = []
    for i in range(steps):
        arm, _ = policy.choose(BUCKET)
        policy.observe(BUCKET, arm, (before if i < change else after)[arm] * 1e-6 * noise(rng, heavy))
        out.append(policy.buckets[BUCKET].incumbent)
    return out


def steps_to_within(choices: list[Arm], after: dict[Arm, float], change: int) -> int | None:
    """Steps from ``change`` until the choice is within 3% of the best of ``after`` and stays there."""
    best = min(after.values())
    bad = [i for i, arm in enumerate(choices[change:]) if after[arm] > best * 1.03]
    if not bad:
        return 0
    return bad[-1] + 1 if bad[-1] + 1 < len(choices) - change else None


# DBO loses (off settles), then the link is 5x slower: everything comm-bound, off's own time 1.6x,
# N = 2 token auto 0.847x the new off (the measured ratio)
LOSES, PAYS = costs(1.0, 1.10, N2=1.05), costs(1.6, 0.95, N2=0.847, N3=0.86)
# DBO pays (N = 2 settles), then the experts' compute is 5x heavier: every time 4x, DBO 1.11x off
WINS, HEAVY = costs(1.0, 0.95, N2=0.85, N3=0.88), costs(4.0, 1.15, N2=1.11)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("before, after, settled, new", [(LOSES, PAYS, OFF, N2), (WINS, HEAVY, N2, OFF)],
                         ids=["dbo-starts-to-pay", "dbo-ceases-to-pay"])
def test_a_change_after_settling_is_followed_within_100_steps(before: dict[Arm, float], after: dict[Arm, float],
                                                               settled: Arm, new: Arm) -> None:
    for seed in range(10):
        policy = AutoPolicy(AutoConfig(), prior=lambda bucket: N2)
        choices = drive(policy, before, after, change=300, steps=600, seed=seed)
        assert choices[299] == settled, seed
        took = steps_to_within(choices, after, 300)
        assert took is not None and took <= 100, (seed, took)
        assert choices[-1] == new, seed
        again = policy.reexplorations
        assert len(again) == 1 and again[0].incumbent == settled and again[0].step > 300, (seed, again)
        assert re.fullmatch(rf"{settled.label} ran (slower|faster) than its reference [\d.]+ us/token ±[\d.]+%: this "
                            r"step [\d.]+x, CUSUM (slower|faster) [\d.]+ > 10.0 after \d+ steps", again[0].why), again[0].why


@pytest.mark.timeout(60)
def test_without_change_detection_the_settled_choice_stays_after_a_change() -> None:
    """What issue 47 measured: a bucket, once settled, was never looked at again."""
    policy = AutoPolicy(AutoConfig(detect=None), prior=lambda bucket: N2)
    choices = drive(policy, LOSES, PAYS, change=300, steps=600, seed=0)
    assert set(choices[250:]) == {OFF} and policy.buckets[BUCKET].watch is None and not policy.reexplorations


@pytest.mark.timeout(60)
def test_no_false_alarm_under_stationary_noise() -> None:
    """10 seeds x 10,000 steps of a settled bucket, +-10% uniform noise and heavy-tailed (4% of the
    steps 10x slower), off settled and N = 2 settled: not one re-exploration."""
    for table in (LOSES, WINS):
        for heavy in (False, True):
            for seed in range(10):
                policy = AutoPolicy(AutoConfig(), prior=lambda bucket: N2)
                drive(policy, table, table, change=0, steps=10_000, seed=100 + seed, heavy=heavy)
                b = policy.buckets[BUCKET]
                assert b.watch is not None and b.watch.watched > 9_000, (heavy, seed)
                assert not policy.reexplorations, (heavy, seed, policy.reexplorations)


# off settles over a near-tie (N = 2 token auto 1.01x off); then N = 2 token auto gets 15% faster
# and off's own time does not move: the settled choice's CUSUM cannot see it
NEAR_TIE, TIE_BROKEN = costs(1.0, 1.10, N2=1.01), costs(1.0, 1.10, N2=0.85)


@pytest.mark.timeout(60)
def test_probing_the_runners_up_sees_a_change_the_settled_choice_does_not_feel() -> None:
    probing = AutoConfig(probe_every=8)
    followed = unprobed = 0
    for seed in range(10):
        policy = AutoPolicy(probing, prior=lambda bucket: N2)
        choices = drive(policy, NEAR_TIE, TIE_BROKEN, change=300, steps=1000, seed=seed)
        followed += choices[-1] == N2
        # a probe step runs a runner-up, one step in 8
        assert all(r.why.startswith(("runner-up N=2 token auto probed faster than off", "N=2 token auto ran"))
                   for r in policy.reexplorations), policy.reexplorations
        plain = AutoPolicy(AutoConfig(), prior=lambda bucket: N2)
        unprobed += drive(plain, NEAR_TIE, TIE_BROKEN, change=300, steps=1000, seed=seed)[-1] == N2
    assert followed >= 8 and unprobed <= 2, (followed, unprobed)


@pytest.mark.timeout(60)
def test_probing_runs_a_runner_up_one_step_in_k_and_says_so() -> None:
    policy = AutoPolicy(AutoConfig(probe_every=8), prior=lambda bucket: N2)
    rng = random.Random(3)
    runs = []
    for _ in range(400):
        arm, why = policy.choose(BUCKET)
        runs.append((arm, why))
        policy.observe(BUCKET, arm, NEAR_TIE[arm] * 1e-6 * noise(rng, False))
    w = policy.buckets[BUCKET].watch
    assert w is not None and w.runners_up and policy.buckets[BUCKET].incumbent == OFF
    probes = [i for i, (_, why) in enumerate(runs) if ": probing " in why]
    assert probes and all(b - a == 8 for a, b in zip(probes, probes[1:]))
    assert all(runs[i][0] in w.runners_up for i in probes)
    assert re.match(r"decode 64-127: probing N=\d \w+ \w+, a runner-up of a near-tie \(1 step in 8\); best off",
                    runs[probes[0]][1])
    assert policy.watching(BUCKET).startswith("watching off: reference ")
    assert not policy.reexplorations


@pytest.mark.timeout(60)
def test_same_measurements_same_re_explorations() -> None:
    runs = []
    for _ in range(2):
        policy = AutoPolicy(AutoConfig(probe_every=8), prior=lambda bucket: N2)
        runs.append((drive(policy, LOSES, PAYS, change=300, steps=500, seed=5, heavy=True), policy.summary()))
    assert runs[0] == runs[1] and runs[0][1].startswith("explored again: decode 64-127 at its step ")


def test_bad_change_detection_configs_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=re.escape("reference (2) must be >= 4 (the settled steps whose median and "
                                                   "spread the change detection compares later steps with), e.g. "
                                                   "reference=64, the default")):
        AutoConfig(reference=2)
    with pytest.raises(ValueError, match=re.escape("detect (0.0) must be a finite number > 0 (the CUSUM threshold, in "
                                                   "standard deviations), e.g. detect=10.0, the default; use "
                                                   "detect=None to turn change detection off")):
        AutoConfig(detect=0.0)
    with pytest.raises(ValueError, match=re.escape("detect (inf) must be a finite number > 0")):
        AutoConfig(detect=float("inf"))
    with pytest.raises(ValueError, match=re.escape("detect_slack (-1.0) must be a finite number >= 0")):
        AutoConfig(detect_slack=-1.0)
    with pytest.raises(ValueError, match=re.escape("probe_every (1) must be >= 2 (one step in probe_every runs the "
                                                   "runner-up), e.g. probe_every=16, or None for no probing")):
        AutoConfig(probe_every=1)
    with pytest.raises(ValueError, match=re.escape("probe_every (8) needs detect, the threshold its CUSUM fires at")):
        AutoConfig(probe_every=8, detect=None)
    with pytest.raises(TypeError, match=r"AutoConfig.probe_every must be an int, got float 8.0"):
        AutoConfig(probe_every=8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"AutoConfig.detect must be a number or None \(no change detection\)"):
        AutoConfig(detect="10")  # type: ignore[arg-type]
    assert dataclasses.replace(AutoConfig(), detect=None, probe_every=None).detect is None


# ------------------------------------------------------------------- the runner, one process


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_runner_records_and_reports_when_and_why_a_bucket_explored_again() -> None:
    clock = VirtualClock()
    # DBO loses (N = 2 1.3x off): the bucket settles off; then the link is slower: off 1.6x, N = 2 0.85x of that
    model = ClockedModel(clock, {1: 1.0e-3, 2: 1.3e-3, 3: 1.4e-3, 4: 1.5e-3}, jitter=0.05, seed=4)
    small = AutoConfig(splits=("token",), dispatches=("auto",))
    runner = DBORunner(model, RunnerConfig(tuning="auto", auto=small, thresholds=ThresholdConfig(decode_threshold=32)),
                       clock=clock)
    batches = decode_batches(BatchBuilder(CACHE), [64] * 160)
    records = [(await runner.step(b)).record for b in batches[:80]]
    assert records[-1].config == "off" and "explored again" not in records[-1].evidence
    model.cost = {1: 1.6e-3, 2: 1.36e-3, 3: 1.5e-3, 4: 1.6e-3}
    records += [(await runner.step(b)).record for b in batches[80:]]
    assert records[-1].config == "N=2 token auto"
    again = [i for i, r in enumerate(records) if "explored again" in r.evidence]
    first = again[0]
    assert 80 < first <= 95 and records[first].evidence.startswith("decode 64-127: exploring ")
    assert re.search(r"explored again, last at the bucket's step \d+: off ran slower than its reference (99\d|100\d)\.\d\d "
                     r"us/token ±[\d.]+%: this step 1\.\d\dx, CUSUM slower [\d.]+ > 10.0 after \d+ steps$",
                     records[first].evidence), records[first].evidence
    assert re.search(r"; explored again: decode 64-127 at its step \d+ \(off ran slower than its reference", runner.report())


# ------------------------------------------------------------------- DP ranks agree


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_dp_rank_explores_again_on_the_same_step(pool: RankPool) -> None:
    """Rank 1's costs change (its link got slower): the group's slowest time, which every rank
    feeds its policy, moves, and both ranks explore again on the same step and run the same
    configuration every step."""
    r0, r1 = pool.run(agree_change, 140, 80, timeout_s=150.0)
    assert [r.config for r in r0["records"]] == [r.config for r in r1["records"]]
    assert [r.evidence for r in r0["records"]] == [r.evidence for r in r1["records"]]
    assert "explored again: decode" in r0["report"] and r0["report"].split("; explored again")[1] == (
        r1["report"].split("; explored again")[1])
    assert r0["records"][-1].config == "N=2 token auto"
