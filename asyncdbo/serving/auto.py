"""The ``"auto"`` tuning: per step-shape bucket, the configuration the measurements favour.

A *configuration* (:class:`Arm`) is whether to microbatch and how: the ubatch count N (1 is
off), the split policy and the MoE dispatch mode. :class:`AutoPolicy` keeps, per shape bucket
(:func:`~asyncdbo.serving.measure.shape_bucket`), the time per real token each configuration
measured, and chooses the next step's configuration from them:

1. **Prior.** A new bucket starts from today's fixed rule: the configured thresholds say whether
   a step of this shape microbatches (then N = 2, the token split, ``dispatch="auto"``, which
   prices fused against split dispatch on the run's link model), or not (off).
2. **Bounded exploration.** It then runs each configuration of a fixed schedule (the prior, its
   opposite on/off, the other ubatch counts, the other split policies, the other dispatch modes)
   for ``warmup + samples`` steps of that bucket, at most ``max_arms`` of them beyond the prior.
   It climbs (``AutoConfig.climb``): a larger ubatch count is tried only while the next smaller
   one leads, another split or dispatch mode only while DBO leads off, so a bucket where DBO loses
   spends its exploration on two configurations. The schedule is a pure function of the bucket's
   history, never of a random draw.
3. **Hysteresis.** A configuration is judged once, when its samples are complete: it replaces
   the incumbent only if the median of its samples is more than ``margin`` below the incumbent's
   (so near-ties never flip, and the earlier configuration of the schedule, the prior first, wins
   them). After exploring, the choice stays; the incumbent keeps its last ``window`` samples as
   evidence.

Every input is shared by the DP group (the runner exchanges each rank's last step time in the one
vote of the step and feeds the group's slowest), so every rank holds the same account and makes the
same choice: the policy itself never talks to another rank. The choice and its evidence go into
the step's record.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..dist.fused import DISPATCH_MODES, DispatchMode
from ..plan import DPDecision, SplitPolicy, ThresholdConfig, plan_slices
from ..plan.slices import SPLIT_POLICIES
from .measure import shape_bucket

__all__ = ["Arm", "AutoConfig", "AutoPolicy", "OFF", "choose_for_group", "splittable_mask", "threshold_prior"]


@dataclass(frozen=True, order=True)
class Arm:
    """One configuration: ``num_ubatches`` (1: DBO off), the split policy, the dispatch mode."""

    num_ubatches: int
    split: SplitPolicy = "token"
    dispatch: DispatchMode = "auto"

    @property
    def label(self) -> str:
        """``'off'`` or e.g. ``'N=2 token auto'`` (what :attr:`StepRecord.config` says)."""
        return "off" if self.num_ubatches == 1 else f"N={self.num_ubatches} {self.split} {self.dispatch}"


OFF = Arm(1)


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """The ``"auto"`` tuning's search space and guards (see the module docstring).

    ``ubatch_counts``, ``splits``, ``dispatches``: the configurations it may try. ``samples``: the
    measured steps of a configuration judged by their median; ``warmup``: its first steps in a
    bucket, not counted (caches, allocator). ``margin``: how much faster (a share) a configuration
    must be to replace the incumbent. ``max_arms``: configurations tried per bucket beyond the
    prior. ``window``: the incumbent's recent samples kept. ``pin``: ``(bucket, Arm)`` pairs that
    override the choice for those buckets (e.g. ``(("decode 64-127", OFF),)``). ``climb``: explore
    a larger ubatch count only while the next smaller one of the same split and dispatch leads,
    and the other splits and dispatch modes only while DBO leads off (a bucket where the first DBO
    configuration loses to off then explores two configurations, not the whole schedule); False
    tries every configuration of the schedule.
    """

    ubatch_counts: tuple[int, ...] = (2, 3, 4)
    splits: tuple[SplitPolicy, ...] = ("token", "balanced")
    dispatches: tuple[DispatchMode, ...] = ("auto", "split")
    samples: int = 3
    warmup: int = 1
    margin: float = 0.03
    max_arms: int = 6
    window: int = 8
    pin: tuple[tuple[str, Arm], ...] = ()
    climb: bool = True

    def __post_init__(self) -> None:
        if not self.ubatch_counts or any(n < 2 for n in self.ubatch_counts):
            raise ValueError(f"ubatch_counts {self.ubatch_counts!r} must be ubatch counts >= 2 (off is always a candidate)")
        bad = [s for s in self.splits if s not in SPLIT_POLICIES]
        if not self.splits or bad:
            raise ValueError(f"splits {self.splits!r}: use some of {SPLIT_POLICIES}")
        bad_d = [d for d in self.dispatches if d not in DISPATCH_MODES]
        if not self.dispatches or bad_d:
            raise ValueError(f"dispatches {self.dispatches!r}: use some of {DISPATCH_MODES}")
        if self.samples < 1 or self.warmup < 0 or self.window < self.samples:
            raise ValueError(
                f"samples ({self.samples}) must be >= 1, warmup ({self.warmup}) >= 0 and window ({self.window}) "
                f">= samples")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin ({self.margin}) must lie in [0, 1)")
        if self.max_arms < 0:
            raise ValueError(f"max_arms ({self.max_arms}) must be >= 0")

    @property
    def max_ubatches(self) -> int:
        return max(self.ubatch_counts)

    def arms(self) -> list[Arm]:
        """Every configuration it may choose, in a fixed order (the feasibility mask's bits)."""
        return [OFF] + [Arm(n, s, d) for n in self.ubatch_counts for s in self.splits for d in self.dispatches]


@dataclass
class _Bucket:
    schedule: list[Arm]
    incumbent: Arm
    seen: dict[Arm, int] = field(default_factory=dict)  # steps run, warm-ups included
    samples: dict[Arm, deque[float]] = field(default_factory=dict)
    switches: int = 0


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


class AutoPolicy:
    """The per-bucket account and choice (pure: the same calls give the same choices).

    ``prior(bucket)`` gives a new bucket's first configuration. Call :meth:`choose` before a step
    and :meth:`observe` with what the step cost (seconds per real token) after it."""

    def __init__(self, cfg: AutoConfig, prior: Callable[[str], Arm]) -> None:
        self.cfg = cfg
        self.prior = prior
        self.buckets: dict[str, _Bucket] = {}
        self._pins = dict(cfg.pin)

    def _schedule(self, prior: Arm) -> list[Arm]:
        cfg = self.cfg
        base = prior if prior != OFF else Arm(cfg.ubatch_counts[0], cfg.splits[0], cfg.dispatches[0])
        order = [prior, OFF, base]
        order += [Arm(n, base.split, base.dispatch) for n in cfg.ubatch_counts]
        order += [Arm(base.num_ubatches, s, base.dispatch) for s in cfg.splits]
        order += [Arm(base.num_ubatches, base.split, d) for d in cfg.dispatches]
        out: list[Arm] = []
        for arm in order:
            if arm not in out:
                out.append(arm)
        return out[: 1 + cfg.max_arms]

    def bucket(self, name: str) -> _Bucket:
        b = self.buckets.get(name)
        if b is None:
            prior = self.prior(name)
            b = self.buckets[name] = _Bucket(schedule=self._schedule(prior), incumbent=prior)
        return b

    def choose(self, name: str, feasible: Callable[[Arm], bool] = lambda arm: True) -> tuple[Arm, str]:
        """The configuration for the next step of bucket ``name`` and why. ``feasible(arm)``:
        whether every rank can run it this step (a split policy may refuse a batch)."""
        pinned = self._pins.get(name)
        if pinned is not None:
            return pinned, f"{name}: pinned by AutoConfig.pin"
        b = self.bucket(name)
        need = self.cfg.warmup + self.cfg.samples
        for i, arm in enumerate(b.schedule):
            if b.seen.get(arm, 0) < need and feasible(arm) and self._worth(b, arm):
                return arm, f"{name}: exploring {i + 1}/{len(b.schedule)} ({b.seen.get(arm, 0) + 1}/{need}); {self.evidence(name)}"
        arm = b.incumbent
        if not feasible(arm):
            return OFF, f"{name}: {arm.label} cannot split this batch, off; {self.evidence(name)}"
        return arm, f"{name}: {self.evidence(name)}"

    def _worth(self, b: _Bucket, arm: Arm) -> bool:
        """Whether exploring ``arm`` can still pay, given the incumbent (``AutoConfig.climb``): the
        prior and its opposite (the schedule's first two) always; N = k only while the next smaller
        count of the same split and dispatch leads; another split or dispatch at the smallest
        count only while DBO leads off."""
        cfg = self.cfg
        if not cfg.climb or arm in b.schedule[:2]:
            return True
        smaller = [n for n in cfg.ubatch_counts if n < arm.num_ubatches]
        if not smaller:
            return b.incumbent != OFF
        return b.incumbent == Arm(max(smaller), arm.split, arm.dispatch)

    def evidence(self, name: str) -> str:
        """The bucket's medians, e.g. ``'best N=2 token auto 41.2 us/token (3); off 48.0 (3)'``."""
        b = self.bucket(name)
        parts = [f"{b.incumbent.label} {_median(b.samples[b.incumbent]) * 1e6:.2f} us/token ({len(b.samples[b.incumbent])})"
                 if b.samples.get(b.incumbent) else f"{b.incumbent.label} (prior, unmeasured)"]
        for arm in b.schedule:
            xs = b.samples.get(arm)
            if arm != b.incumbent and xs:
                parts.append(f"{arm.label} {_median(xs) * 1e6:.2f} ({len(xs)})")
        return "best " + "; ".join(parts)

    def observe(self, name: str, arm: Arm, seconds_per_token: float) -> None:
        """A step of bucket ``name`` ran ``arm`` and cost ``seconds_per_token`` (the group's)."""
        if name in self._pins:
            return
        b = self.bucket(name)
        n = b.seen[arm] = b.seen.get(arm, 0) + 1
        if n <= self.cfg.warmup:
            return
        xs = b.samples.get(arm)
        if xs is None:
            xs = b.samples[arm] = deque(maxlen=self.cfg.window)
        xs.append(seconds_per_token)
        if len(xs) == self.cfg.samples:  # judged once, when its samples are complete: no flapping later
            self._judge(b)

    def _judge(self, b: _Bucket) -> None:
        """Replace the incumbent by the configurations (schedule order) whose medians are each more
        than ``margin`` below the best so far. An unjudged incumbent (the prior, before its
        samples) is never replaced."""
        cfg = self.cfg
        inc = b.samples.get(b.incumbent)
        if inc is None or len(inc) < cfg.samples:
            return
        best, best_t = b.incumbent, _median(inc)
        for arm in b.schedule:
            xs = b.samples.get(arm)
            if arm == best or xs is None or len(xs) < cfg.samples:
                continue
            t = _median(xs)
            if t < best_t * (1.0 - cfg.margin):
                best, best_t = arm, t
        if best != b.incumbent:
            b.incumbent = best
            b.switches += 1


def threshold_prior(thresholds: ThresholdConfig, cfg: AutoConfig) -> Callable[[str], Arm]:
    """The prior of :class:`AutoPolicy` that both the runner and ``asyncdbo check --workload`` use:
    a bucket starts from what the fixed ``thresholds`` would run for a step of that bucket's
    smallest size (N = 2, the first split and dispatch of ``cfg``), or off."""

    def prior(bucket: str) -> Arm:
        kind, _, rng = bucket.partition(" ")
        lo = int(rng.split("-")[0]) if rng else 0
        if lo >= (thresholds.decode_threshold if kind == "decode" else thresholds.prefill_threshold):
            return Arm(2 if 2 in cfg.ubatch_counts else cfg.ubatch_counts[0], cfg.splits[0], cfg.dispatches[0])
        return OFF

    return prior


def splittable_mask(qsl: Sequence[int], arms: Sequence[Arm], min_share: float) -> int:
    """Bit ``i`` set where this rank's batch (token offsets ``qsl``) can run ``arms[i]``: off and
    the token split always can (and an idle rank runs anything); a request-aligned split cannot
    where it would leave a ubatch without real tokens. One int, so it rides in the DP vote."""
    offsets = list(qsl)
    mask = 0
    for bit, arm in enumerate(arms):
        if arm == OFF or arm.split == "token" or offsets[-1] == 0 or 0 not in [
                sl.num_tokens for sl in plan_slices(offsets, arm.num_ubatches, arm.split, min_share=min_share)]:
            mask |= 1 << bit
    return mask


def choose_for_group(policy: AutoPolicy, arms: Sequence[Arm], decision: DPDecision, uniform_R: Sequence[int],
                     mask_R: Sequence[int]) -> tuple[str, Arm, str]:
    """The group's step: its shape bucket (from the largest rank's real tokens, decode when every
    busy rank's batch is uniform decode), the configuration and the evidence. ``uniform_R`` and
    ``mask_R`` hold each rank's :func:`~asyncdbo.plan.is_uniform_decode` and
    :func:`splittable_mask`, as the DP vote gathered them. A decision that does not microbatch
    (every rank idle, a rank disabled, imbalance) runs off with no evidence. Pure: every rank
    (and the simulator) derives the same choice from the same vote."""
    busy = [r for r, v in enumerate(decision.ranks) if v.vote != "idle"]
    bucket = shape_bucket(max(decision.num_tokens_across_dp, default=0), bool(busy) and all(uniform_R[r] for r in busy))
    if not decision.should_ubatch:
        return bucket, OFF, ""
    group_mask = -1
    for r in busy:
        group_mask &= mask_R[r]
    arm, evidence = policy.choose(bucket, lambda a: bool(group_mask >> arms.index(a) & 1))
    return bucket, arm, evidence
