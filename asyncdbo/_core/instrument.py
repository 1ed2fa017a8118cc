"""Hooks a tool (a tracer, the yield checker, a simulator) can subscribe to.

The kernel calls them only when an instrument is set, so an unused instrument costs one
``is not None`` branch per yield. The kernel reads the run's instrument (``DBOOptions.instrument``)
when it enters its switch loop, at the run's start and after every park, and that loop runs in C
when there is none: an instrument set on a run whose ubatches are switching is heard from the
loop's next entry on (set it before the run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kernel import DBORun
    from .ubatch import UBatch

__all__ = ["Fanout", "Instrument"]


class Instrument:
    """Scheduler hooks; override the ones you need."""

    def run_started(self, run: DBORun) -> None:
        """Before the first ubatch step."""

    def resuming(self, ub: UBatch) -> None:
        """Just before ``ub`` is resumed (what it resumes with is already installed)."""

    def stepped(self, ub: UBatch, request: object) -> None:
        """After each step of ``ub``; ``request`` is SWITCH, what it parked on, or None if done."""

    def sleeping(self, run: DBORun) -> None:
        """Every live ubatch is parked; the kernel is about to await a completion."""

    def woke(self, run: DBORun) -> None:
        """The kernel resumed after sleeping."""

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        """After the last ubatch finished (or the run failed with ``exc``)."""


class Fanout(Instrument):
    """Several instruments as one (a tracer and the yield checker, say)."""

    def __init__(self, *instruments: Instrument) -> None:
        self.instruments = tuple(instruments)

    def run_started(self, run: DBORun) -> None:
        for i in self.instruments:
            i.run_started(run)

    def resuming(self, ub: UBatch) -> None:
        for i in self.instruments:
            i.resuming(ub)

    def stepped(self, ub: UBatch, request: object) -> None:
        for i in self.instruments:
            i.stepped(ub, request)

    def sleeping(self, run: DBORun) -> None:
        for i in self.instruments:
            i.sleeping(run)

    def woke(self, run: DBORun) -> None:
        for i in self.instruments:
            i.woke(run)

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        """Every instrument hears the end of the run, even after another one raised (a checker
        that fails the run must not leave a tool's resources behind); the first error is raised."""
        first: BaseException | None = None
        for i in self.instruments:
            try:
                i.run_finished(run, exc)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                if first is None:
                    first = err
        if first is not None:
            raise first
