"""The runner's "auto" tuning on the simulated device (issue 26, item 3): ``replay_auto`` feeds the
same :class:`~asyncdbo.serving.AutoPolicy` the simulated step times, so a bucket where DBO loses
ends off (with the fixed thresholds flagged below break-even there) and one where it wins keeps
DBO; the evidence is the runner's. DeepSeek-V3 at EP 32 over 400 Gb/s InfiniBand, decode of 2000
cached tokens: the issue's 64-request step that the threshold of 32 microbatches at a loss, and a
256-request one where DBO pays. Four compositions, simulated once each (races are checked
elsewhere)."""

from __future__ import annotations

import functools

import pytest

from asyncdbo.plan import PlanReason, ThresholdConfig
from asyncdbo.serving import OFF, Arm, AutoConfig, AutoPolicy
from asyncdbo.sim.predict import Deployment, ModelShape
from asyncdbo.sim.tuning import below_break_even, replay_auto, step_bucket
from asyncdbo.sim.workload import ReplayResult, StepSims, replay

pytestmark = pytest.mark.timeout(300)

N2 = Arm(2, "token", "split")
NARROW = AutoConfig(ubatch_counts=(2,), splits=("token",), dispatches=("split",), samples=1, warmup=0)  # off or N = 2
SMALL, LARGE = [[(1, 2000)] * 64] * 2, [[(1, 2000)] * 256] * 2  # two DP ranks decoding alike
STEPS = [SMALL, LARGE] * 3


@functools.cache
def _runs() -> tuple[StepSims, ReplayResult, ReplayResult]:
    sims = StepSims(model=ModelShape.of("deepseek-v3"), deployment=Deployment(), check_races=False)
    auto = replay_auto(STEPS, sims=sims, cfg=NARROW)
    fixed = replay(STEPS, model=sims.model, sims=sims)
    return sims, auto, fixed


def test_auto_explores_then_keeps_what_the_simulated_times_favour() -> None:
    sims, auto, fixed = _runs()
    assert [(b, arm) for b, arm, _ in auto.choices] == [
        ("decode 64-127", OFF), ("decode 256-511", OFF),  # the prior's opposite: the trial runs first in each pair
        ("decode 64-127", N2), ("decode 256-511", N2),  # the prior (above the decode threshold of 32), its pair
        ("decode 64-127", OFF), ("decode 256-511", N2),  # judged with the 3% margin: DBO loses at 64, wins at 256
    ]
    assert sims.simulations == 4  # each composition once: the fixed replay reused auto's
    # the policy observed the slowest rank's time per real token of the largest rank
    small_off, small_n2 = auto.steps[0].dbo_s / 64, auto.steps[2].dbo_s / 64
    large_off, large_n2 = auto.steps[1].dbo_s / 256, auto.steps[3].dbo_s / 256
    assert small_off < small_n2 * 0.97 and not large_off < large_n2 * 0.97
    assert [b for b, _, e in auto.choices] == [step_bucket(s) for s in STEPS]
    assert auto.choices[4][2] == (f"decode 64-127: best off {small_off * 1e6:.2f}±0.00 us/token (1); "
                                  f"N=2 token split {small_n2 * 1e6:.2f}±0.00 (1, slower vs off {small_off * 1e6:.2f}±0.00 (1), "
                                  f"ratio {small_n2 / small_off:.3f})")
    assert auto.choices[2][2] == ("decode 64-127: exploring 2/2 (sample 1/6 of N=2 token split, paired with off); best "
                                  f"N=2 token split (prior, unmeasured); off {small_off * 1e6:.2f}±0.00 (1)")
    assert auto.exploring() == 4 and auto.buckets() == {"decode 64-127": (3, 2), "decode 256-511": (3, 2)}
    assert [s.reason for s in auto.steps] == [PlanReason.AUTO_OFF] * 2 + [PlanReason.MICROBATCHED] * 2 + [
        PlanReason.AUTO_OFF, PlanReason.MICROBATCHED]
    # the same measurements fed to a fresh policy by hand give the same choices: it is the runner's code
    assert auto.policy is not None and auto.policy.buckets["decode 64-127"].incumbent == OFF
    again = AutoPolicy(NARROW, prior=lambda bucket: N2)
    for (bucket, arm, _), step in zip(auto.choices, auto.steps):
        assert again.choose(bucket)[0] == arm
        again.observe(bucket, arm, step.dbo_s / max(step.tokens))


def test_the_fixed_thresholds_are_flagged_where_they_microbatch_below_break_even() -> None:
    _, auto, fixed = _runs()
    assert all(s.microbatched for s in fixed.steps)  # 64 and 256 tokens per rank: both above 32
    (low,) = below_break_even(STEPS, fixed)
    small = [s for s in fixed.steps if s.tokens == (64, 64)]
    assert (low.bucket, low.steps) == ("decode 64-127", 3)
    assert low.speedup == pytest.approx(sum(s.serial_s for s in small) / sum(s.dbo_s for s in small)) and low.speedup < 1
    # over the whole trace auto beats fixed once it stopped exploring
    assert auto.steps[4].dbo_s < fixed.steps[4].dbo_s and auto.steps[5].dbo_s == fixed.steps[5].dbo_s


def test_a_step_the_chosen_split_cannot_cut_is_recorded_as_the_runner_records_it() -> None:
    # The bucket's choice is N = 2 with the request split; a step of one request cannot be cut that
    # way and runs off: policy_refused, as DBORunner records it, not auto_off (a choice of off).
    tiny = ModelShape(name="tiny", hidden=64, intermediate=32, experts=8, top_k=2, shared_experts=1, heads=2,
                      kv_heads=1, head_dim=16, v_head_dim=16, layers=3)
    sims = StepSims(model=tiny, deployment=Deployment(ep=8), check_races=False)
    cfg = AutoConfig(ubatch_counts=(2,), splits=("request",), dispatches=("split",), max_arms=0)
    auto = replay_auto([[[(40, 0), (40, 0)]], [[(80, 0)]]], sims=sims, cfg=cfg,
                       thresholds=ThresholdConfig(prefill_threshold=16))
    assert [s.reason for s in auto.steps] == [PlanReason.MICROBATCHED, PlanReason.POLICY_REFUSED]
    assert auto.steps[1].detail == ("mixed 64-127: N=2 request split cannot split this batch (a request split leaves "
                                    "a ubatch without real tokens), off; best N=2 request split (prior, unmeasured)")
