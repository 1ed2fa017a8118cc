"""The runner's ``"auto"`` tuning replayed on the simulated device, beside DBO off and the fixed
thresholds: what ``asyncdbo check --workload --policy off,fixed,auto`` prints.

The choice is the runner's own code (:mod:`asyncdbo.serving.auto`): the same
:class:`~asyncdbo.serving.AutoPolicy`, the same prior from the thresholds
(:func:`~asyncdbo.serving.auto.threshold_prior`), the same split feasibility per rank
(:func:`~asyncdbo.serving.auto.splittable_mask`) and the same group choice from the DP vote
(:func:`~asyncdbo.serving.auto.group_choice`). What differs is where the measurement comes
from: the runner feeds each step's slowest-rank wall time per real token of the largest rank; the
replay feeds the slowest rank's simulated MoE-layer time per real token of the largest rank
(:class:`~asyncdbo.sim.workload.StepSims`), so the policy sees the sim's step costs where it would
see the clock's. Exploration, hysteresis and the evidence are then exactly the runner's.

The sim does not model the fused dispatch (the counts riding in the token message): the layers
send them apart, so the replay's search space has ``dispatches=("split",)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..plan import PlanReason, RankVote, ThresholdConfig, decide_from_votes, is_uniform_decode, plan_step
from ..serving.auto import (
    OFF,
    Arm,
    AutoConfig,
    AutoPolicy,
    group_choice,
    splittable_mask,
    threshold_prior,
)
from ..serving.measure import shape_bucket
from .workload import ReplayResult, Step, StepOutcome, StepSims, _cumsum, step_shape

__all__ = ["AutoReplay", "BelowBreakEven", "POLICIES", "SIM_AUTO", "below_break_even", "replay_auto", "step_bucket"]

#: What ``--policy`` accepts: DBO off (every step unsplit), the fixed thresholds, the ``"auto"`` tuning.
POLICIES = ("off", "fixed", "auto")

#: The ``"auto"`` search space on the sim: the runner's default but for the dispatch mode (above).
SIM_AUTO = AutoConfig(dispatches=("split",))


def _qsls(step: Step) -> list[list[int]]:
    return [[0, *_cumsum(q for q, _ in reqs)] for reqs in step]


def step_bucket(step: Step, num_spec_tokens: int = 0) -> str:
    """The runner's shape bucket of a replayed step: the largest rank's real tokens, ``decode`` when
    every busy rank's batch is uniform decode (:func:`~asyncdbo.serving.measure.shape_bucket`)."""
    qsls = _qsls(step)
    busy = [q for q in qsls if q[-1] > 0]
    return shape_bucket(max((q[-1] for q in qsls), default=0),
                        bool(busy) and all(is_uniform_decode(q, num_spec_tokens) for q in busy))


@dataclass
class AutoReplay(ReplayResult):
    """A replay under ``"auto"``: each step's outcome, plus per step ``(bucket, arm, evidence)``
    as the runner's record would carry them, and the policy's account at the end."""

    choices: list[tuple[str, Arm, str]] = field(default_factory=list)
    policy: AutoPolicy | None = None

    def exploring(self) -> int:
        """Steps the policy ran while still exploring its bucket's schedule."""
        return sum(": exploring " in evidence for _, _, evidence in self.choices)

    def buckets(self) -> dict[str, tuple[int, int]]:
        """Per bucket, in order of first appearance: ``(steps, steps while exploring)``."""
        out: dict[str, tuple[int, int]] = {}
        for bucket, _, evidence in self.choices:
            steps, exploring = out.get(bucket, (0, 0))
            out[bucket] = (steps + 1, exploring + (": exploring " in evidence))
        return out


def replay_auto(steps: Sequence[Step], *, sims: StepSims, thresholds: ThresholdConfig = ThresholdConfig(),
                cfg: AutoConfig = SIM_AUTO, min_share: float = 0.48,
                on_step: Callable[[int, int], None] | None = None,
                prior: Callable[[str], Arm] | None = None) -> AutoReplay:
    """Replay ``steps`` under the ``"auto"`` tuning (module docstring): per step, every rank votes
    yes (idle ranks idle) with its uniform-decode flag and split feasibility, the policy chooses
    the group's configuration, each rank is simulated under it, and the slowest rank's time per
    real token of the largest rank is what the policy observes for that bucket and configuration.
    ``prior``: each new bucket's first configuration (default: the runner's, from ``thresholds``)."""
    arms = cfg.arms()
    policy = AutoPolicy(cfg, prior if prior is not None else threshold_prior(thresholds, cfg))
    result = AutoReplay(policy=policy)
    before = sims.simulations
    for i, step in enumerate(steps):
        if on_step is not None:
            on_step(i + 1, len(steps))
        qsls = _qsls(step)
        votes = [RankVote(r, "idle" if q[-1] == 0 else "yes", PlanReason.MICROBATCHED, q[-1], q[-1])
                 for r, q in enumerate(qsls)]
        decision = decide_from_votes(votes)
        uniform_R = [int(is_uniform_decode(q, thresholds.num_spec_tokens)) for q in qsls]
        mask_R = [splittable_mask(q, arms, min_share) for q in qsls]
        bucket, arm, evidence, refused = group_choice(policy, arms, decision, uniform_R, mask_R)
        shape = step_shape(step)
        serial = [sims.serial(reqs, shape) for reqs in step]
        if arm == OFF:
            ran = serial
        else:
            ran = []
            for reqs, q in zip(step, qsls):
                plan = plan_step(q, num_ubatches=arm.num_ubatches, policy=arm.split, is_idle=q[-1] == 0,
                                 decision=decision, min_share=min_share)
                ran.append(sims.split(reqs, [s.num_tokens_padded for s in plan.slices], shape))
        tokens = tuple(q[-1] for q in qsls)
        step_s = max(ran, default=0.0)
        if max(tokens, default=0) > 0 and refused is None:  # as the runner: a refused step is no sample
            policy.observe(bucket, arm, step_s / max(tokens))
        microbatched = arm != OFF
        reason = (PlanReason.MICROBATCHED if microbatched else decision.reason if not decision.should_ubatch
                  else PlanReason.AUTO_OFF if refused is None else PlanReason.POLICY_REFUSED)  # as the runner records it
        result.steps.append(StepOutcome(microbatched, reason, evidence or decision.detail, tokens,
                                        max(serial, default=0.0), step_s, ()))
        result.choices.append((bucket, arm, evidence))
    result.simulations = sims.simulations - before
    return result


@dataclass(frozen=True)
class BelowBreakEven:
    """A shape bucket where the fixed thresholds microbatched, and DBO ran slower than off."""

    bucket: str
    steps: int
    speedup: float  # off's time over the microbatched time, summed over those steps (< 1)


def below_break_even(steps: Sequence[Step], fixed: ReplayResult, num_spec_tokens: int = 0) -> list[BelowBreakEven]:
    """The buckets where ``fixed`` (a replay of ``steps`` under the thresholds) microbatched below
    break-even: over its microbatched steps of the bucket, the serial time over the DBO time < 1."""
    sums: dict[str, list[float]] = {}
    for step, outcome in zip(steps, fixed.steps):
        if outcome.microbatched:
            acc = sums.setdefault(step_bucket(step, num_spec_tokens), [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += outcome.serial_s
            acc[2] += outcome.dbo_s
    return [BelowBreakEven(bucket, int(n), serial / dbo) for bucket, (n, serial, dbo) in sums.items() if serial < dbo]
