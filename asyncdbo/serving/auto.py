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
   at most ``max_arms`` of them beyond the prior, one at a time against the incumbent. After the
   prior's ``warmup`` steps, a trial runs its own ``warmup`` steps and then **alternates with the
   incumbent step by step**, the trial first: each incumbent step right after a trial sample is
   that sample's pair, and the comparison uses only those pairs, never the incumbent's samples from
   before the trial. So a load change between two stretches of the run moves both sides of every
   pair it does not fall inside (at most one). The trial goes on for ``samples`` pairs and then,
   while the two do not separate (below), a pair at a time up to ``max_samples`` pairs. It climbs
   (``AutoConfig.climb``): a larger ubatch count is tried only where the next smaller one leads or
   tied (was neither separated as slower nor ruled out with its pairs' median ratio more than
   ``behind`` above 1), or, while off leads, where no more than ``step_over`` smaller counts were
   tried and all lost (N = 2 losing to off does not rule out N = 3); another split or dispatch mode
   only where DBO leads off or tied with it. So a bucket where DBO clearly loses spends its
   exploration on three configurations (off, N = 2, N = 3), and a loss within the noise does not
   end the climb. A comparison also ends after its first ``samples`` pairs where
   the side that would have to win is not even ahead (``stop_behind``): a tie to the default; and
   before them, from its second pair, where every pair puts one side more than ``decisive`` behind
   the other (:func:`decisive`): that side is slower, with no noise this policy meets able to fake
   such a gap in two pairs running. And the
   other splits and dispatch modes, variants of the schedule's first DBO configuration (the base),
   are skipped where the base measured more than ``1 + prune`` times the incumbent (``prune``; the
   product of the pairs' median ratios along the comparisons linking them): such a variant would
   have to beat its base by that much just to tie; the evidence names each skipped configuration
   and that ratio. A bucket explores at most ``warmup + max_arms *
   (warmup + 2 * max_samples)`` steps, half of them (bar the warm-ups) on the incumbent. The
   schedule is a pure function of the bucket's history, never of a random draw.
3. **Noise-aware comparison** (:func:`compare_paired`). A trial and the incumbent are compared on
   the median of the pairs' ratios (trial / incumbent), with its standard error from the ratios'
   interquartile range (robust to an outlier pair) or the spread of every comparison's ratios in
   the bucket, pooled, whichever is larger. The *default* side, off where off is one of the two,
   else the incumbent, keeps the choice unless the other is faster by more than ``margin`` (a
   share) and by more than ``separation`` standard errors (as Student's t for the pairs' degrees
   of freedom, and higher at the early looks of the sequential test). The comparison ends early
   once even the gain plus that many standard errors stays within the margin; one still not
   separated at ``max_samples`` pairs is a tie, and ties go to the default. So DBO runs only where
   it is clearly faster than off, and a near-tie never flips a choice. After the schedule the
   choice stays; the incumbent keeps its last ``window`` samples.

Every input is shared by the DP group (the runner exchanges each rank's last step time in the one
vote of the step and feeds the group's slowest), so every rank holds the same account and makes the
same choice: the policy itself never talks to another rank. The choice and its evidence (medians,
spreads, sample counts, the verdicts and the pairs each was decided on) go into the step's record.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..dist.fused import DISPATCH_MODES, DispatchMode
from ..plan import DPDecision, SplitPolicy, ThresholdConfig, plan_slices
from ..plan.slices import SPLIT_POLICIES
from ._checks import check_bool, check_int, check_number
from .measure import close_shape_bucket, is_shape_bucket, shape_bucket

__all__ = ["Arm", "AutoConfig", "AutoPolicy", "Comparison", "OFF", "choose_for_group", "compare", "compare_paired",
           "group_choice",
           "paired_sigma", "pooled_sigma",
           "relative_sigma", "splittable_mask", "threshold_prior"]


@dataclass(frozen=True, order=True)
class Arm:
    """One configuration: ``num_ubatches`` (1: DBO off), the split policy, the dispatch mode. Off
    (any ``Arm(1, ...)``) runs ``RunnerConfig.dispatch``, as a fixed runner's unsplit step does."""

    num_ubatches: int
    split: SplitPolicy = "token"
    dispatch: DispatchMode = "auto"

    def __post_init__(self) -> None:
        n = self.num_ubatches
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"Arm num_ubatches must be an int >= 1 (1: off), got {type(n).__name__} {n!r}")
        if n < 1:
            raise ValueError(f"Arm num_ubatches ({n}) must be >= 1 (1: off, 2 or more: DBO)")
        if self.split not in SPLIT_POLICIES:
            raise ValueError(f"Arm split {self.split!r}: use one of {SPLIT_POLICIES}")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"Arm dispatch {self.dispatch!r}: use one of {DISPATCH_MODES}")

    @property
    def label(self) -> str:
        """``'off'`` or e.g. ``'N=2 token auto'`` (what :attr:`StepRecord.config` says)."""
        return "off" if self.num_ubatches == 1 else f"N={self.num_ubatches} {self.split} {self.dispatch}"


OFF = Arm(1)


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """The ``"auto"`` tuning's search space and guards (see the module docstring).

    ``ubatch_counts``, ``splits``, ``dispatches``: the configurations it may try, each a tuple
    naming each value once, the counts in increasing order (the climb's; the first split and
    dispatch are the prior's). ``samples``: the
    pairs (a trial's step, then the incumbent's) before a trial is first compared; ``max_samples``:
    at most this many pairs while the comparison does not separate; ``warmup``: a configuration's first steps in a
    bucket, not counted (caches, allocator). ``margin``: how much faster (a share of the default's
    median) a configuration must be to replace the default; ``separation``: by how many standard
    errors of the difference of the medians. ``max_arms``: configurations tried per bucket beyond
    the prior. ``window``: the incumbent's recent samples kept (>= ``max_samples``). ``pin``:
    ``(bucket, Arm)`` pairs that override the choice for those buckets (e.g.
    ``(("decode 64-127", OFF),)``; each bucket a busy one :func:`~asyncdbo.serving.measure.shape_bucket`
    names, once; any ``Arm(1, ...)`` pins off; a step some rank's batch cannot split the pinned way
    runs off). ``climb``: explore a larger ubatch count only where the next
    smaller one of the same split and dispatch leads or tied, and the other splits and dispatch
    modes only where DBO leads off or tied with it (a bucket where the first DBO configuration is
    clearly slower than off then explores three configurations, not the whole schedule); False
    tries every configuration of the schedule. ``step_over``: while off leads, the climb still
    tries N = k where every smaller count lost, if there are no more than this many of them (1:
    N = 3 after N = 2 lost to off, as on a latency-bound link where N = 2 loses and N = 3 wins;
    0: the climb ends at the first loss). ``stop_behind``: end a comparison after its first
    ``samples`` pairs where the side that would have to win is not even ahead (its pairs' median
    ratio >= 1), a tie to the default; False runs such a comparison on to ``max_samples`` pairs.
    ``behind``: a loser ruled out (not separated) with its pairs' median ratio above ``1 + behind``
    gets the verdict ``"behind"``, which ends the climb from it as ``"slower"`` does (bar ``step_over``).
    ``prune``: while climbing, skip another split or dispatch mode of the schedule's first DBO
    configuration (its *base*) where the base measured more than ``1 + prune`` times the incumbent
    (the product of the pairs' median ratios along the comparisons from the base to the incumbent):
    a variant that changes only how the base's ubatches are cut or dispatched would have to beat
    the base by that much just to tie. None tries every variant the climb allows.
    ``decisive``: end a comparison as soon as its pairs (two at least) all say the same by more
    than this share, every ratio of the slower side's time to the faster's above ``1 + decisive``,
    before its first ``samples`` pairs; the slower side is separated as slower
    (:func:`decisive`). None runs every comparison to its first ``samples`` pairs.
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
    stop_behind: bool = True
    behind: float = 0.15
    prune: float | None = 0.15
    step_over: int = 1
    decisive: float | None = 0.5

    def __post_init__(self) -> None:
        _check_counts(self.ubatch_counts)
        _check_names("splits", self.splits, SPLIT_POLICIES)
        _check_names("dispatches", self.dispatches, DISPATCH_MODES)
        for name in ("samples", "max_samples", "warmup", "window", "max_arms", "step_over"):
            check_int("AutoConfig.", name, getattr(self, name), _DEFAULTS[name])
        for name in ("margin", "separation", "behind"):
            check_number("AutoConfig.", name, getattr(self, name), _DEFAULTS[name])
        check_number("AutoConfig.", "prune", self.prune, _DEFAULTS["prune"], none="no pruning")
        check_number("AutoConfig.", "decisive", self.decisive, _DEFAULTS["decisive"], none="no early end")
        check_bool("AutoConfig.", "climb", self.climb)
        check_bool("AutoConfig.", "stop_behind", self.stop_behind)
        if self.samples < 1 or self.warmup < 0 or not self.samples <= self.max_samples <= self.window:
            raise ValueError(
                f"samples ({self.samples}) must be >= 1, warmup ({self.warmup}) >= 0 and samples <= max_samples "
                f"({self.max_samples}) <= window ({self.window})")
        if not self.behind >= 0.0:
            raise ValueError(f"behind ({self.behind}) must be >= 0 (a share of the winner's time)")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin ({self.margin}) must lie in [0, 1)")
        if not self.separation >= 0.0:
            raise ValueError(f"separation ({self.separation}) must be >= 0 (standard errors; 0 compares medians only)")
        if self.prune is not None and not self.prune >= 0.0:
            raise ValueError(f"prune ({self.prune}) must be >= 0 (a share of the incumbent's time) or None (no pruning)")
        if self.decisive is not None and not self.decisive > 0.0:
            raise ValueError(f"decisive ({self.decisive}) must be > 0 (a share of the faster side's time) or None (every "
                             "comparison runs its first samples pairs)")
        if self.max_arms < 0:
            raise ValueError(f"max_arms ({self.max_arms}) must be >= 0")
        if self.step_over < 0:
            raise ValueError(f"step_over ({self.step_over}) must be >= 0 (ubatch counts lost to off that the climb steps over)")
        # Any Arm(1, ...) is off (it runs RunnerConfig.dispatch unsplit): pin it as OFF, the arm the
        # runner and the records compare with.
        object.__setattr__(self, "pin", tuple((name, OFF if arm.num_ubatches == 1 else arm)
                                              for name, arm in _checked_pin(self.pin)))

    @property
    def max_ubatches(self) -> int:
        """The most ubatches a step may run: the largest of ``ubatch_counts`` and the pinned counts."""
        return max([*self.ubatch_counts, *(arm.num_ubatches for _, arm in self.pin)])

    def arms(self) -> list[Arm]:
        """Every configuration it may choose, in a fixed order (the feasibility mask's bits): off,
        the search space's, then the pinned ones outside it."""
        out = [OFF] + [Arm(n, s, d) for n in self.ubatch_counts for s in self.splits for d in self.dispatches]
        out += [arm for arm in dict.fromkeys(arm for _, arm in self.pin) if arm not in out]
        return out

    def check_max_ubatches(self, max_ubatches: int | None) -> None:
        """Raise ValueError unless every ubatch count it may run (``ubatch_counts`` and the pinned
        configurations) fits a model whose MoE layers were built for ``max_ubatches`` (None: any)."""
        if max_ubatches is None:
            return
        if max(self.ubatch_counts) > max_ubatches:
            raise ValueError(
                f"tuning='auto' may run {max(self.ubatch_counts)} ubatches (AutoConfig.ubatch_counts "
                f"{self.ubatch_counts}) but the model's MoE layers were built for max_ubatches={max_ubatches}; "
                f"build them with max_ubatches >= {max(self.ubatch_counts)} or pass "
                f"AutoConfig(ubatch_counts=...) within it")
        for name, arm in self.pin:
            if arm.num_ubatches > max_ubatches:
                raise ValueError(
                    f"AutoConfig.pin pins {name!r} to {arm.label} ({arm.num_ubatches} ubatches) but the model's "
                    f"MoE layers were built for max_ubatches={max_ubatches}; build them with max_ubatches >= "
                    f"{arm.num_ubatches} or pin at most {max_ubatches} ubatches")


#: Each field's default, the example a message about a field gives.
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(AutoConfig)}


def _not_a_tuple(name: str, value: object, example: object) -> TypeError:
    """A list (or a lone value) where ``AutoConfig.<name>`` wants a tuple: the config is frozen,
    and a list could still change after it was checked (and would leave the config unhashable)."""
    if isinstance(value, list):
        example = tuple(value)
    elif isinstance(value, (str, int)) and not isinstance(value, bool):
        example = (value,)
    return TypeError(f"AutoConfig.{name} must be a tuple, got {type(value).__name__} {value!r}; pass a tuple, "
                     f"e.g. {name}={example!r}")


def _check_counts(counts: object) -> None:
    """``AutoConfig.ubatch_counts``: a tuple of ints >= 2 in increasing order, each once. The order
    is the climb's (:meth:`AutoPolicy._worth` tries N = k only after the next smaller count, the
    schedule lists the counts in the order given, the first is the base of an off prior's
    exploration and the prior's count where 2 is not among them)."""
    if not isinstance(counts, tuple):
        raise _not_a_tuple("ubatch_counts", counts, _DEFAULTS["ubatch_counts"])
    usable = tuple(sorted({int(n) for n in counts if isinstance(n, (int, float)) and not isinstance(n, bool)
                           and float(n).is_integer() and n >= 2}))
    fix = usable or _DEFAULTS["ubatch_counts"]
    for n in counts:
        if isinstance(n, bool):
            raise TypeError(f"AutoConfig.ubatch_counts {counts!r} holds {n!r}: a bool is not a ubatch count; use ints "
                            f">= 2, e.g. ubatch_counts={fix!r}")
        if not isinstance(n, int):
            raise TypeError(f"AutoConfig.ubatch_counts {counts!r} holds {type(n).__name__} {n!r}, not an int; use ints "
                            f">= 2, e.g. ubatch_counts={fix!r}")
    if not counts or any(n < 2 for n in counts):
        raise ValueError(f"ubatch_counts {counts!r} must be ubatch counts >= 2 (off is always a candidate)")
    if list(counts) != sorted(set(counts)):
        raise ValueError(f"AutoConfig.ubatch_counts {counts!r} must be in increasing order, each count once (the "
                         f"climb tries a count only after the next smaller one); write ubatch_counts={fix!r}")


def _check_names(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """``AutoConfig.splits`` or ``.dispatches``: a non-empty tuple of ``allowed`` names, each once
    (their order is the schedule's: the first is the prior's and the base's)."""
    if not isinstance(value, tuple):
        raise _not_a_tuple(name, value, _DEFAULTS[name])
    if not value or any(v not in allowed for v in value):
        raise ValueError(f"{name} {value!r}: use some of {allowed}")
    twice = [v for i, v in enumerate(value) if v in value[:i]]
    if twice:
        raise ValueError(f"AutoConfig.{name} {value!r} names {twice[0]!r} twice; name each once, e.g. "
                         f"{name}={tuple(dict.fromkeys(value))!r}")


def _arm_source(arm: Arm) -> str:
    """How to write ``arm``: ``'OFF'``, or e.g. ``"Arm(2, 'token', 'auto')"``."""
    return "OFF" if arm == OFF else f"Arm({arm.num_ubatches}, {arm.split!r}, {arm.dispatch!r})"


def _checked_pin(pin: object) -> tuple[tuple[str, Arm], ...]:
    """``AutoConfig.pin`` as it must be: a tuple of ``(bucket name, Arm)`` pairs, each name a
    :func:`~asyncdbo.serving.measure.shape_bucket` of a busy step, named once; else the error
    naming the bad entry and the fix."""
    example = "pin=(('decode 64-127', OFF),)"
    if isinstance(pin, tuple) and len(pin) == 2 and isinstance(pin[0], str) and isinstance(pin[1], Arm):
        raise TypeError(f"AutoConfig.pin {pin!r} is one (bucket name, Arm) pair, not a tuple of them; "
                        f"write pin=(({pin[0]!r}, {_arm_source(pin[1])}),)")
    if not isinstance(pin, tuple):
        fix = "pin=tuple(d.items())" if isinstance(pin, dict) else "pin=tuple(...)"
        raise TypeError(f"AutoConfig.pin must be a tuple of (bucket name, Arm) pairs, got {type(pin).__name__} "
                        f"{pin!r}; write {fix}, e.g. {example}")
    seen: set[str] = set()
    for entry in pin:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError(f"AutoConfig.pin entry {entry!r} is not a (bucket name, Arm) pair; write e.g. {example}")
        name, arm = entry
        if not isinstance(arm, Arm):
            fix = "OFF (asyncdbo.serving.OFF)" if isinstance(arm, str) and arm == "off" else "an Arm, e.g. OFF or Arm(2, 'token')"
            raise TypeError(f"AutoConfig.pin entry {entry!r}: the configuration is a {type(arm).__name__}, "
                            f"not an Arm; write {fix}")
        if name == "idle":
            raise ValueError("AutoConfig.pin entry ('idle', ...): a step where every rank is idle always runs "
                             "off; pin a busy bucket such as 'decode 64-127'")
        if not is_shape_bucket(name):
            close = close_shape_bucket(name) if isinstance(name, str) else None
            hint = f"; did you mean {close!r}?" if close is not None else ""
            raise ValueError(
                f"AutoConfig.pin bucket {name!r} is not a step-shape bucket: a bucket is 'decode LO-HI' or "
                f"'mixed LO-HI' with LO a power of two and HI = 2 * LO - 1, as "
                f"asyncdbo.serving.measure.shape_bucket names them (e.g. 'decode 64-127'){hint}")
        if name in seen:
            raise ValueError(f"AutoConfig.pin names bucket {name!r} twice; pin each bucket once")
        seen.add(name)
    return pin  # checked above: a tuple of (str, Arm) pairs


#: A configuration's standing after its comparison: ``"slower"`` (separated: clearly slower than the
#: one it was compared with), ``"behind"`` (not separated, but ruled out with its median behind the
#: other's by more than the margin), ``"tie"`` (not separated, or faster by no more than the margin).
#: Only a tie lets the climb go on from it (``AutoConfig.climb``).
Verdict = Literal["slower", "behind", "tie"]


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
    inv_now, inv_last = 1 / n_d + 1 / n_o, 1 / max(n_d, final_n) + 1 / max(n_o, final_n)
    return _decide(gain, se, n_d + n_o - 2, math.sqrt(inv_now / inv_last), margin=margin, separation=separation)


def _decide(gain: float, se: float, df: int, look: float, *, margin: float, separation: float) -> Comparison:
    """The sequential test :func:`compare` and :func:`compare_paired` end with: ``separation`` as
    Student's t for ``df`` degrees of freedom; to win (or be called slower) the gain must clear
    ``t * se * look`` (``look``: O'Brien-Fleming's factor for this look) and the margin; the other
    is ruled out once ``gain + t * se`` stays within the margin."""
    t = separation + (separation**3 + separation) / (4 * df) if df > 0 else separation
    win = t * se * look
    if gain > win and gain > margin:
        return Comparison("other", gain, se, "default")
    slower: Literal["other", "default"] | None = "other" if -gain > win and -gain > margin else None
    if gain + t * se <= margin:
        return Comparison("default", gain, se, slower)
    return Comparison(None, gain, se, slower)


def compare_paired(default: Sequence[float], other: Sequence[float], *, margin: float, separation: float,
                   noise: float = 0.0, final_n: int = 0) -> Comparison:
    """:func:`compare` for samples taken in pairs (``default[i]`` next to ``other[i]`` in time): it
    compares the ratios ``other[i] / default[i]``, so a load level common to a pair cancels. The
    gain is one minus their median; its standard error ``1.2533 * sigma * median / sqrt(n)``, sigma
    the ratios' relative sigma (:func:`relative_sigma`) or ``noise``, whichever is larger; t for
    ``n - 1`` degrees of freedom; O'Brien-Fleming's boundary ``t * se * sqrt(final_n / n)`` to win or
    be called slower; ruled out once ``gain + t * se`` stays within the margin. Pure."""
    assert len(default) == len(other) > 0, "paired samples come in pairs"
    n = len(default)
    ratios = [o / d if d > 0 else 1.0 for d, o in zip(default, other)]
    m = statistics.median(ratios)
    gain = 1.0 - m
    sigma = max(relative_sigma(ratios), noise)
    se = 1.2533 * sigma * m / math.sqrt(n)
    return _decide(gain, se, n - 1, math.sqrt(max(n, final_n) / n), margin=margin, separation=separation)


#: A decisive gap is read from this many pairs at least: one pair is two steps, and one hiccup of
#: the host (a collection, another process) in one of them can fake any ratio.
_DECISIVE_PAIRS = 2


def decisive(default: Sequence[float], other: Sequence[float], gap: float | None) -> Comparison | None:
    """A comparison of samples taken in pairs that every pair already decides (``AutoConfig.decisive``):
    with at least :data:`_DECISIVE_PAIRS` pairs, every ratio ``other[i] / default[i]`` above
    ``1 + gap`` (the other is slower: the default wins) or every one below ``1 / (1 + gap)`` (the
    other wins), the loser separated as slower; else None, for :func:`compare_paired` to decide.
    A gap that large in every pair is no noise a step of this policy sees, and exploring on costs
    most exactly there: each further pair runs the loser once more (off where DBO runs 3-5 times
    faster, as on ``auto_measured.py``'s mixed-arrivals steps). Pure."""
    n = len(default)
    assert n == len(other), "paired samples come in pairs"
    if gap is None or n < _DECISIVE_PAIRS or any(d <= 0 for d in default):
        return None
    ratios = [o / d for d, o in zip(default, other)]
    gain = 1.0 - statistics.median(ratios)
    if min(ratios) > 1.0 + gap:
        return Comparison("default", gain, 0.0, "other")
    if max(ratios) * (1.0 + gap) < 1.0:
        return Comparison("other", gain, 0.0, "default")
    return None


def paired_sigma(pairs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float:
    """The relative sigma of every comparison's pair ratios about their own median, pooled (the
    host's noise is common to them; three pairs estimate it poorly)."""
    return pooled_sigma([[o / d for d, o in zip(ds, os) if d > 0] for ds, os in pairs])


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
    # per trial, the incumbent's samples taken each right after one of the trial's (the pairs compared)
    paired: dict[Arm, deque[float]] = field(default_factory=dict)
    # per loser, the comparison that decided it: the winner, the loser's and the winner's samples compared
    # and the pairs' median ratio, loser / winner
    compared: dict[Arm, tuple[Arm, tuple[float, ...], tuple[float, ...], float]] = field(default_factory=dict)
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

    def pinned(self, name: str) -> Arm | None:
        """The configuration ``AutoConfig.pin`` fixes for bucket ``name``, or None."""
        return self._pins.get(name)

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
        arm, why, _ = self.choose_refused(name, feasible)
        return arm, why

    def choose_refused(self, name: str, feasible: Callable[[Arm], bool] = lambda arm: True
                       ) -> tuple[Arm, str, Arm | None]:
        """:meth:`choose`, and the configuration it would run but this step cannot split, so that
        it runs off instead (the pinned one, or the bucket's choice where no trial can run either),
        else None. A step off for that reason is the split policy's refusal, as a fixed runner
        records it (``PlanReason.POLICY_REFUSED``), not a choice of off."""
        pinned = self._pins.get(name)
        if pinned is not None:
            if feasible(pinned):
                return pinned, f"{name}: pinned by AutoConfig.pin", None
            # as a fixed runner with that split policy falls back (PlanReason.POLICY_REFUSED)
            return OFF, (f"{name}: pinned {pinned.label} (AutoConfig.pin) cannot split this batch (a "
                         f"{pinned.split} split leaves a ubatch without real tokens), off"), pinned
        b = self.bucket(name)
        cfg = self.cfg
        inc = b.incumbent
        k = len(b.schedule)
        trials = self._trials(b)
        if trials and b.seen.get(inc, 0) < cfg.warmup and feasible(inc):  # the prior's own warm-up
            return inc, (f"{name}: exploring {b.schedule.index(inc) + 1}/{k} (warm-up {b.seen.get(inc, 0) + 1}/"
                         f"{cfg.warmup} of {inc.label}); {self.evidence(name)}"), None
        for arm in trials:
            want, why = self._turn(b, arm)
            if feasible(want):
                return want, f"{name}: exploring {b.schedule.index(arm) + 1}/{k} {why}; {self.evidence(name)}", None
        if not feasible(inc):  # off and the token split always can: inc is a request-aligned split
            return OFF, (f"{name}: {inc.label} cannot split this batch (a {inc.split} split leaves a ubatch without "
                         f"real tokens), off; {self.evidence(name)}"), inc
        return inc, f"{name}: {self.evidence(name)}", None

    def _turn(self, b: _Bucket, arm: Arm) -> tuple[Arm, str]:
        """Whose step it is in trial ``arm``'s comparison, and why: the trial's warm-up, then the
        trial and the incumbent alternately (trial first), so each incumbent sample of the
        comparison is taken next to one of the trial's (:meth:`observe` pairs them)."""
        cfg = self.cfg
        seen = b.seen.get(arm, 0)
        if seen < cfg.warmup:
            return arm, f"(warm-up {seen + 1}/{cfg.warmup} of {arm.label})"
        n_arm, n_inc = len(b.samples.get(arm, ())), len(b.paired.get(arm, ()))
        more = "not separated yet: " if min(n_arm, n_inc) >= cfg.samples else ""
        if n_arm <= n_inc:
            return arm, f"({more}sample {n_arm + 1}/{cfg.max_samples} of {arm.label})"
        return b.incumbent, f"({more}sample {n_inc + 1}/{cfg.max_samples} of {b.incumbent.label}, paired with {arm.label})"

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
            if b.incumbent == OFF and b.verdicts.get(self._base(b.schedule[0])) != "tie":
                return False
            return self._pruned(b, arm) is None
        prev = Arm(max(smaller), arm.split, arm.dispatch)
        if b.incumbent == prev or b.verdicts.get(prev) == "tie":
            return True
        # Off still leads: the climb steps over up to ``step_over`` smaller counts that all lost (the
        # DBO curve in N can pass below off only after N = 2: a latency-bound link hides more of
        # each message behind a third ubatch's compute than a second's).
        lost = [Arm(n, arm.split, arm.dispatch) for n in smaller]
        return b.incumbent == OFF and len(lost) <= cfg.step_over and all(a in b.verdicts for a in lost)

    def _pruned(self, b: _Bucket, arm: Arm) -> float | None:
        """The base's measured time over the incumbent's where it exceeds ``1 + prune`` so that
        ``arm`` (a split or dispatch variant of the base) is skipped, else None (``AutoConfig.prune``).
        The ratio multiplies the pairs' median ratios along the comparisons from the base to the
        incumbent (each loser's ``compared`` names its winner); no such chain: nothing to prune on."""
        base = self._base(b.schedule[0])
        if self.cfg.prune is None or arm == base or arm.num_ubatches != base.num_ubatches:
            return None
        ratio, at, seen = 1.0, base, {base}
        while at != b.incumbent:
            link = b.compared.get(at)
            if link is None or link[0] in seen:
                return None
            ratio *= link[3]
            at = link[0]
            seen.add(at)
        return ratio if ratio > 1.0 + self.cfg.prune else None

    def evidence(self, name: str) -> str:
        """The bucket's medians, spreads (half the interquartile range) and sample counts; per
        configuration compared, its verdict and the samples it was compared on (its own and the
        other side's, taken in pairs) and the pairs' median ratio (its time over the other's), e.g.
        ``'best N=2 token auto 41.20±0.30 us/token (5); off 48.00±2.10 (3, slower vs N=2 token auto
        41.10±0.40 (3), ratio 1.168)'``; a trial under way shows the incumbent's samples paired with
        it so far."""
        b = self.bucket(name)
        inc = b.samples.get(b.incumbent)
        parts = [f"{b.incumbent.label} {_fmt(inc)} us/token ({len(inc)})" if inc
                 else f"{b.incumbent.label} (prior, unmeasured)"]
        for arm in b.schedule:
            xs = b.samples.get(arm)
            if arm == b.incumbent or not xs:
                continue
            if arm in b.compared:
                w, mine, theirs, ratio = b.compared[arm]
                parts.append(f"{arm.label} {_fmt(mine)} ({len(mine)}, {b.verdicts[arm]} vs {w.label} {_fmt(theirs)} "
                             f"({len(theirs)}), ratio {ratio:.3f})")
            else:
                pi = b.paired.get(arm)
                paired = f", {b.incumbent.label} paired {_fmt(pi)} ({len(pi)})" if pi else ""
                parts.append(f"{arm.label} {_fmt(xs)} ({len(xs)}{paired})")
        for arm in b.schedule:
            r = self._pruned(b, arm) if self.cfg.climb and arm not in b.verdicts and arm != b.incumbent else None
            if r is not None:
                parts.append(f"{arm.label} skipped ({self._base(b.schedule[0]).label} measured {r:.3f}x "
                             f"{b.incumbent.label}, above 1 + prune {self.cfg.prune})")
        return "best " + "; ".join(parts)

    def observe(self, name: str, arm: Arm, seconds_per_token: float) -> None:
        """A step of bucket ``name`` ran ``arm`` and cost ``seconds_per_token`` (the group's). An
        incumbent step right after a trial's sample (its turn, :meth:`_turn`) is that sample's pair."""
        if name in self._pins:
            return
        b = self.bucket(name)
        n = b.seen[arm] = b.seen.get(arm, 0) + 1
        if n <= self.cfg.warmup:
            return
        if arm == b.incumbent:
            waiting = [t for t in self._trials(b) if len(b.samples.get(t, ())) > len(b.paired.get(t, ()))]
            if waiting:
                b.paired.setdefault(waiting[0], deque()).append(seconds_per_token)
        xs = b.samples.get(arm)
        if xs is None:
            xs = b.samples[arm] = deque(maxlen=self.cfg.window)
        xs.append(seconds_per_token)
        self._judge(b)

    def _judge(self, b: _Bucket) -> None:
        """Compare each trial that has its samples with the incumbent's samples paired with them
        (schedule order), at whole pairs only; a trial that wins becomes the incumbent, the other
        side gets its verdict. Every comparison ends (separated, cannot win, or a tie at
        ``max_samples``), so exploration is bounded."""
        cfg = self.cfg
        for arm in self._trials(b):
            inc = b.incumbent
            xa, xi = b.samples.get(arm, ()), b.paired.get(arm, ())
            if len(xi) != len(xa) or len(xa) < min(cfg.samples, _DECISIVE_PAIRS if cfg.decisive is not None else cfg.samples):
                continue
            default, other = (arm, inc) if arm == OFF else (inc, arm)  # off is the default side wherever it is one of the two
            side = {arm: list(xa), inc: list(xi)}
            c = decisive(side[default], side[other], cfg.decisive)
            if c is None:
                if len(xa) < cfg.samples:
                    continue
                pairs = [(ls, ws) for _, ls, ws, _ in b.compared.values()] + [(xi, xa)]
                c = compare_paired(side[default], side[other], margin=cfg.margin, separation=cfg.separation,
                                   noise=paired_sigma(pairs), final_n=cfg.max_samples)
            outcome = c.outcome
            if outcome is None and (len(xa) >= cfg.max_samples or (cfg.stop_behind and c.gain <= 0)):
                outcome = "default"  # still not separated, or the other not even ahead: the tie goes to the default
            if outcome is None:
                continue
            winner, loser = (other, default) if outcome == "other" else (default, other)
            b.verdicts[loser] = ("slower" if c.slower == ("other" if loser == other else "default")
                                 else "behind" if loser == other and -c.gain > cfg.behind else "tie")
            b.verdicts.pop(winner, None)
            ratio = 1.0 - c.gain if loser == other else 1.0 / (1.0 - c.gain)
            b.compared[loser] = (winner, tuple(side[loser]), tuple(side[winner]), ratio)
            b.compared.pop(winner, None)
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
    bucket, arm, evidence, _ = group_choice(policy, arms, decision, uniform_R, mask_R)
    return bucket, arm, evidence


def group_choice(policy: AutoPolicy, arms: Sequence[Arm], decision: DPDecision, uniform_R: Sequence[int],
                 mask_R: Sequence[int]) -> tuple[str, Arm, str, Arm | None]:
    """:func:`choose_for_group`, and the configuration the policy would run but some rank's batch
    cannot split (:meth:`AutoPolicy.choose_refused`; the step runs off), else None: what the runner
    and the simulator record a step by."""
    busy = [r for r, v in enumerate(decision.ranks) if v.vote != "idle"]
    bucket = shape_bucket(max(decision.num_tokens_across_dp, default=0), bool(busy) and all(uniform_R[r] for r in busy))
    if not decision.should_ubatch:
        return bucket, OFF, "", None
    group_mask = -1
    for r in busy:
        group_mask &= mask_R[r]
    arm, evidence, refused = policy.choose_refused(bucket, lambda a: bool(group_mask >> arms.index(a) & 1))
    return bucket, arm, evidence, refused
