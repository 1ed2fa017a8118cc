"""Paired comparisons of step times: is one configuration faster than another, and by how much,
given few noisy samples? The statistics under :class:`~asyncdbo.serving.auto.AutoPolicy` (its
module docstring says how the policy uses them); pure functions of the samples."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DECISIVE_PAIRS", "Comparison", "compare", "compare_paired", "decisive", "interquartile_range",
           "paired_sigma", "pooled_sigma", "relative_sigma"]


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


def interquartile_range(xs: Sequence[float]) -> float:
    """The interquartile range (0 for fewer than 2 samples)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def relative_sigma(xs: Sequence[float]) -> float:
    """The samples' robust sigma as a share of their median: IQR / 1.349 (a normal's sigma) / median."""
    m = statistics.median(xs) if xs else 0.0
    return interquartile_range(xs) / 1.349 / m if m > 0 else 0.0


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
DECISIVE_PAIRS = 2


def decisive(default: Sequence[float], other: Sequence[float], gap: float | None) -> Comparison | None:
    """A comparison of samples taken in pairs that every pair already decides (``AutoConfig.decisive``):
    with at least :data:`DECISIVE_PAIRS` pairs, every ratio ``other[i] / default[i]`` above
    ``1 + gap`` (the other is slower: the default wins) or every one below ``1 / (1 + gap)`` (the
    other wins), the loser separated as slower; else None, for :func:`compare_paired` to decide.
    Faking a gap that large takes a host hiccup in a step of every pair, and exploring on costs
    most exactly there: each further pair runs the loser once more (off, on ``auto_measured.py``'s
    mixed-arrivals 256-511-token steps, took 1.85 to 2.98 times N = 2's time per token in run 12's
    decided pairs, ``benchmarks/results/auto_measured_cpu-2c_2026-12-03_run12.md``). Pure."""
    n = len(default)
    assert n == len(other), "paired samples come in pairs"
    if gap is None or n < DECISIVE_PAIRS or any(d <= 0 for d in default):
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
    return interquartile_range(devs) / 1.349 if len(devs) >= 2 else 0.0
