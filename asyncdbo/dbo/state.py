"""The DBO layer's per-run and per-ubatch state, typed (the kernel keeps them in its ``ext`` slots).

:class:`Lane` is a ubatch's :class:`~asyncdbo.backends.UBatchStreams` plus the recv hook another
ubatch left with it; :class:`RunState` is the run's :class:`~asyncdbo.backends.RunStreams` plus the
named events of :func:`~asyncdbo.dbo.dbo_record_event`. The primitives reach them through
``current_ubatch``: ``ub.ext`` is the Lane, ``ub.run.ext`` the RunState.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .._core import Signal, UBatch
from ..backends import RunStreams, UBatchStreams

__all__ = ["Lane", "RunState", "lane_of", "run_state_of"]


@dataclass(eq=False, slots=True)
class Lane(UBatchStreams):
    """One ubatch's streams and role (filled by the backend) and its pending recv hook.

    Slotted, like :class:`~asyncdbo._core.UBatch`: the primitives' C fast paths
    (``asyncdbo/dbo/_speedups.c``) read and write its fields at their slot offsets."""

    recv_hook: Callable[[], object] | None = None
    # The backend's record and wait, bound once per run (the yield primitives call them on every
    # yield; a bound method looked up through ``ub.run.ext.backend`` costs three loads and a bind).
    record: Callable[[Any, Any], None] = field(default=None, repr=False)  # type: ignore[assignment]
    wait: Callable[[Any, Any], Signal | None] = field(default=None, repr=False)  # type: ignore[assignment]
    # The run's install, bound once per run; None where it has nothing to install (a host).
    install: Callable[[Any], None] | None = field(default=None, repr=False)
    # Works this ubatch handed to dbo_submit in this run (asyncdbo.dist counts the collectives
    # issued on the groups ubatch_group() handed it against this).
    submitted: int = 0


@dataclass(eq=False)
class RunState(RunStreams):
    """A run's backend state plus its named events (key -> (device event or None, signal set on
    the record)), in debug mode the steps that blocked the CPU and the async collectives not yet
    handed to dbo_submit, and what a layer above wants to hear when the run ends."""

    events: dict[Hashable, tuple[Any, Signal]] = field(default_factory=dict)
    blocking: list[Any] = field(default_factory=list)  # debug mode: BlockingStep records
    # debug mode: id(work) -> asyncdbo.dbo.debug.PendingComm, from its issue until dbo_submit
    unsubmitted: dict[int, Any] | None = None
    # Called once when the run ends, with its error or None, outside the ubatches (asyncdbo.dist
    # adds its count of the collectives on per-ubatch groups that never reached dbo_submit).
    on_finish: list[Callable[[BaseException | None], None]] | None = None
    # asyncdbo.dist's count of the collectives on the groups ubatch_group() handed out in this run
    comm_account: Any = None

    def __post_init__(self) -> None:
        for lane in self.lanes:
            lane.record, lane.wait = self.backend.record, self.backend.wait
            run = lane.ub.run  # None for the records of a run shell (asyncdbo.dbo.shell binds it per run)
            lane.install = run.install if run is not None and run.installs else None


def lane_of(ub: UBatch) -> Lane:
    """The :class:`Lane` of a ubatch of a DBO run."""
    lane = ub.ext
    assert isinstance(lane, Lane), f"ubatch {ub.id} has no DBO lane (ext={lane!r})"
    return lane


def run_state_of(ub: UBatch) -> RunState:
    """The :class:`RunState` of the run a ubatch belongs to."""
    state = ub.run.ext
    assert isinstance(state, RunState), f"run {ub.run.name!r} has no DBO state (ext={state!r})"
    return state
