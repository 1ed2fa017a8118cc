"""A run's comm works as stamps in arrays, and the record of one work made from them on demand.

The host backend stamps each work's issue, completion, release and first wait into a run's
:class:`CommStamps` (one float column per time, NaN for "not yet" or "never"), not into an object
per work: the runner's per-step measurement folds the columns as arrays
(:func:`asyncdbo.serving.measure.host_timing`), and a :class:`CommRecord` per work is made only
for a reader that asks for records (``RunStats.comm``, traces, reports). Building those records
was most of the measurement's cost (issue 46: 514 of 820 µs for a 61-layer step's 366 works).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where the arrays are read: ``import asyncdbo`` needs neither it nor torch
    import numpy as np

__all__ = ["CommRecord", "CommStamps"]

_NAN = math.nan


@dataclass(frozen=True)
class CommRecord:
    """One comm work a backend tracked in a run, for the tools that report comm time: the ubatch
    that issued it, what it was, its bytes, when it was issued, when the transport completed it
    (``t_done``, None while in flight), when a modeled link released it (``t_release``, None
    without one) and when a ubatch first waited for it while it was still in flight (``t_wait``,
    None if it was done before anyone waited: the issuing ubatch's own compute hid it); all on the
    run's clock."""

    ub: int
    what: str
    nbytes: int
    t_issue: float
    t_done: float | None
    t_release: float | None = None
    t_wait: float | None = None

    @property
    def t_end(self) -> float | None:
        """When the waiting ubatch could go on: the later of completion and release."""
        if self.t_done is None:
            return None
        return self.t_done if self.t_release is None else max(self.t_done, self.t_release)


def _none(x: float) -> float | None:
    return None if x != x else x  # NaN: not stamped


class CommStamps:
    """The comm works of one run, a row each, in issue order: ``ub`` (-1 outside a run),
    ``nbytes``, ``what`` and the times ``t_issue``, ``t_done``, ``t_release``, ``t_wait`` as
    ``array('d')`` columns, NaN where a time is not (yet) known. :meth:`add` appends a row; the
    handle of the work writes its later times into its row (gloo's thread its completion: an
    item store, atomic under the GIL). :meth:`frozen` is a copy that no later stamp changes."""

    __slots__ = ("ub", "nbytes", "what", "t_issue", "t_done", "t_release", "t_wait")

    def __init__(self) -> None:
        self.ub = array("q")
        self.nbytes = array("q")
        self.what: list[str] = []
        self.t_issue = array("d")
        self.t_done = array("d")
        self.t_release = array("d")
        self.t_wait = array("d")

    def __len__(self) -> int:
        return len(self.what)

    def add(self, ub: int, nbytes: int, what: str, t_issue: float) -> int:
        """A new row for a work issued at ``t_issue``, its other times unknown; returns its index."""
        i = len(self.what)
        self.ub.append(ub)
        self.nbytes.append(nbytes)
        self.what.append(what)
        self.t_issue.append(t_issue)
        self.t_done.append(_NAN)
        self.t_release.append(_NAN)
        self.t_wait.append(_NAN)
        return i

    def frozen(self) -> CommStamps:
        """The rows so far as no later stamp changes them: what a run's
        :class:`~asyncdbo.dbo.RunStats` keeps, so that a completion stamped after the run ended
        shows in neither. Only the times a handle writes after :meth:`add` (``t_done``, ``t_wait``)
        are copied; the other columns are shared, and a run's stamps get no row after the run
        (``asyncdbo.dbo.shell`` gives the next run new ones)."""
        out = CommStamps.__new__(CommStamps)
        out.ub, out.nbytes, out.what, out.t_issue, out.t_release = (
            self.ub, self.nbytes, self.what, self.t_issue, self.t_release)
        out.t_done, out.t_wait = self.t_done[:], self.t_wait[:]
        return out

    def record(self, i: int) -> CommRecord:
        """Row ``i`` as a :class:`CommRecord` (None for each time not stamped)."""
        return CommRecord(ub=self.ub[i], what=self.what[i], nbytes=self.nbytes[i], t_issue=self.t_issue[i],
                          t_done=_none(self.t_done[i]), t_release=_none(self.t_release[i]),
                          t_wait=_none(self.t_wait[i]))

    def records(self) -> list[CommRecord]:
        """Every row as a :class:`CommRecord`, in issue order."""
        return [self.record(i) for i in range(len(self.what))]

    @classmethod
    def of(cls, records: Iterable[CommRecord]) -> CommStamps:
        """The stamps of ``records`` (a run's stats built from records rather than by a run)."""
        out = cls()
        for r in records:
            i = out.add(r.ub, r.nbytes, r.what, r.t_issue)
            for name in ("t_done", "t_release", "t_wait"):
                value = getattr(r, name)
                if value is not None:
                    getattr(out, name)[i] = value
        return out

    def times(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(t_issue, t_done, t_release, t_wait)`` as float64 numpy arrays over the columns' memory
        (no copy: read them, do not keep them past a next :meth:`add`, which cannot grow an array
        while a view of it lives)."""
        import numpy as np

        return (np.frombuffer(self.t_issue), np.frombuffer(self.t_done), np.frombuffer(self.t_release),
                np.frombuffer(self.t_wait))
