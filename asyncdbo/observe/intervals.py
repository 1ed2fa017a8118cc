"""Interval measures for overlap numbers: the union of intervals, and how much of one set ran
under another (comm hidden under compute). Shared by the tracer and the simulator's report."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Interval", "hidden_seconds", "intersection", "union_seconds"]

Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def union_seconds(intervals: Iterable[Interval]) -> float:
    """Measure of the union of ``intervals`` (overlaps counted once)."""
    return sum((b - a for a, b in _union(intervals)), 0.0)


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """``union(a) ∩ union(b)`` as sorted disjoint intervals."""
    xs, ys = _union(a), _union(b)
    i = j = 0
    out: list[Interval] = []
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            out.append((lo, hi))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def hidden_seconds(comm: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Measure of ``union(comm) ∩ union(compute)``: comm time that ran under some compute."""
    return sum((hi - lo for lo, hi in intersection(comm, compute)), 0.0)


