"""The ``"auto"`` tuning: per step-shape bucket, the configuration the measurements favour.

A *configuration* (:class:`Arm`) is whether to microbatch and how: the ubatch count N (1 is
off), the split policy and the MoE dispatch mode. :class:`AutoPolicy` keeps, per shape bucket
(:func:`~asyncdbo.serving.measure.shape_bucket`), the time per real token each configuration
measured, and chooses the next step's configuration from them:

1. **Prior.** A new bucket starts from today's fixed rule: the configured thresholds say whether
   a step of this shape microbatches (then N = 2, the token split, ``dispatch="auto"``, which
   prices fused against split dispatch on the run's link model), or not (off).
2. **Bounded exploration.** It then tries the configurations of a fixed schedule (the prior, its
   opposite on/off, the other ubatch counts, the other split policies, the other dispatch modes),
   at most ``max_arms`` of them beyond the prior, one at a time against the incumbent, each for
   ``warmup + samples`` steps of that bucket and then, while the two do not separate (below),
   more steps of whichever of the two has fewer samples, up to ``max_samples`` each. It climbs
   (``AutoConfig.climb``): a larger ubatch count is tried only where the next smaller one leads or
   tied (was not clearly slower), another split or dispatch mode only where DBO leads off or tied with it, so a
   bucket where DBO clearly loses spends its exploration on two configurations, and a loss within
   the noise does not end the climb. A bucket explores at most ``(1 + max_arms) * (warmup +
   max_samples)`` steps. The schedule is a pure function of the bucket's history, never of a
   random draw.
3. **Noise-aware comparison** (:func:`compare`). Two configurations are compared on the medians
   of their samples, with the medians' standard error from the interquartile ranges (robust to an
   outlier step) or the bucket's pooled spread, whichever is larger. The *default* side, off where
   off is one of the two, else the incumbent, keeps the choice unless the other's median is below
   it by more than ``margin`` (a share) and by more than ``separation`` standard errors (as
   Student's t for the samples' degrees of freedom, and higher at the early looks of the
   sequential test). The comparison ends early once even the gain plus that many standard errors
   stays within the margin; one still not separated at ``max_samples`` each is a tie, and ties go
   to the default. So DBO runs only where it is clearly faster than off, and a near-tie never
   flips a choice. After the schedule the choice stays; the incumbent keeps its last ``window``
   samples.

Every input is shared by the DP group (the runner exchanges each rank's last step time in the one
vote of the step and feeds the group's slowest), so every rank holds the same account and makes the
same choice: the policy itself never talks to another rank. The choice and its evidence (medians,
spreads, sample counts and the verdicts) go into the step's record.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..dist.fused import DISPATCH_MODES, DispatchMode
from ..plan import DPDecision, SplitPolicy, ThresholdConfig, plan_slices
from ..plan.slices import SPLIT_POLICIES
from .measure import shape_bucket

__all__ = ["Arm", "AutoConfig", "AutoPolicy", "Comparison", "OFF", "choose_for_group", "compare", "pooled_sigma",
           "relative_sigma", "splittable_mask", "threshold_prior"]


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
    measured steps of a configuration before it is first compared; ``max_samples``: at most this
    many while the comparison does not separate; ``warmup``: a configuration's first steps in a
    bucket, not counted (caches, allocator). ``margin``: how much faster (a share of the default's
    median) a configuration must be to replace the default; ``separation``: by how many standard
    errors of the difference of the medians. ``max_arms``: configurations tried per bucket beyond
    the prior. ``window``: the incumbent's recent samples kept (>= ``max_samples``). ``pin``:
    ``(bucket, Arm)`` pairs that override the choice for those buckets (e.g.
    ``(("decode 64-127", OFF),)``). ``climb``: explore a larger ubatch count only where the next
    smaller one of the same split and dispatch leads or tied, and the other splits and dispatch
    modes only where DBO leads off or tied with it (a bucket where the first DBO configuration is
    clearly slower than off then explores two configurations, not the whole schedule); False
    tries every configuration of the schedule.
    """

    ubatch_counts: tuple[int, ...] = (2, 3, 4)
    splits: tuple[SplitPolicy, ...] = ("token", "balanced")
    dispatches: tuple[DispatchMode, ...] = ("auto", "split")
    samples: int = 3
    max_samples: int = 6
    warmup: int = 1
    margin: float = 0.03
    separation: float = 2.0
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
        if self.samples < 1 or self.warmup < 0 or not self.samples <= self.max_samples <= self.window:
            raise ValueError(
                f"samples ({self.samples}) must be >= 1, warmup ({self.warmup}) >= 0 and samples <= max_samples "
                f"({self.max_samples}) <= window ({self.window})")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin ({self.margin}) must lie in [0, 1)")
        if not self.separation >= 0.0:
            raise ValueError(f"separation ({self.separation}) must be >= 0 (standard errors; 0 compares medians only)")
        if self.max_arms < 0:
            raise ValueError(f"max_arms ({self.max_arms}) must be >= 0")

    @property
    def max_ubatches(self) -> int:
        return max(self.ubatch_counts)

    def arms(self) -> list[Arm]:
        """Every configuration it may choose, in a fixed order (the feasibility mask's bits)."""
        return [OFF] + [Arm(n, s, d) for n in self.ubatch_counts for s in self.splits for d in self.dispatches]


#: A configuration's standing after its comparison: ``"slower"`` (separated: clearly slower than the
#: one it was compared with), ``"tie"`` (not separated, or faster by no more than the margin).
Verdict = Literal["slower", "tie"]


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` found: ``outcome`` is ``"other"`` (it is faster, separated), ``"default"``
    (it cannot be faster by the margin, or it is clearly slower) or ``None`` (not separated yet);
    ``gain``: the default's median minus the other's, as a share of the default's; ``se``: the
    standard error of that difference, the same share; ``slower``: which side is separated as slower,
    if either."""

    outcome: Literal["other", "default"] | None
    gain: float
    se: float
    slower: Literal["other", "default"] | None


def _spread(xs: Sequence[float]) -> float:
    """The interquartile range (0 for fewer than 2 samples)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def relative_sigma(xs: Sequence[float]) -> float:
    """The samples' robust sigma as a share of their median: IQR / 1.349 (a normal's sigma) / median."""
    m = statistics.median(xs) if xs else 0.0
    return _spread(xs) / 1.349 / m if m > 0 else 0.0


def compare(default: Sequence[float], other: Sequence[float], *, margin: float, separation: float,
            noise: float = 0.0, final_n: int = 0) -> Comparison:
    """Is ``other`` faster than ``default`` by more than ``margin`` and ``separation`` standard errors?

    The gain is the difference of the medians as a share of the default's. Its standard error takes
    the largest of the two sides' relative sigmas (:func:`relative_sigma`) and ``noise`` (the
    bucket's pooled one) for both: ``se = 1.2533 * sigma * sqrt(1/n_d + 1/n_o)`` (the median of n
    normal samples has 1.2533 sigma / sqrt(n)). Two guards keep few, noisy samples from faking a
    separation: sigma comes from few samples, so ``separation`` becomes Student's t for
    ``n_d + n_o - 2`` degrees of freedom (Cornish-Fisher's first term: ``z + (z**3 + z) / (4 df)``);
    and the test looks again after every sample up to ``final_n`` each, so to *win* (or to be
    called slower) the gain must clear O'Brien-Fleming's boundary, ``t * se * sqrt(K / k)`` with
    ``K / k`` the ratio of the variance now to the one at ``final_n`` samples (higher at the early
    looks). The other is ruled out (the default wins) as soon as ``gain + t * se`` stays within
    the margin. Pure: the same samples give the same answer."""
    n_d, n_o = len(default), len(other)
    m_d = statistics.median(default)
    gain = (m_d - statistics.median(other)) / (m_d if m_d > 0 else 1.0)
    sigma = max(relative_sigma(default), relative_sigma(other), noise)
    se = 1.2533 * sigma * math.sqrt(1 / n_d + 1 / n_o)
    df = n_d + n_o - 2
    t = separation + (separation**3 + separation) / (4 * df) if df > 0 else separation
    inv_now, inv_last = 1 / n_d + 1 / n_o, 1 / max(n_d, final_n) + 1 / max(n_o, final_n)
    win = t * se * math.sqrt(inv_now / inv_last)
    slower: Literal["other", "default"] | None = None
    if gain > win and gain > margin:
        slower = "default"
    elif -gain > win and -gain > margin:
        slower = "other"
    if slower == "default":
        return Comparison("other", gain, se, slower)
    if gain + t * se <= margin:
        return Comparison("default", gain, se, slower)
    return Comparison(None, gain, se, slower)


def pooled_sigma(samples: Sequence[Sequence[float]]) -> float:
    """The relative sigma of every configuration's samples about its own median, pooled (the host's
    noise is common to them; one configuration's three samples estimate it poorly)."""
    devs = [x / m - 1.0 for xs in samples if len(xs) >= 2 and (m := statistics.median(xs)) > 0 for x in xs]
    return _spread(devs) / 1.349 if len(devs) >= 2 else 0.0


@dataclass
class _Bucket:
    schedule: list[Arm]
    incumbent: Arm
    seen: dict[Arm, int] = field(default_factory=dict)  # steps run, warm-ups included
    samples: dict[Arm, deque[float]] = field(default_factory=dict)
    verdicts: dict[Arm, Verdict] = field(default_factory=dict)  # the arms compared that did not win
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
        base = self._base(prior)
        order = [prior, OFF, base]
        order += [Arm(n, base.split, base.dispatch) for n in cfg.ubatch_counts]
        order += [Arm(base.num_ubatches, s, base.dispatch) for s in cfg.splits]
        order += [Arm(base.num_ubatches, base.split, d) for d in cfg.dispatches]
        out: list[Arm] = []
        for arm in order:
            if arm not in out:
                out.append(arm)
        return out[: 1 + cfg.max_arms]

    def _base(self, prior: Arm) -> Arm:
        """The schedule's first DBO configuration: the prior, or the smallest N's first split and dispatch."""
        cfg = self.cfg
        return prior if prior != OFF else Arm(cfg.ubatch_counts[0], cfg.splits[0], cfg.dispatches[0])

    def bucket(self, name: str) -> _Bucket:
        b = self.buckets.get(name)
        if b is None:
            prior = self.prior(name)
            b = self.buckets[name] = _Bucket(schedule=self._schedule(prior), incumbent=prior)
        return b

    def _trials(self, b: _Bucket) -> list[Arm]:
        """The schedule's configurations still to compare with the incumbent (schedule order)."""
        return [a for a in b.schedule if a != b.incumbent and a not in b.verdicts and self._worth(b, a)]

    def choose(self, name: str, feasible: Callable[[Arm], bool] = lambda arm: True) -> tuple[Arm, str]:
        """The configuration for the next step of bucket ``name`` and why. ``feasible(arm)``:
        whether every rank can run it this step (a split policy may refuse a batch)."""
        pinned = self._pins.get(name)
        if pinned is not None:
            return pinned, f"{name}: pinned by AutoConfig.pin"
        b = self.bucket(name)
        cfg = self.cfg
        need = cfg.warmup + cfg.samples
        inc = b.incumbent
        n_inc = len(b.samples.get(inc, ()))
        trials = self._trials(b)
        if trials and n_inc < cfg.samples and feasible(inc):  # the incumbent (the prior) needs its samples first
            i = b.schedule.index(inc)
            return inc, f"{name}: exploring {i + 1}/{len(b.schedule)} ({b.seen.get(inc, 0) + 1}/{need}); {self.evidence(name)}"
        for arm in trials:
            i = b.schedule.index(arm)
            seen = b.seen.get(arm, 0)
            if seen < need:
                want, why = arm, f"({seen + 1}/{need})"
            else:  # not separated yet: another sample of the side with fewer, the trial on a tie
                n_arm = len(b.samples[arm])
                want = inc if n_inc < n_arm else arm
                why = (f"(not separated from {inc.label}: sample {len(b.samples.get(want, ())) + 1}/{cfg.max_samples} "
                       f"of {want.label})")
            if feasible(want):
                return want, f"{name}: exploring {i + 1}/{len(b.schedule)} {why}; {self.evidence(name)}"
        if not feasible(inc):
            return OFF, f"{name}: {inc.label} cannot split this batch, off; {self.evidence(name)}"
        return inc, f"{name}: {self.evidence(name)}"

    def _worth(self, b: _Bucket, arm: Arm) -> bool:
        """Whether exploring ``arm`` can still pay, given the comparisons so far (``AutoConfig.climb``):
        the prior and its opposite (the schedule's first two) always; N = k only where the next
        smaller count of the same split and dispatch leads or tied; another split or dispatch at the
        smallest count only where DBO leads off or the schedule's first DBO configuration tied with it."""
        cfg = self.cfg
        if not cfg.climb or arm in b.schedule[:2]:
            return True
        smaller = [n for n in cfg.ubatch_counts if n < arm.num_ubatches]
        if not smaller:
            return b.incumbent != OFF or b.verdicts.get(self._base(b.schedule[0])) == "tie"
        prev = Arm(max(smaller), arm.split, arm.dispatch)
        return b.incumbent == prev or b.verdicts.get(prev) == "tie"

    def evidence(self, name: str) -> str:
        """The bucket's medians, spreads (half the interquartile range), sample counts and verdicts,
        e.g. ``'best N=2 token auto 41.20±0.30 us/token (3); off 48.00±2.10 (3, slower)'``."""
        b = self.bucket(name)
        inc = b.samples.get(b.incumbent)
        parts = [f"{b.incumbent.label} {_fmt(inc)} us/token ({len(inc)})" if inc
                 else f"{b.incumbent.label} (prior, unmeasured)"]
        for arm in b.schedule:
            xs = b.samples.get(arm)
            if arm != b.incumbent and xs:
                verdict = b.verdicts.get(arm)
                parts.append(f"{arm.label} {_fmt(xs)} ({len(xs)}{', ' + verdict if verdict else ''})")
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
        self._judge(b)

    def _judge(self, b: _Bucket) -> None:
        """Compare each trial that has its samples with the incumbent (schedule order); a trial
        that wins becomes the incumbent, the other side gets its verdict. Every comparison ends
        (separated, cannot win, or a tie at ``max_samples``), so exploration is bounded."""
        cfg = self.cfg
        for arm in self._trials(b):
            inc = b.incumbent
            xi, xa = b.samples.get(inc), b.samples.get(arm)
            if not xi or not xa or len(xi) < cfg.samples or len(xa) < cfg.samples:
                continue
            off_first = arm == OFF  # off is the default side wherever it is one of the two
            default, other = (arm, inc) if off_first else (inc, arm)
            c = compare(b.samples[default], b.samples[other], margin=cfg.margin, separation=cfg.separation,
                        noise=pooled_sigma(list(b.samples.values())), final_n=cfg.max_samples)
            outcome = c.outcome
            if outcome is None and len(xi) >= cfg.max_samples and len(xa) >= cfg.max_samples:
                outcome = "default"  # still not separated: the tie goes to the default
            if outcome is None:
                continue
            winner, loser = (other, default) if outcome == "other" else (default, other)
            b.verdicts[loser] = "slower" if c.slower == ("other" if loser == other else "default") else "tie"
            b.verdicts.pop(winner, None)
            if winner != inc:
                b.incumbent = winner
                b.switches += 1


def _fmt(xs: Sequence[float]) -> str:
    return f"{_median(xs) * 1e6:.2f}±{_spread(xs) / 2 * 1e6:.2f}"


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
