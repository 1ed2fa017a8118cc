"""The ``"auto"`` policy's evidence for a step, kept as a snapshot and put in words on its first read.

A settled bucket's evidence names its choice's samples, which change every step; the runner puts
the evidence on every step's record, and few records are ever read. So the policy hands the
record a :class:`Evidence` (what the text says, copied: it does not change as the policy learns)
and :class:`~asyncdbo.plan.StepRecord` makes the text on the first read (issue 46).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Evidence", "fmt_samples"]


def fmt_samples(xs: Sequence[float]) -> str:
    """``median±half the interquartile range`` in µs: statistics.median and interquartile_range's
    quantiles(n=4, method="inclusive"), their arithmetic as they do it, over ONE sorted copy."""
    data = sorted(xs)
    ld = len(data)
    i = ld // 2
    med = data[i] if ld % 2 == 1 else (data[i - 1] + data[i]) / 2
    iqr = 0.0
    if ld >= 2:
        j1, d1 = divmod(ld - 1, 4)
        j3, d3 = divmod(3 * (ld - 1), 4)
        iqr = (data[j3] * (4 - d3) + data[j3 + 1] * d3) / 4 - (data[j1] * (4 - d1) + data[j1 + 1] * d1) / 4
    return f"{med * 1e6:.2f}±{iqr / 2 * 1e6:.2f}"


class Evidence:
    """``head`` + ``'best '`` + the choice's part + ``rest`` (the other configurations' comparisons,
    already in words): the choice ``label`` with its ``samples`` (a copy; None: unmeasured, since
    a re-exploration where ``again``). ``str()`` gives the text."""

    __slots__ = ("head", "label", "samples", "again", "rest")

    def __init__(self, head: str, label: str, samples: tuple[float, ...] | None, again: bool, rest: str) -> None:
        self.head, self.label, self.samples, self.again, self.rest = head, label, samples, again, rest

    def __str__(self) -> str:
        xs, label = self.samples, self.label
        first = (f"{label} {fmt_samples(xs)} us/token ({len(xs)})" if xs
                 else f"{label} (the choice before, unmeasured since)" if self.again
                 else f"{label} (prior, unmeasured)")
        return f"{self.head}best {first}{self.rest}"

    def __repr__(self) -> str:
        return f"Evidence({str(self)!r})"
