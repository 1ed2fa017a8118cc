"""What the ``"auto"`` tuning may choose from and how it explores: a configuration (:class:`Arm`)
and the search space with its guards (:class:`AutoConfig`), each checked when it is made. The
policy that chooses is :mod:`asyncdbo.serving.auto`."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..dist.fused import DISPATCH_MODES, DispatchMode
from ..plan import SplitPolicy, ThresholdConfig
from ..plan._checks import check_bool, check_finite, check_int, check_number
from ..plan.slices import SPLIT_POLICIES, CheckedOffsets, as_query_start_loc, leaves_ubatch_empty
from .measure import close_shape_bucket, is_shape_bucket

__all__ = ["OFF", "Arm", "AutoConfig", "splittable_mask", "threshold_prior"]


@dataclass(frozen=True, order=True)
class Arm:
    """One configuration: ``num_ubatches`` (1: DBO off), the split policy, the dispatch mode. Off
    (any ``Arm(1, ...)``) runs ``RunnerConfig.dispatch``, as a fixed runner's unsplit step does."""

    num_ubatches: int
    split: SplitPolicy = "token"
    dispatch: DispatchMode = "auto"
    # set per instance by __post_init__ (not fields)
    _key: ClassVar[tuple[int, str, str]]
    _hash: ClassVar[int]
    _label: ClassVar[str]

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
        # An arm is compared, hashed and named several times in every "auto" step: each made once
        # (the dataclass's own would build the field tuple and the text on every call).
        key = (n, self.split, self.dispatch)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))
        object.__setattr__(self, "_label", "off" if n == 1 else f"N={n} {self.split} {self.dispatch}")

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Arm:
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    @property
    def label(self) -> str:
        """``'off'`` or e.g. ``'N=2 token auto'`` (what :attr:`StepRecord.config` says)."""
        return self._label


OFF = Arm(1)


@dataclass(frozen=True, kw_only=True)
class AutoConfig:
    """The ``"auto"`` tuning's search space and guards (see the module docstring), and the change
    detection that watches a bucket's choice after it settled (``reference``, ``detect``,
    ``detect_slack``, ``probe_every``: explore again where the choice's step time moves, or where a
    runner-up of a near-tie is probed faster; :mod:`asyncdbo.serving.auto`, step 4).

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

    After a bucket has settled (no trial left), its choice is watched (issue 47; see
    :mod:`asyncdbo.serving.auto`). ``reference``: the settled choice's first steps after
    settling that set its reference level (their median) and noise (their robust sigma, relative).
    ``detect``: the threshold of a two-sided CUSUM on each later step's time, normalized to that
    reference in standard deviations (each step's contribution capped at ±3); where either side
    exceeds it the bucket explores again, the same bounded schedule with its choice as incumbent.
    None: no change detection. ``detect_slack``: the CUSUM's allowance per step, in standard
    deviations (a shift of less than about twice it is not accumulated). ``probe_every``: where the
    settled choice won a near-tie (a ``tie`` verdict against it), run that runner-up one step in
    this many, paired with the choice's next step, and explore again where a one-sided CUSUM on
    the pairs' ratios says the runner-up is now faster by more than ``margin`` (None: no probing).
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
    reference: int = 64
    detect: float | None = 10.0
    detect_slack: float = 1.0
    probe_every: int | None = None

    def __post_init__(self) -> None:
        _check_counts(self.ubatch_counts)
        _check_names("splits", self.splits, SPLIT_POLICIES)
        _check_names("dispatches", self.dispatches, DISPATCH_MODES)
        for name in ("samples", "max_samples", "warmup", "window", "max_arms", "step_over", "reference"):
            check_int("AutoConfig.", name, getattr(self, name), _DEFAULTS[name])
        for name in ("margin", "separation", "behind", "detect_slack"):
            check_number("AutoConfig.", name, getattr(self, name), _DEFAULTS[name])
        check_number("AutoConfig.", "detect", self.detect, _DEFAULTS["detect"], none="no change detection")
        if self.probe_every is not None:
            check_int("AutoConfig.", "probe_every", self.probe_every, 16)
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
        # inf passes the checks above, and is never reached: say what it means, and what to write
        check_finite("separation", self.separation, "the standard-error test would never separate two "
                     "configurations", "e.g. separation=2.0, the default")
        check_finite("behind", self.behind, "no loser would ever be ruled behind", "use a finite share, e.g. "
                     "behind=0.15, the default (a larger one rules fewer losers behind)")
        check_finite("prune", self.prune, "it would prune nothing", "use prune=None to try every variant")
        check_finite("decisive", self.decisive, "no comparison would be decisive",
                     "use decisive=None to turn decisive comparisons off")
        if self.reference < 4:
            raise ValueError(f"reference ({self.reference}) must be >= 4 (the settled steps whose median and spread "
                             f"the change detection compares later steps with), e.g. reference=64, the default")
        if self.detect is not None and not (self.detect > 0.0 and math.isfinite(self.detect)):
            raise ValueError(f"detect ({self.detect}) must be a finite number > 0 (the CUSUM threshold, in standard "
                             f"deviations), e.g. detect=10.0, the default; use detect=None to turn change detection off")
        if not (self.detect_slack >= 0.0 and math.isfinite(self.detect_slack)):
            raise ValueError(f"detect_slack ({self.detect_slack}) must be a finite number >= 0 (standard deviations "
                             f"per step), e.g. detect_slack=1.0, the default")
        if self.probe_every is not None and self.detect is None:
            raise ValueError(f"probe_every ({self.probe_every}) needs detect, the threshold its CUSUM fires at: pass "
                             f"detect=10.0 (the default), or probe_every=None")
        if self.probe_every is not None and self.probe_every < 2:
            raise ValueError(f"probe_every ({self.probe_every}) must be >= 2 (one step in probe_every runs the "
                             f"runner-up), e.g. probe_every=16, or None for no probing")
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
    offsets: Sequence[int] = qsl if type(qsl) is CheckedOffsets else list(qsl)
    checked: CheckedOffsets | None = qsl if type(qsl) is CheckedOffsets else None
    mask = 0
    cut: dict[tuple[int, str], bool] = {}  # each (N, split) cut once: the dispatch modes share it
    for bit, arm in enumerate(arms):
        if arm == OFF or arm.split == "token" or offsets[-1] == 0:
            mask |= 1 << bit
            continue
        key = (arm.num_ubatches, arm.split)
        ok = cut.get(key)
        if ok is None:
            if checked is None:  # checked once, at the first cut
                checked = CheckedOffsets(as_query_start_loc(offsets))
            ok = cut[key] = not leaves_ubatch_empty(checked, arm.num_ubatches, arm.split, min_share)
        if ok:
            mask |= 1 << bit
    return mask
