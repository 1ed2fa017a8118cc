"""What each step's overlap bought, measured as it ran, and the running account of it.

:func:`host_timing` turns a run's :class:`~asyncdbo.dbo.RunStats` into a
:class:`~asyncdbo.plan.StepTiming` from what the host backend already tracks per comm work (issue,
first wait while in flight, ready) and the kernel's time with every ubatch parked: a few array
operations per step over the step's works' stamps, nothing per yield (see "Measuring every step"
in ``docs/auto.md`` for the cost). :class:`OverlapLedger` keeps the account over the steps so far,
per configuration, and :meth:`OverlapLedger.summary` says in one line what DBO paid and why steps
fell out (``DBORunner.report()``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..dbo import RunStats
from ..plan import PlanReason, StepRecord, StepTiming

__all__ = ["OverlapLedger", "close_shape_bucket", "host_timing", "is_shape_bucket", "shape_bucket", "step_timing",
           "union_s"]


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (empty ones count nothing)."""
    return _union_sorted(sorted(intervals))


def _union_sorted(intervals: list[tuple[float, float]]) -> float:
    """:func:`union_s` of intervals sorted by start: the first non-empty one opens the span, then
    each one either extends it or, past its end, closes it and opens the next (an empty one does
    neither; testing for one only past the span's end keeps the common path to two comparisons)."""
    total = 0.0
    it = iter(intervals)
    for cur_start, cur_end in it:
        if cur_end > cur_start:
            break
    else:
        return 0.0
    for start, end in it:
        if start > cur_end:
            if end <= start:
                continue
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    return total + (cur_end - cur_start)


def _union_np(start: np.ndarray, end: np.ndarray) -> float:
    """:func:`union_s` of the intervals ``[start[i], end[i]]``, as array operations: the non-empty
    ones in order of start (a run's issue times already are), the running maximum of their ends,
    a span closing where a start passes it. The spans are summed in order (``cumsum``, not numpy's
    pairwise ``sum``), as :func:`_union_sorted` adds them: the same float, bit for bit."""
    keep = end > start
    if not keep.all():
        start, end = start[keep], end[keep]
    n = start.size
    if n == 0:
        return 0.0
    if n > 1 and not (start[1:] >= start[:-1]).all():
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    opens = np.flatnonzero(start[1:] > reach[:-1])  # span k + 1 opens at opens[k] + 1
    if not opens.size:
        return float(reach[-1] - start[0])
    spans = np.empty(opens.size + 1)
    spans[0] = reach[opens[0]] - start[0]
    spans[1:-1] = reach[opens[1:]] - start[opens[:-1] + 1]
    spans[-1] = reach[-1] - start[opens[-1] + 1]
    return float(np.cumsum(spans)[-1])


def host_timing(stats: RunStats, step_s: float) -> StepTiming:
    """The step's :class:`~asyncdbo.plan.StepTiming` from the host backend's comm stamps (a
    backend that tracks none, an accelerator's, gives the step time alone).

    comm = union of [issue, ready]; waited = union of [first wait, ready] (a ubatch parked on the
    work); exposed = the kernel's time with every ubatch parked (capped at waited; all of waited
    with one ubatch); hidden by other ubatches = waited - exposed (parked, but another ubatch ran);
    hidden by its own ubatch = comm - waited. Folded as arrays over the run's
    :class:`~asyncdbo.backends.CommStamps`: no object per work (issue 46)."""
    stamps = stats.stamps
    if not len(stamps):
        if stats.time_asleep_s > 0:  # parked on something the backend does not track
            return StepTiming(step_s=step_s, num_ubatches=stats.num_ubatches)
        return StepTiming(step_s=step_s, num_ubatches=stats.num_ubatches, comm_s=0.0, exposed_s=0.0,
                          hidden_by_others_s=0.0, hidden_own_s=0.0, source="host")
    issue, done, release, wait = stamps.times()
    ready = np.fmax(done, release)  # the later of completion and release (fmax: a NaN release is none)
    landed = done == done  # not NaN: completed (a work still in flight is in neither union)
    waited_on = wait == wait
    if landed.all():
        comm_s = _union_np(issue, ready)
    else:
        comm_s = _union_np(issue[landed], ready[landed])
        waited_on &= landed
    waited = min(_union_np(wait[waited_on], ready[waited_on]), comm_s)
    # One ubatch: nobody else can run while it waits, so all its waiting is exposed. The kernel's
    # asleep time is that same span read at other moments (after the kernel's own bookkeeping
    # around the park), which under load came out 20 us shorter and read as "hidden by others".
    exposed = waited if stats.num_ubatches == 1 else min(stats.time_asleep_s, waited)
    return StepTiming(step_s=step_s, num_ubatches=stats.num_ubatches, comm_s=comm_s, exposed_s=exposed,
                      hidden_by_others_s=waited - exposed, hidden_own_s=comm_s - waited, source="host")


def step_timing(stats: RunStats, step_s: float, step: int, every: int) -> StepTiming:
    """Step ``step``'s timing: :func:`host_timing` on every ``every``-th step (``step % every ==
    0``), else the step time alone (``RunnerConfig.measure_every``: the comm summary is the part
    of the measurement that grows with the step's comm works)."""
    if step % every == 0:
        return host_timing(stats, step_s)
    return StepTiming(step_s=step_s, num_ubatches=stats.num_ubatches)


@dataclass
class _Account:
    steps: int = 0
    step_s: float = 0.0
    tokens: int = 0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    hidden_by_others_s: float = 0.0
    measured: int = 0  # steps with comm numbers


def shape_bucket(num_tokens: int, uniform_decode: bool) -> str:
    """The step-shape bucket of a step whose largest DP rank has ``num_tokens`` real tokens: its
    kind and power-of-two range, e.g. ``'decode 64-127'``, ``'mixed 512-1023'`` (``uniform_decode``:
    every busy rank runs only one-token requests)."""
    if num_tokens < 1:
        return "idle"
    key = (num_tokens.bit_length(), bool(uniform_decode))
    name = _BUCKET_NAMES.get(key)
    if name is None:  # a few dozen names ever: formatted once each, not every step
        lo = 1 << (num_tokens.bit_length() - 1)
        name = _BUCKET_NAMES[key] = f"{'decode' if uniform_decode else 'mixed'} {lo}-{2 * lo - 1}"
    return name


_BUCKET_NAMES: dict[tuple[int, bool], str] = {}


def _bucket_words(bucket: str) -> str:
    """A :func:`shape_bucket` in words: ``'decode 1-1'`` -> ``'decode steps of 1 token'``,
    ``'mixed 64-127'`` -> ``'mixed steps of 64-127 tokens'``."""
    kind, _, span = bucket.partition(" ")
    if not span:
        return f"{bucket} steps"
    lo, _, hi = span.partition("-")
    return f"{kind} steps of {lo} token" if lo == hi == "1" else f"{kind} steps of {lo if lo == hi else span} tokens"


#: Why a step ran unsplit, in words (the :class:`~asyncdbo.plan.PlanReason` value follows in brackets).
_REASON_WORDS = {
    "disabled": "with DBO off",
    "single_ubatch": "with one ubatch configured",
    "below_threshold": "below the token threshold",
    "policy_refused": "that the split policy could not split",
    "rank_declined": "that another DP rank could not split",
    "imbalance": "with the DP ranks too unequal",
    "all_idle": "with no tokens on any rank",
    "auto_off": 'where tuning="auto" measured or expected DBO slower',
}


def is_shape_bucket(name: object) -> bool:
    """Whether ``name`` is a bucket :func:`shape_bucket` gives for some step: ``'idle'``, or
    ``'decode LO-HI'`` / ``'mixed LO-HI'`` with ``LO`` a power of two and ``HI = 2 * LO - 1``
    (checked by asking :func:`shape_bucket` for ``LO`` tokens, so the two cannot drift apart)."""
    if name == "idle":
        return True
    if not isinstance(name, str):
        return False
    kind, _, rng = name.partition(" ")
    lo = rng.partition("-")[0]
    return (kind in ("decode", "mixed") and lo.isascii() and lo.isdigit() and int(lo) >= 1
            and shape_bucket(int(lo), kind == "decode") == name)


def close_shape_bucket(name: str) -> str | None:
    """The :func:`shape_bucket` a mistyped bucket name most likely meant (its first number's bucket,
    decode where the name says so, else mixed), e.g. ``'mixed 64-127'`` for ``'mixed 64-128'``;
    None where the name holds no number >= 1."""
    digits = re.search(r"[0-9]+", name)
    if digits is None or int(digits.group()) < 1:
        return None
    return shape_bucket(int(digits.group()), "decode" in name)


@dataclass
class OverlapLedger:
    """The account of the steps so far: per step-shape bucket and configuration the steps, their
    time, tokens and comm split, and the reasons steps fell out. Fed one record per step (with its
    ``timing``)."""

    accounts: dict[tuple[str, str], _Account] = field(default_factory=dict)
    fell_out: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    failed: int = 0  # steps that raised (DBORunner.step counts them): in no account

    def add(self, record: StepRecord, num_tokens: int, bucket: str) -> None:
        """Count one step's ``record`` (``num_tokens``: its real tokens on this rank; ``bucket``:
        its :func:`shape_bucket`)."""
        self.num_steps += 1
        key = record.config or ("off" if not record.microbatched else f"N={len(record.ubatch_num_tokens)}")
        acc = self.accounts.get((bucket, key))
        if acc is None:  # (setdefault would build an _Account every step)
            acc = self.accounts[(bucket, key)] = _Account()
        acc.steps += 1
        acc.tokens += num_tokens
        if not record.microbatched:
            self.fell_out[record.reason.value] = self.fell_out.get(record.reason.value, 0) + 1
        t = record.timing
        if t is None:
            return
        acc.step_s += t.step_s
        if t.comm_s is not None:
            acc.measured += 1
            acc.comm_s += t.comm_s
            acc.exposed_s += t.exposed_s or 0.0
            acc.hidden_by_others_s += t.hidden_by_others_s or 0.0

    def per_config(self) -> dict[str, _Account]:
        """The accounts summed over buckets, per configuration."""
        out: dict[str, _Account] = {}
        for (_, key), acc in self.accounts.items():
            tot = out.setdefault(key, _Account())
            for name in ("steps", "step_s", "tokens", "comm_s", "exposed_s", "hidden_by_others_s", "measured"):
                setattr(tot, name, getattr(tot, name) + getattr(acc, name))
        return out

    def speedups(self) -> list[tuple[str, str, float]]:
        """``(bucket, config, off time per token / config time per token)`` for every bucket where
        both a microbatched configuration and ``off`` ran (above 1: DBO won there)."""
        out = []
        for (bucket, key), acc in sorted(self.accounts.items()):
            off = self.accounts.get((bucket, "off"))
            if key == "off" or off is None or not (off.tokens and off.step_s and acc.tokens and acc.step_s):
                continue
            out.append((bucket, key, (off.step_s / off.tokens) / (acc.step_s / acc.tokens)))
        return out

    def summary(self) -> str:
        """One line: per configuration the steps, time per real token, the comm exposed and hidden
        by other ubatches; DBO's speed-up over ``off`` in each bucket where both ran; why steps
        fell out. E.g. ``'12 steps: N=2 token 8 steps 41.2 us/token, comm 0.52 ms/step 30% exposed
        61% hidden by other ubatches; off 4 steps 48.0 us/token, comm 0.50 ms/step 92% exposed 0%
        hidden by other ubatches; speedup vs off (...): decode steps of 64-127 tokens, N=2 token 1.12x (8 vs 4 off
        steps); ran unsplit: 4 steps where tuning="auto" measured or expected DBO slower (auto_off)'``, ending
        ``'; 2 failed step(s) not counted'`` where ``failed`` steps raised."""
        failed = f"; {self.failed} failed step(s) not counted" if self.failed else ""
        if not self.num_steps:
            return "0 steps" + failed
        parts = []
        for key, acc in sorted(self.per_config().items(), key=lambda kv: (-kv[1].steps, kv[0])):
            text = f"{key} {acc.steps} steps"
            if acc.tokens and acc.step_s:
                text += f" {acc.step_s / acc.tokens * 1e6:.1f} us/token"
            if acc.measured and acc.comm_s > 0:
                text += (f", comm {acc.comm_s / acc.measured * 1e3:.2f} ms/step {acc.exposed_s / acc.comm_s:.0%} "
                         f"exposed {acc.hidden_by_others_s / acc.comm_s:.0%} hidden by other ubatches")
            parts.append(text)
        line = f"{self.num_steps} steps: " + "; ".join(parts)
        wins = self.speedups()
        if wins:
            line += ("; speedup vs off (off's time per token / DBO's, each summed over its steps): " + ", ".join(
                f"{_bucket_words(b)}, {k} {x:.2f}x ({self.accounts[(b, k)].steps} vs "
                f"{self.accounts[(b, 'off')].steps} off steps)" for b, k, x in wins))
        if self.fell_out:
            line += "; ran unsplit: " + ", ".join(
                f"{n} step{'s' if n != 1 else ''} {_REASON_WORDS.get(k, k)} ({k})" for k, n in sorted(self.fell_out.items()))
        return line + failed
