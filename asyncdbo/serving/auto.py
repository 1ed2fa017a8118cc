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
   the other (:func:`decisive`): that side is slower (faking such a gap takes a host hiccup in a
   step of each pair, where one pair alone could be). And the
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
4. **Change detection.** Once a bucket has settled, its choice's step times are watched (a
   two-sided CUSUM against a reference, and optionally probes of near-tie runners-up); where they
   move, the bucket explores again (:mod:`asyncdbo.serving.auto_watch`).

Every input is shared by the DP group (the runner exchanges each rank's last step time in the one
vote of the step and feeds the group's slowest), so every rank holds the same account and makes the
same choice: the policy itself never talks to another rank. The choice and its evidence (medians,
spreads, sample counts, the verdicts and the pairs each was decided on) go into the step's record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..plan import DPDecision
from .auto_config import OFF, Arm, AutoConfig, splittable_mask, threshold_prior
from .auto_evidence import Evidence, fmt_samples
from .auto_watch import Reexploration, Watch, summarize
from .compare import (Comparison, compare, compare_paired, decisive, paired_sigma,
                      pooled_sigma, relative_sigma)
from .measure import shape_bucket

# Arm, AutoConfig and the comparisons live in asyncdbo.serving.auto_config and .compare; they are
# named here too, where the policy's users have imported them from.
__all__ = ["Arm", "AutoConfig", "AutoPolicy", "Comparison", "Evidence", "OFF", "Reexploration", "choose_for_group",
           "compare", "compare_paired", "decisive", "group_choice", "group_choice_lazy", "paired_sigma", "pooled_sigma",
           "relative_sigma", "splittable_mask", "threshold_prior"]


#: A configuration's standing after its comparison: ``"slower"`` (separated: clearly slower than the
#: one it was compared with), ``"behind"`` (not separated, but ruled out with its median behind the
#: other's by more than the margin), ``"tie"`` (not separated, or faster by no more than the margin).
#: Only a tie lets the climb go on from it (``AutoConfig.climb``).
Verdict = Literal["slower", "behind", "tie"]


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
    steps: int = 0  # steps measured (observe calls), every exploration and probe included
    watch: Watch | None = None  # set once the bucket has settled (no trial left)
    explored_again: list[Reexploration] = field(default_factory=list)
    # once settled, the evidence after the choice's own part: nothing it reads changes until the
    # bucket explores again (a new _Bucket), so it is formatted once, not every step
    settled_rest: str | None = None


class AutoPolicy:
    """The per-bucket account and choice (pure: the same calls give the same choices).

    ``prior(bucket)`` gives a new bucket's first configuration. Call :meth:`choose` before a step
    and :meth:`observe` with what the step cost (seconds per real token) after it."""

    def __init__(self, cfg: AutoConfig, prior: Callable[[str], Arm]) -> None:
        self.cfg = cfg
        self.prior = prior
        self.buckets: dict[str, _Bucket] = {}
        self._pins = dict(cfg.pin)
        #: every re-exploration so far, in order (:class:`Reexploration`)
        self.reexplorations: list[Reexploration] = []

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
        arm, evidence, refused = self._choose(name, feasible)
        return arm, str(evidence), refused

    def _choose(self, name: str, feasible: Callable[[Arm], bool]) -> tuple[Arm, str | Evidence, Arm | None]:
        """:meth:`choose_refused`, a settled choice's evidence left as a snapshot to put in words."""
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
        trials = self._trials(b) if b.watch is None else []  # settled: none left, until it explores again
        if trials and b.seen.get(inc, 0) < cfg.warmup and feasible(inc):  # the prior's own warm-up
            return inc, (f"{name}: exploring {b.schedule.index(inc) + 1}/{k} (warm-up {b.seen.get(inc, 0) + 1}/"
                         f"{cfg.warmup} of {inc.label}); {self.evidence(name)}"), None
        for arm in trials:
            want, why = self._turn(b, arm)
            if feasible(want):
                return want, f"{name}: exploring {b.schedule.index(arm) + 1}/{k} {why}; {self.evidence(name)}", None
        w = b.watch
        probe = w.next_probe() if w is not None else None
        if (w is not None and probe is not None and cfg.probe_every is not None and w.probe is None
                and w.level > 0 and w.since_probe >= cfg.probe_every - 1 and feasible(probe)):
            return probe, (f"{name}: probing {probe.label}, a runner-up of a near-tie (1 step in "
                           f"{cfg.probe_every}); {self.evidence(name)}"), None
        if not feasible(inc):  # off and the token split always can: inc is a request-aligned split
            return OFF, (f"{name}: {inc.label} cannot split this batch (a {inc.split} split leaves a ubatch without "
                         f"real tokens), off; {self.evidence(name)}"), inc
        return inc, self._evidence(b, f"{name}: "), None

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
        return str(self._evidence(self.bucket(name), ""))

    def _evidence(self, b: _Bucket, head: str) -> Evidence:
        """:meth:`evidence` after ``head``, as a snapshot (:class:`Evidence`) put in words on its first read."""
        rest = b.settled_rest
        if rest is None:
            rest = self._evidence_rest(b)
            if b.watch is not None:
                b.settled_rest = rest
        inc = b.samples.get(b.incumbent)
        return Evidence(head, b.incumbent.label, tuple(inc) if inc else None, bool(b.explored_again), rest)

    def _evidence_rest(self, b: _Bucket) -> str:
        """:meth:`evidence` after the choice's own part: the other configurations' comparisons,
        the skipped ones, the re-explorations (each part after "; ")."""
        parts = [""]
        for arm in b.schedule:
            xs = b.samples.get(arm)
            if arm == b.incumbent or not xs:
                continue
            if arm in b.compared:
                w, mine, theirs, ratio = b.compared[arm]
                parts.append(f"{arm.label} {fmt_samples(mine)} ({len(mine)}, {b.verdicts[arm]} vs {w.label} {fmt_samples(theirs)} "
                             f"({len(theirs)}), ratio {ratio:.3f})")
            else:
                pi = b.paired.get(arm)
                paired = f", {b.incumbent.label} paired {fmt_samples(pi)} ({len(pi)})" if pi else ""
                parts.append(f"{arm.label} {fmt_samples(xs)} ({len(xs)}{paired})")
        for arm in b.schedule:
            r = self._pruned(b, arm) if self.cfg.climb and arm not in b.verdicts and arm != b.incumbent else None
            if r is not None:
                parts.append(f"{arm.label} skipped ({self._base(b.schedule[0]).label} measured {r:.3f}x "
                             f"{b.incumbent.label}, above 1 + prune {self.cfg.prune})")
        if b.explored_again:
            last = b.explored_again[-1]
            more = f" ({len(b.explored_again)} times)" if len(b.explored_again) > 1 else ""
            parts.append(f"explored again{more}, last at the bucket's step {last.step}: {last.why}")
        return "; ".join(parts)

    def watching(self, name: str) -> str:
        """The change detection's state for a settled bucket, e.g. ``'watching N=2 token auto:
        reference 41.20 us/token ±5.8% (64 steps), CUSUM up 1.3 down 0.0 of 10.0'``; '' where the
        bucket is still exploring (or detection and probing are off)."""
        b = self.buckets.get(name)
        if b is None or b.watch is None:
            return ""
        return b.watch.describe(self.cfg, b.incumbent)

    def summary(self) -> str:
        """The re-explorations so far, one clause per bucket (how many, the last one's step and
        why), e.g. ``'explored again: decode 64-127 at its step 412 (off ran slower than its
        reference 1.02 us/token ±5.8%: this step 1.55x, CUSUM slower 12.0 > 10.0 after 39 steps)'``;
        '' where none."""
        return summarize(self.reexplorations)

    def observe(self, name: str, arm: Arm, seconds_per_token: float) -> None:
        """A step of bucket ``name`` ran ``arm`` and cost ``seconds_per_token`` (the group's). An
        incumbent step right after a trial's sample (its turn, :meth:`_turn`) is that sample's pair."""
        if name in self._pins:
            return
        b = self.bucket(name)
        b.steps += 1
        n = b.seen[arm] = b.seen.get(arm, 0) + 1
        if b.watch is not None:
            self._watch(name, b, arm, seconds_per_token)
            return
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
            if len(xi) != len(xa) or not xa:
                continue
            default, other = (arm, inc) if arm == OFF else (inc, arm)  # off is the default side wherever it is one of the two
            side = {arm: list(xa), inc: list(xi)}
            c = decisive(side[default], side[other], cfg.decisive)  # from DECISIVE_PAIRS pairs
            if c is None:
                if len(xa) < cfg.samples:  # the statistical test's first look
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
        if (cfg.detect is not None or cfg.probe_every is not None) and not self._trials(b):
            b.watch = Watch(runners_up=self._runners_up(b))

    def _runners_up(self, b: _Bucket) -> list[Arm]:
        """The configurations that lost to the settled choice in a near-tie (verdict ``tie``: not
        separated, and not more than ``behind`` back), lowest pairs' median ratio first."""
        ties = sorted((c[3], b.schedule.index(a), a) for a, c in b.compared.items()
                      if c[0] == b.incumbent and b.verdicts.get(a) == "tie")
        return [a for _, _, a in ties]

    def _watch(self, name: str, b: _Bucket, arm: Arm, x: float) -> None:
        """A settled bucket's step: the reference's, or one the CUSUM compares with the reference,
        or a probe of the runner-up or its pair (:mod:`asyncdbo.serving.auto_watch`)."""
        w = b.watch
        assert w is not None
        if arm == w.next_probe() and arm != b.incumbent:
            w.take_probe(arm, x)
            return
        if arm != b.incumbent:
            return  # not the choice's step (a pinned or refused one is never observed)
        xs = b.samples.get(arm)
        if xs is None:
            xs = b.samples[arm] = deque(maxlen=self.cfg.window)
        xs.append(x)
        why = w.step(self.cfg, b.incumbent, x, lambda: [(ls, ws) for _, ls, ws, _ in b.compared.values()])
        if why:
            self._explore_again(name, b, why)

    def _explore_again(self, name: str, b: _Bucket, why: str) -> None:
        """Explore bucket ``name`` again: the same schedule, its choice the incumbent (warmed up,
        without samples), every other configuration without samples, warm-up or verdict."""
        r = Reexploration(name, b.steps, b.incumbent, why)
        fresh = _Bucket(schedule=b.schedule, incumbent=b.incumbent, seen={b.incumbent: b.seen.get(b.incumbent, 0)},
                        switches=b.switches, steps=b.steps, explored_again=[*b.explored_again, r])
        self.buckets[name] = fresh
        self.reexplorations.append(r)


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
    bucket, arm, evidence, refused = group_choice_lazy(policy, arms, decision, uniform_R, mask_R)
    return bucket, arm, str(evidence), refused


def group_choice_lazy(policy: AutoPolicy, arms: Sequence[Arm], decision: DPDecision, uniform_R: Sequence[int],
                      mask_R: Sequence[int]) -> tuple[str, Arm, str | Evidence, Arm | None]:
    """:func:`group_choice`, a settled choice's evidence left as an :class:`Evidence` snapshot
    whose ``str()`` is the text (the runner's records make it on their first read)."""
    busy = [r for r, v in enumerate(decision.ranks) if v.vote != "idle"]
    bucket = shape_bucket(max(decision.num_tokens_across_dp, default=0), bool(busy) and all(uniform_R[r] for r in busy))
    if not decision.should_ubatch:
        return bucket, OFF, "", None
    group_mask = -1
    for r in busy:
        group_mask &= mask_R[r]
    arm, evidence, refused = policy._choose(bucket, lambda a: bool(group_mask >> arms.index(a) & 1))
    return bucket, arm, evidence, refused
