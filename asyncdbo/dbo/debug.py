"""Debug mode of a DBO run (``run_ubatches(..., debug=True)``): checks that cost time per yield.

Yield discipline: every ubatch of a step should pass the same yield points in the same order.

Mismatched yields are the usual cause of lost overlap and of hangs in DBO code: if ubatch 0 yields
at ``dispatch`` while ubatch 1 yields at ``combine``, the ping-pong pairs the wrong stages (one
ubatch's comm no longer runs under the other's compute) and a wait on the other ubatch's event may
never be satisfied. :class:`YieldChecker` (turned on by ``run_ubatches(..., debug=True)``) compares
the sequences of yield tags as the run goes and raises :class:`~asyncdbo.YieldMismatchError` at the
first divergence, naming the ubatch, the position and both tags.

Rules:

* Only handovers count (``dbo_yield`` and the ``dbo_yield_and_switch_*`` primitives). Parking on a
  comm completion or an event is not a yield: whether a ubatch parks depends on timing.
* Position ``k`` of every ubatch must carry the tag the first ubatch to reach position ``k`` had.
* At the end every ubatch must have made the same number of yields, except a ubatch that made
  none at all: it did no staged work (an empty or padding ubatch that returned early), and the
  others are compared among themselves. A ubatch that stopped part-way through is a mismatch.
"""

from __future__ import annotations

from .._core import SWITCH, DBORun, Instrument, UBatch, YieldMismatchError

__all__ = ["YieldChecker"]


class YieldChecker(Instrument):
    """Raises :class:`YieldMismatchError` at the first divergence of the ubatches' yield tags."""

    def __init__(self) -> None:
        self._tags: dict[int, list[str | None]] = {}
        self._first: list[tuple[int, str | None]] = []  # position -> (ubatch, tag) that set it

    def run_started(self, run: DBORun) -> None:
        self._tags = {ub.id: [] for ub in run.ubatches}
        self._first = []

    def stepped(self, ub: UBatch, request: object) -> None:
        if request is not SWITCH:
            return
        seq = self._tags[ub.id]
        pos = len(seq)
        seq.append(ub.tag)
        if pos == len(self._first):
            self._first.append((ub.id, ub.tag))
            return
        ref_ub, ref_tag = self._first[pos]
        if ub.tag != ref_tag:
            raise YieldMismatchError(
                f"yield mismatch in run {ub.run.name!r}: ubatch {ub.id} yield #{pos} is {ub.tag!r} but "
                f"ubatch {ref_ub} yield #{pos} was {ref_tag!r}. Sequences so far: {self._sequences()}. "
                "Every ubatch should pass the same yield points in the same order; check the branches "
                "that skip or add a yield for one ubatch."
            )

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        if exc is not None:
            return
        counts = {i: len(seq) for i, seq in self._tags.items() if seq}
        if len(set(counts.values())) <= 1:
            return
        longest = max(counts, key=lambda i: (counts[i], -i))
        short = min(counts, key=lambda i: (counts[i], i))
        nxt = self._tags[longest][counts[short]]
        raise YieldMismatchError(
            f"yield mismatch in run {run.name!r}: ubatch {short} finished after {counts[short]} yields but "
            f"ubatch {longest} made {counts[longest]} (its yield #{counts[short]} was {nxt!r}). "
            f"Sequences: {self._sequences()}. A ubatch that stops yielding early leaves the others "
            "without a partner to overlap with."
        )

    def _sequences(self) -> str:
        return "; ".join(f"ubatch {i}: {seq}" for i, seq in self._tags.items())
