"""A user's mistakes with the runner and its "auto" tuning are refused where they are made, naming
the value and the fix (a new-user trial's findings A5, A6, A10, A11, A12, and a later trial's):
``AutoConfig.pin``, ``Arm`` and ``RunnerConfig.auto`` at construction, a field of the wrong type
(a list for a tuple, a bool or a str for a number, anything but True or False for a flag) or
ubatch counts out of order, a pin the model cannot run at ``DBORunner()``,
a pin a batch cannot split falls back as a fixed runner does, a model without an ``async``
forward, a step argument that is not a Batch, a bad instrument before the step is counted; and
failed steps are counted by neither ``stats`` nor ``report()`` as run. Step times come from an
injected clock."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from _auto_ranks import CACHE, ClockedModel, decode_batches

from asyncdbo import dbo_yield
from asyncdbo.lowlevel import Instrument, VirtualClock
from asyncdbo.plan import PlanReason, ThresholdConfig
from asyncdbo.serving import OFF, Arm, AutoConfig, AutoPolicy, BatchBuilder, DBORunner, Engine, RunnerConfig
from asyncdbo.serving.measure import close_shape_bucket, is_shape_bucket, shape_bucket

_BUCKET_FORM = ("is not a step-shape bucket: a bucket is 'decode LO-HI' or 'mixed LO-HI' with LO a power of "
                "two and HI = 2 * LO - 1, as asyncdbo.serving.measure.shape_bucket names them (e.g. 'decode 64-127')")


def _exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# ------------------------------------------------------------------- A5: pins, arms, RunnerConfig.auto


def test_is_shape_bucket_says_yes_to_exactly_the_names_shape_bucket_gives() -> None:
    given = {shape_bucket(n, u) for n in range(0, 5000) for u in (False, True)}
    assert all(is_shape_bucket(name) for name in given)
    for name in ("mixed 64-128", "decode 64-127 ", "prefill 64-127", "mixed 064-127", "mixed 3-5", "mixed 0--1",
                 "decode", "", "Idle", "mixed ٦٤-127", 64, None):
        assert not is_shape_bucket(name), name
    assert [close_shape_bucket(n) for n in ("mixed 64-128", "prefill 64-127", "decode 100-199", "x", "mixed 0-0")] == [
        "mixed 64-127", "mixed 64-127", "decode 64-127", None, None]


@pytest.mark.parametrize("pin, error, message", [
    ((("mixed 64-128", OFF),), ValueError,
     f"AutoConfig.pin bucket 'mixed 64-128' {_BUCKET_FORM}; did you mean 'mixed 64-127'?"),
    ((("prefill 64-127", OFF),), ValueError,
     f"AutoConfig.pin bucket 'prefill 64-127' {_BUCKET_FORM}; did you mean 'mixed 64-127'?"),
    ((("fast", OFF),), ValueError, f"AutoConfig.pin bucket 'fast' {_BUCKET_FORM}"),
    ((("idle", OFF),), ValueError,
     "AutoConfig.pin entry ('idle', ...): a step where every rank is idle always runs off; pin a busy bucket "
     "such as 'decode 64-127'"),
    ((("mixed 64-127", OFF), ("mixed 64-127", Arm(2))), ValueError,
     "AutoConfig.pin names bucket 'mixed 64-127' twice; pin each bucket once"),
    (("mixed 64-127", OFF), TypeError,
     "AutoConfig.pin ('mixed 64-127', Arm(num_ubatches=1, split='token', dispatch='auto')) is one (bucket name, "
     "Arm) pair, not a tuple of them; write pin=(('mixed 64-127', OFF),)"),
    (("mixed 64-127", Arm(2, "request")), TypeError,
     "AutoConfig.pin ('mixed 64-127', Arm(num_ubatches=2, split='request', dispatch='auto')) is one (bucket name, "
     "Arm) pair, not a tuple of them; write pin=(('mixed 64-127', Arm(2, 'request', 'auto')),)"),
    ({"decode 64-127": OFF}, TypeError,
     "AutoConfig.pin must be a tuple of (bucket name, Arm) pairs, got dict {'decode 64-127': Arm(num_ubatches=1, "
     "split='token', dispatch='auto')}; write pin=tuple(d.items()), e.g. pin=(('decode 64-127', OFF),)"),
    ([("decode 64-127", OFF)], TypeError,
     "AutoConfig.pin must be a tuple of (bucket name, Arm) pairs, got list [('decode 64-127', Arm(num_ubatches=1, "
     "split='token', dispatch='auto'))]; write pin=tuple(...), e.g. pin=(('decode 64-127', OFF),)"),
    (("decode 64-127",), TypeError,
     "AutoConfig.pin entry 'decode 64-127' is not a (bucket name, Arm) pair; write e.g. pin=(('decode 64-127', OFF),)"),
    ((("mixed 64-127", "off"),), TypeError,
     "AutoConfig.pin entry ('mixed 64-127', 'off'): the configuration is a str, not an Arm; write OFF "
     "(asyncdbo.serving.OFF)"),
    ((("mixed 64-127", 2),), TypeError,
     "AutoConfig.pin entry ('mixed 64-127', 2): the configuration is a int, not an Arm; write an Arm, e.g. OFF or "
     "Arm(2, 'token')"),
])
def test_a_bad_pin_is_refused_at_construction_naming_it_and_the_fix(pin: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=_exactly(message)):
        AutoConfig(pin=pin)


def test_a_pin_of_any_off_arm_pins_off_and_pinned_arms_are_in_the_space() -> None:
    cfg = AutoConfig(ubatch_counts=(2,), splits=("token",), dispatches=("auto",),
                     pin=(("decode 64-127", Arm(1, "balanced")), ("mixed 64-127", Arm(3, "request", "split"))))
    assert cfg.pin == (("decode 64-127", OFF), ("mixed 64-127", Arm(3, "request", "split")))
    assert cfg.arms() == [OFF, Arm(2), Arm(3, "request", "split")]  # the feasibility mask's bits
    assert cfg.max_ubatches == 3


@pytest.mark.parametrize("args, error, message", [
    ((0,), ValueError, "Arm num_ubatches (0) must be >= 1 (1: off, 2 or more: DBO)"),
    ((2.0,), TypeError, "Arm num_ubatches must be an int >= 1 (1: off), got float 2.0"),
    ((True,), TypeError, "Arm num_ubatches must be an int >= 1 (1: off), got bool True"),
    ((2, "tok"), ValueError, "Arm split 'tok': use one of ('token', 'request', 'balanced')"),
    ((2, "token", "fast"), ValueError, "Arm dispatch 'fast': use one of ('auto', 'fused', 'split')"),
])
def test_a_bad_arm_is_refused_at_construction(args: tuple[Any, ...], error: type, message: str) -> None:
    with pytest.raises(error, match=_exactly(message)):
        Arm(*args)


def test_runner_config_auto_must_be_an_auto_config() -> None:
    with pytest.raises(TypeError, match=_exactly(
            "RunnerConfig.auto must be an asyncdbo.serving.AutoConfig, got dict {'margin': 0.05, 'samples': 4}; "
            "write auto=AutoConfig(margin=0.05, samples=4)")):
        RunnerConfig(tuning="auto", auto={"margin": 0.05, "samples": 4})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=_exactly(
            "RunnerConfig.auto must be an asyncdbo.serving.AutoConfig, got NoneType None; write auto=AutoConfig(...)")):
        RunnerConfig(auto=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("thresholds, message", [
    ({"decode_threshold": 8}, "RunnerConfig.thresholds must be an asyncdbo.plan.ThresholdConfig, got dict "
                              "{'decode_threshold': 8}; write thresholds=ThresholdConfig(decode_threshold=8)"),
    (32, "RunnerConfig.thresholds must be an asyncdbo.plan.ThresholdConfig, got int 32; write "
         "thresholds=ThresholdConfig(decode_threshold=32, prefill_threshold=512)"),
    (None, "RunnerConfig.thresholds must be an asyncdbo.plan.ThresholdConfig, got NoneType None; write "
           "thresholds=ThresholdConfig(decode_threshold=32, prefill_threshold=512)"),
])
def test_runner_config_thresholds_must_be_a_threshold_config(thresholds: Any, message: str) -> None:
    # it used to be taken, and the first step failed with "'dict' object has no attribute 'num_spec_tokens'"
    with pytest.raises(TypeError, match=_exactly(message)):
        RunnerConfig(thresholds=thresholds)


_FROZEN = "pass a tuple, e.g."


@pytest.mark.parametrize("fields, error, message", [
    ({"ubatch_counts": [2, 3]}, TypeError,
     f"AutoConfig.ubatch_counts must be a tuple, got list [2, 3]; {_FROZEN} ubatch_counts=(2, 3)"),
    ({"ubatch_counts": 3}, TypeError, f"AutoConfig.ubatch_counts must be a tuple, got int 3; {_FROZEN} ubatch_counts=(3,)"),
    ({"ubatch_counts": (2, 2)}, ValueError,
     "AutoConfig.ubatch_counts (2, 2) must be in increasing order, each count once (the climb tries a count only "
     "after the next smaller one); write ubatch_counts=(2,)"),
    ({"ubatch_counts": (4, 2, 3, 2)}, ValueError,
     "AutoConfig.ubatch_counts (4, 2, 3, 2) must be in increasing order, each count once (the climb tries a count "
     "only after the next smaller one); write ubatch_counts=(2, 3, 4)"),
    ({"ubatch_counts": (2.0, 3)}, TypeError,
     "AutoConfig.ubatch_counts (2.0, 3) holds float 2.0, not an int; use ints >= 2, e.g. ubatch_counts=(2, 3)"),
    ({"ubatch_counts": (True, 3)}, TypeError,
     "AutoConfig.ubatch_counts (True, 3) holds True: a bool is not a ubatch count; use ints >= 2, e.g. "
     "ubatch_counts=(3,)"),
    ({"ubatch_counts": ("2",)}, TypeError,
     "AutoConfig.ubatch_counts ('2',) holds str '2', not an int; use ints >= 2, e.g. ubatch_counts=(2, 3, 4)"),
    ({"ubatch_counts": (1, 2)}, ValueError, "ubatch_counts (1, 2) must be ubatch counts >= 2 (off is always a candidate)"),
    ({"splits": ["token"]}, TypeError, f"AutoConfig.splits must be a tuple, got list ['token']; {_FROZEN} splits=('token',)"),
    ({"splits": "token"}, TypeError, f"AutoConfig.splits must be a tuple, got str 'token'; {_FROZEN} splits=('token',)"),
    ({"splits": ("balanced", "token", "balanced")}, ValueError,
     "AutoConfig.splits ('balanced', 'token', 'balanced') names 'balanced' twice; name each once, e.g. "
     "splits=('balanced', 'token')"),
    ({"dispatches": ["auto", "split"]}, TypeError,
     f"AutoConfig.dispatches must be a tuple, got list ['auto', 'split']; {_FROZEN} dispatches=('auto', 'split')"),
    ({"dispatches": ("auto", "auto")}, ValueError,
     "AutoConfig.dispatches ('auto', 'auto') names 'auto' twice; name each once, e.g. dispatches=('auto',)"),
    ({"samples": True}, TypeError,
     "AutoConfig.samples must be an int, got bool True (True and False are not counts); write e.g. samples=3"),
    ({"window": 8.0}, TypeError, "AutoConfig.window must be an int, got float 8.0; write window=8"),
    ({"warmup": "1"}, TypeError, "AutoConfig.warmup must be an int, got str '1'; write warmup=1"),
    ({"step_over": None}, TypeError, "AutoConfig.step_over must be an int, got NoneType None; write e.g. step_over=1"),
    ({"margin": "0.03"}, TypeError, "AutoConfig.margin must be a number, got str '0.03'; write margin=0.03"),
    ({"separation": True}, TypeError, "AutoConfig.separation must be a number, got bool True; write e.g. separation=2.0"),
    ({"prune": False}, TypeError,
     "AutoConfig.prune must be a number or None (no pruning), got bool False; write e.g. prune=0.15"),
    ({"decisive": "0.5"}, TypeError,
     "AutoConfig.decisive must be a number or None (no early end), got str '0.5'; write decisive=0.5"),
    # "nan" parses as a float, but the range check refuses it: the fix is an example, not nan
    ({"decisive": "nan"}, TypeError,
     "AutoConfig.decisive must be a number or None (no early end), got str 'nan'; write e.g. decisive=0.5"),
    ({"margin": "inf"}, TypeError, "AutoConfig.margin must be a number, got str 'inf'; write e.g. margin=0.03"),
    ({"climb": "yes"}, TypeError, "AutoConfig.climb must be True or False, got str 'yes'; use True or False"),
    ({"stop_behind": 1}, TypeError, "AutoConfig.stop_behind must be True or False, got int 1; use True or False"),
])
def test_auto_config_fields_of_the_wrong_type_or_order_are_refused_naming_the_fix(
        fields: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=_exactly(message)):
        AutoConfig(**fields)


def test_auto_config_takes_valid_fields_as_before() -> None:
    cfg = AutoConfig(ubatch_counts=(2, 4), splits=("balanced", "token"), dispatches=("split",), samples=2, margin=0,
                     separation=1, prune=None, climb=False)
    assert hash(cfg) == hash(AutoConfig(ubatch_counts=(2, 4), splits=("balanced", "token"), dispatches=("split",),
                                        samples=2, margin=0, separation=1, prune=None, climb=False))
    assert [a.label for a in cfg.arms()] == ["off", "N=2 balanced split", "N=2 token split", "N=4 balanced split",
                                             "N=4 token split"]


def test_numpy_integers_and_bools_pass_as_python_ones_do() -> None:
    # a config computed with numpy (a count from an array, a flag from a comparison) worked before
    # the type checks; numpy's bool is still no count
    np = pytest.importorskip("numpy")
    assert AutoConfig(samples=np.int64(2), window=np.int32(8), climb=np.bool_(False)).samples == 2
    assert RunnerConfig(num_ubatches=np.int64(3), enabled=np.True_).num_ubatches == 3
    with pytest.raises(TypeError, match=re.escape(
            "AutoConfig.samples must be an int, got numpy.bool np.True_ (True and False are not counts)")):
        AutoConfig(samples=np.True_)


@pytest.mark.parametrize("fields, message", [
    ({"enabled": "yes"}, "RunnerConfig.enabled must be True or False, got str 'yes'; use True or False"),
    ({"enabled": 0}, "RunnerConfig.enabled must be True or False, got int 0; use True or False"),
    ({"num_ubatches": True},
     "RunnerConfig.num_ubatches must be an int, got bool True (True and False are not counts); write e.g. num_ubatches=2"),
    ({"num_ubatches": 2.0}, "RunnerConfig.num_ubatches must be an int, got float 2.0; write num_ubatches=2"),
    ({"min_share": "0.4"}, "RunnerConfig.min_share must be a number, got str '0.4'; write min_share=0.4"),
    ({"max_imbalance": True},
     "RunnerConfig.max_imbalance must be a number or None (no limit), got bool True; write e.g. max_imbalance=4.0"),
])
def test_runner_config_fields_of_the_wrong_type_are_refused_naming_the_fix(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=_exactly(message)):
        RunnerConfig(**fields)


@pytest.mark.parametrize("fields, message", [
    ({"min_share": 0.9}, "min_share (0.9) must lie in [0, 0.5] (the smaller ubatch's least share of the tokens); "
                         "e.g. min_share=0.48, the default"),
    ({"min_share": math.nan}, "min_share (nan) must lie in [0, 0.5] (the smaller ubatch's least share of the tokens); "
                              "e.g. min_share=0.48, the default"),
    ({"max_imbalance": 0.5}, "max_imbalance (0.5) must be >= 1 (a max/min token ratio across DP ranks) or None (no "
                             "limit); e.g. max_imbalance=4.0"),
    # nan passed the vote's own check (nan < 1 is False) and then limited nothing
    ({"max_imbalance": math.nan}, "max_imbalance (nan) must be >= 1 (a max/min token ratio across DP ranks) or None "
                                  "(no limit); e.g. max_imbalance=4.0"),
])
def test_runner_config_numbers_out_of_range_are_refused_at_construction(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=_exactly(message)):
        RunnerConfig(**fields)
    RunnerConfig(min_share=0.0, max_imbalance=1.0)
    RunnerConfig(min_share=0.5, max_imbalance=None)


_INF, _NAN = math.inf, math.nan
_SEPARATION = "must be >= 0 (standard errors; 0 compares medians only)"
_BEHIND = "must be >= 0 (a share of the winner's time)"
_PRUNE = "must be >= 0 (a share of the incumbent's time) or None (no pruning)"
_DECISIVE = "must be > 0 (a share of the faster side's time) or None (every comparison runs its first samples pairs)"
_MIN_SHARE = "must lie in [0, 0.5] (the smaller ubatch's least share of the tokens); e.g. min_share=0.48, the default"
_IMBALANCE = "must be >= 1 (a max/min token ratio across DP ranks) or None (no limit); e.g. max_imbalance=4.0"


@pytest.mark.parametrize("config, name, value, message", [
    # every float field of both configs, at inf, -inf and nan: the range checks refuse nan and -inf
    # (and inf where the range is bounded above); where inf passed them, it is refused as never reached
    (AutoConfig, "margin", _INF, "margin (inf) must lie in [0, 1)"),
    (AutoConfig, "margin", -_INF, "margin (-inf) must lie in [0, 1)"),
    (AutoConfig, "margin", _NAN, "margin (nan) must lie in [0, 1)"),
    (AutoConfig, "separation", _INF, "separation (inf) must be finite: the standard-error test would never separate "
                                     "two configurations; e.g. separation=2.0, the default"),
    (AutoConfig, "separation", -_INF, f"separation (-inf) {_SEPARATION}"),
    (AutoConfig, "separation", _NAN, f"separation (nan) {_SEPARATION}"),
    (AutoConfig, "behind", _INF, "behind (inf) must be finite: no loser would ever be ruled behind; use a finite "
                                 "share, e.g. behind=0.15, the default (a larger one rules fewer losers behind)"),
    (AutoConfig, "behind", -_INF, f"behind (-inf) {_BEHIND}"),
    (AutoConfig, "behind", _NAN, f"behind (nan) {_BEHIND}"),
    (AutoConfig, "prune", _INF, "prune (inf) must be finite: it would prune nothing; use prune=None to try every "
                                "variant"),
    (AutoConfig, "prune", -_INF, f"prune (-inf) {_PRUNE}"),
    (AutoConfig, "prune", _NAN, f"prune (nan) {_PRUNE}"),
    (AutoConfig, "decisive", _INF, "decisive (inf) must be finite: no comparison would be decisive; use "
                                   "decisive=None to turn decisive comparisons off"),
    (AutoConfig, "decisive", -_INF, f"decisive (-inf) {_DECISIVE}"),
    (AutoConfig, "decisive", _NAN, f"decisive (nan) {_DECISIVE}"),
    (RunnerConfig, "min_share", _INF, f"min_share (inf) {_MIN_SHARE}"),
    (RunnerConfig, "min_share", -_INF, f"min_share (-inf) {_MIN_SHARE}"),
    (RunnerConfig, "min_share", _NAN, f"min_share (nan) {_MIN_SHARE}"),
    (RunnerConfig, "max_imbalance", _INF, "max_imbalance (inf) must be finite: no ratio would reach it; use "
                                          "max_imbalance=None for no limit"),
    (RunnerConfig, "max_imbalance", -_INF, f"max_imbalance (-inf) {_IMBALANCE}"),
    (RunnerConfig, "max_imbalance", _NAN, f"max_imbalance (nan) {_IMBALANCE}"),
])
def test_float_fields_refuse_values_that_are_not_finite(config: type, name: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=_exactly(message)):
        config(**{name: value})


def test_the_never_reached_values_have_their_spelling() -> None:
    assert (AutoConfig(prune=None, decisive=None).prune, RunnerConfig(max_imbalance=None).max_imbalance) == (None, None)
    np = pytest.importorskip("numpy")  # numpy's inf is refused as Python's is
    with pytest.raises(ValueError, match=re.escape("decisive (inf) must be finite")):
        AutoConfig(decisive=np.float64("inf"))


class _Four(ClockedModel):
    max_ubatches = 4


def test_a_pin_the_model_cannot_run_is_refused_at_runner_construction_naming_the_pin() -> None:
    cfg = RunnerConfig(tuning="auto", auto=AutoConfig(pin=(("mixed 64-127", Arm(5)),)))
    with pytest.raises(ValueError, match=_exactly(
            "AutoConfig.pin pins 'mixed 64-127' to N=5 token auto (5 ubatches) but the model's MoE layers were "
            "built for max_ubatches=4; build them with max_ubatches >= 5 or pin at most 4 ubatches")):
        DBORunner(_Four(VirtualClock(), {}), cfg)
    DBORunner(_Four(VirtualClock(), {}), RunnerConfig(tuning="auto", auto=AutoConfig(pin=(("mixed 64-127", Arm(4)),))))


# ------------------------------------------------------------------- A6: an infeasible pin falls back


def test_a_pin_this_step_cannot_split_chooses_off_and_says_so() -> None:
    pin = Arm(2, "request")
    policy = AutoPolicy(AutoConfig(pin=(("mixed 64-127", pin),)), prior=lambda bucket: OFF)
    assert policy.choose("mixed 64-127", lambda arm: arm != pin) == (
        OFF, "mixed 64-127: pinned N=2 request auto (AutoConfig.pin) cannot split this batch (a request split "
             "leaves a ubatch without real tokens), off")
    assert policy.choose("mixed 64-127") == (pin, "mixed 64-127: pinned by AutoConfig.pin")


@pytest.mark.asyncio
async def test_a_pinned_request_split_that_would_leave_a_ubatch_empty_runs_off_as_a_fixed_runner_does() -> None:
    clock = VirtualClock()
    model = ClockedModel(clock, {n: 1.0e-3 for n in (1, 2, 3, 4)})
    cfg = RunnerConfig(tuning="auto", auto=AutoConfig(pin=(("mixed 64-127", Arm(2, "request")),)))
    runner = DBORunner(model, cfg, clock=clock)
    builder = BatchBuilder(CACHE)
    one = (await runner.step(builder.build([(0, [1] * 80)]))).record  # one request: a request split leaves one ubatch empty
    builder.reset()
    two = (await runner.step(builder.build([(0, [1] * 40), (1, [1] * 40)]))).record
    assert (one.config, one.microbatched, one.reason, one.ubatch_num_tokens) == (
        "off", False, PlanReason.POLICY_REFUSED, (80,))
    assert one.detail == one.evidence == (
        "mixed 64-127: pinned N=2 request auto (AutoConfig.pin) cannot split this batch (a request split leaves a "
        "ubatch without real tokens), off")
    assert (two.config, two.microbatched, two.reason, two.ubatch_num_tokens) == (
        "N=2 request auto", True, PlanReason.MICROBATCHED, (40, 40))
    assert runner.stats.summary() == "2 steps, 50% microbatched; policy_refused=1"
    fixed = DBORunner(model, RunnerConfig(policy="request", thresholds=ThresholdConfig(prefill_threshold=16)),
                      clock=clock)
    builder.reset()
    rec = (await fixed.step(builder.build([(0, [1] * 80)]))).record
    assert (rec.config, rec.microbatched, rec.reason, rec.ubatch_num_tokens) == (
        "off", False, PlanReason.POLICY_REFUSED, (80,))


def test_a_choice_this_step_cannot_split_runs_off_and_names_the_refused_configuration() -> None:
    space = AutoConfig(ubatch_counts=(2,), splits=("request",), dispatches=("auto",), max_arms=0)
    n2 = Arm(2, "request")
    policy = AutoPolicy(space, prior=lambda bucket: n2)
    policy.observe("mixed 64-127", n2, 1.0e-6)  # its warm-up step
    assert policy.choose_refused("mixed 64-127") == (n2, "mixed 64-127: best N=2 request auto (prior, unmeasured)", None)
    assert policy.choose_refused("mixed 64-127", lambda arm: arm != n2) == (
        OFF, "mixed 64-127: N=2 request auto cannot split this batch (a request split leaves a ubatch without real "
             "tokens), off; best N=2 request auto (prior, unmeasured)", n2)
    assert policy.choose("mixed 64-127", lambda arm: arm != n2) == policy.choose_refused(
        "mixed 64-127", lambda arm: arm != n2)[:2]
    pinned = AutoPolicy(AutoConfig(pin=(("mixed 64-127", n2),)), prior=lambda bucket: OFF)
    assert pinned.choose_refused("mixed 64-127", lambda arm: arm != n2)[::2] == (OFF, n2)


@pytest.mark.asyncio
async def test_an_auto_choice_that_cannot_split_the_batch_is_recorded_as_policy_refused_not_auto_off() -> None:
    # The bucket's choice is N = 2 with the request split (its prior; nothing else to try): a step
    # of one request cannot be split that way and runs off, recorded as the split policy's refusal,
    # as a fixed runner with that policy records it, not as if the measurements had chosen off.
    clock = VirtualClock()
    model = ClockedModel(clock, {n: 1.0e-3 for n in (1, 2, 3, 4)})
    space = AutoConfig(ubatch_counts=(2,), splits=("request",), dispatches=("auto",), max_arms=0)
    runner = DBORunner(model, RunnerConfig(tuning="auto", thresholds=ThresholdConfig(prefill_threshold=16), auto=space),
                       clock=clock)
    builder = BatchBuilder(CACHE)
    two = (await runner.step(builder.build([(0, [1] * 40), (1, [1] * 40)]))).record
    builder.reset()
    one = (await runner.step(builder.build([(0, [1] * 80)]))).record
    assert (two.config, two.reason) == ("N=2 request auto", PlanReason.MICROBATCHED)
    assert (one.config, one.microbatched, one.reason, one.ubatch_num_tokens) == (
        "off", False, PlanReason.POLICY_REFUSED, (80,))
    assert one.detail == one.evidence == (
        "mixed 64-127: N=2 request auto cannot split this batch (a request split leaves a ubatch without real "
        "tokens), off; best N=2 request auto (prior, unmeasured)")  # its one step was its warm-up
    assert runner.stats.summary() == "2 steps, 50% microbatched; policy_refused=1"
    # It ran off out of the schedule's turn: the next step feeds the policy nothing for it (an off
    # sample there would enter a comparison with off as if off had had its turn)
    builder.reset()
    await runner.step(builder.build([(0, [1] * 40), (1, [1] * 40)]))
    assert runner.auto is not None
    bucket = runner.auto.buckets["mixed 64-127"]
    assert bucket.seen == {Arm(2, "request"): 1} and OFF not in bucket.samples
    fixed = DBORunner(model, RunnerConfig(policy="request", thresholds=ThresholdConfig(prefill_threshold=16)),
                      clock=clock)
    builder.reset()
    assert (await fixed.step(builder.build([(0, [1] * 80)]))).record.reason is PlanReason.POLICY_REFUSED


# ------------------------------------------------------------------- A10, A11: the model, the step's arguments


class _SyncForward:
    def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> torch.Tensor:
        return torch.zeros(ids_T.numel(), 8)


def test_a_model_without_a_callable_forward_is_refused_at_construction() -> None:
    for model, name in ((object(), "object"), (type("NotCallable", (), {"forward": 3})(), "NotCallable")):
        with pytest.raises(TypeError, match=_exactly(
                "DBORunner needs a model with an async forward(input_ids_T, positions_T, attn) method; "
                f"{name} has no callable forward")):
            DBORunner(model, RunnerConfig(tuning="auto"))


@pytest.mark.asyncio
async def test_a_forward_that_returns_no_awaitable_is_refused_naming_the_model() -> None:
    runner = DBORunner(_SyncForward(), RunnerConfig(backend="host"))
    with pytest.raises(TypeError, match=_exactly(
            "_SyncForward.forward returned Tensor, not an awaitable: DBORunner awaits it once per ubatch under "
            "the DBO loop; write `async def forward(self, input_ids_T, positions_T, attn)` (its yield points "
            "hand the CPU to the other ubatches)\nasyncdbo: raised in ubatch 0 of 2 while running (last yield point "
            "None); the other ubatches were cancelled")):  # the kernel's note (pytest matches the notes too)
        await runner.step(decode_batches(BatchBuilder(CACHE), [40])[0])
    assert runner.stats.summary() == "0 steps, 0% microbatched"
    assert runner.report() == "0 steps; 1 failed step(s) not counted"


@pytest.mark.asyncio
@pytest.mark.parametrize("tuning", ["fixed", "auto"])
async def test_step_arguments_are_checked_before_the_step_is_voted_or_counted(tuning: str) -> None:
    clock = VirtualClock()
    runner = DBORunner(ClockedModel(clock, {n: 1.0e-3 for n in (1, 2, 3, 4)}),
                       RunnerConfig(tuning=tuning, thresholds=ThresholdConfig(decode_threshold=32)),  # type: ignore[arg-type]
                       clock=clock)
    with pytest.raises(TypeError, match=_exactly(
            "step() takes an asyncdbo.serving.Batch, got Tensor; build one with asyncdbo.serving.BatchBuilder("
            "kv_cache_config).build([(request_id, new_token_ids), ...])")):
        await runner.step(torch.arange(8))  # type: ignore[arg-type]
    batch = decode_batches(BatchBuilder(CACHE), [40])[0]
    for bad in ("tracer", ["tracer"], 3):
        with pytest.raises(TypeError, match=_exactly(
                f"instrument must be an asyncdbo.lowlevel.Instrument, a list of them, or None (got {bad!r}); "
                "subclass Instrument and override the hooks you need")):
            await runner.step(batch, instrument=bad)  # type: ignore[arg-type]
    for bad in ("no", 1):
        with pytest.raises(TypeError, match=_exactly(
                f"DBORunner.step() enabled must be True, False or None (None: RunnerConfig.enabled), got "
                f"{type(bad).__name__} {bad!r}; use True or False")):
            await runner.step(batch, enabled=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=_exactly(
            "Engine enabled must be True, False or None (None: RunnerConfig.enabled), got str 'yes'; use True or False")):
        Engine(runner, BatchBuilder(CACHE), enabled="yes")  # type: ignore[arg-type]
    assert (runner.stats.num_steps, runner.ledger.num_steps, runner.ledger.failed) == (0, 0, 0)

    class Runs(Instrument):
        def __init__(self) -> None:
            self.runs = 0

        def run_started(self, run: Any) -> None:
            self.runs += 1

    a, b = Runs(), Runs()
    rec = (await runner.step(batch, instrument=[a, b])).record
    rec2 = (await runner.step(batch, instrument=a)).record
    assert (rec.step, rec.microbatched, rec2.step, a.runs, b.runs) == (0, True, 1, 2, 1)
    assert runner.stats.num_steps == runner.ledger.num_steps == 2


# ------------------------------------------------------------------- A12: failed steps


class _FailsOn(ClockedModel):
    """Raises in the forward calls numbered in ``fail`` (1-based, every ubatch's call counted)."""

    def __init__(self, clock: VirtualClock, fail: set[int]) -> None:
        super().__init__(clock, {n: 1.0e-3 for n in (1, 2, 3, 4)})
        self.calls, self.fail = 0, fail

    async def forward(self, ids_T: torch.Tensor, pos_T: torch.Tensor, attn: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError("expert kernel failed")
        return await super().forward(ids_T, pos_T, attn)


@pytest.mark.asyncio
async def test_failed_steps_count_in_neither_stats_nor_report_and_report_says_how_many_failed() -> None:
    clock = VirtualClock()
    runner = DBORunner(_FailsOn(clock, fail={3, 5}), RunnerConfig(backend="host", thresholds=ThresholdConfig(
        decode_threshold=32)), clock=clock)
    records, failures = [], 0
    for batch in decode_batches(BatchBuilder(CACHE), [40] * 4):
        try:
            records.append((await runner.step(batch)).record)
        except RuntimeError as exc:
            assert str(exc) == "expert kernel failed"
            failures += 1
    assert failures == 2 and [r.step for r in records] == [0, 3]  # a step's number counts the failed ones too
    assert runner.stats.summary() == "2 steps, 100% microbatched"
    assert runner.stats.last == records[-1]  # with its timing, as the step returned it
    assert runner.report() == "2 steps: N=2 token auto 2 steps 1000.0 us/token; 2 failed step(s) not counted"


@pytest.mark.asyncio
async def test_the_runner_gives_each_ubatch_the_steps_max_seq_len_where_asked_and_refuses_an_unknown_rule() -> None:
    class Recording:
        """Logits of zeros; keeps each ubatch's attention metadata."""

        def __init__(self) -> None:
            self.seen: list[int] = []

        async def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, attn: Any) -> torch.Tensor:
            self.seen.append(attn.max_seq_len)
            await dbo_yield("layer")
            return torch.zeros(input_ids_T.shape[0], 8)

    always = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
    for rule, want in (("ubatch", [4, 12]), ("batch", [12, 12])):
        model = Recording()
        batch = BatchBuilder(CACHE).build([(0, [1] * 4), (1, [1] * 12)])  # a 4-token and a 12-token prompt
        await DBORunner(model, RunnerConfig(thresholds=always, max_seq_len=rule)).step(batch)
        assert model.seen == want, rule
    with pytest.raises(ValueError) as err:
        RunnerConfig(max_seq_len="graph")
    assert str(err.value) == ("RunnerConfig max_seq_len='graph': use 'ubatch' (each ubatch's own longest request, the "
                              "default) or 'batch' (the whole batch's in every ubatch, vLLM's rule, for graphs "
                              "captured per batch)")
