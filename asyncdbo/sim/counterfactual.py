"""The cost of lost overlap, measured: the same schedule run again without the defect.

A lost-overlap finding (:class:`~asyncdbo.sim.races.LostOverlap`) is found from the order of
ops, not from timing. What it costs is measured by a counterfactual run: the same schedule on a
fresh backend of the same configuration whose ``fix`` names the finding's key, where the sim does
at that place what the schedule without the defect would do (:data:`~asyncdbo.sim.races.LOST_KINDS`
says what, per kind; a ``comm-not-overlapped`` await that cannot move past the next yield, because
the transfer's data is used before it, is rerun with a yield before it instead). The cost is this run's makespan minus the counterfactual's: a figure of the
sim itself, not an estimate beside it, so a layer that got slower never reads "0 us". Findings that
share a cause (a compute kernel behind a wait; the other ubatch's work behind the same wait) each
measure part of it: one more run with every finding fixed at once gives what they cost together
(:attr:`~asyncdbo.sim.SimReport.lost_overlap_s`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from .backend import SimBackend
from .races import SimCheckError
from .report import SimReport

__all__ = ["measure_lost_overlap"]


async def measure_lost_overlap(run: Callable[[SimBackend], Awaitable[Any]], make: Callable[..., SimBackend], *,
                               raise_problems: bool = True,
                               estimate: dict[str, Any] | None = None) -> tuple[SimReport, Any]:
    """Run ``run(make(on_problem="record"))``, then once per distinct lost-overlap key
    ``run(make(on_problem="record", fix=[key]))``; return the first run's report, every finding's
    ``cost_s`` filled in, and what ``run`` returned. ``make(**overrides)`` builds a backend of one
    configuration. With ``raise_problems``, the first run's problems (races, dead waits, lost
    overlap when its ``fail_on`` says so) raise :class:`~asyncdbo.sim.SimCheckError` afterwards,
    with their costs. ``estimate``: overrides of ``make`` (``{"host": "eager"}``) under which each
    host sync is costed again, the same way, as the cost model's estimate on a GPU
    (:attr:`~asyncdbo.sim.LostOverlap.estimate_s`, with that run's makespan as its step time)."""
    be = make(on_problem="record")
    result = await run(be)
    rep = be.report
    assert rep is not None
    costs: dict[tuple[str, str], float] = {}
    fixes: list[tuple[str, str]] = []
    moved: list[Any] = []
    for lo in rep.lost_overlaps:
        if lo.key in costs:
            continue
        fix = [lo.key]
        fixed = make(on_problem="record", fix=fix)
        await run(fixed)
        if lo.key in fixed.undeferred:  # the await could not move past the next yield: a yield before it
            fix.append(("yield-before-use", lo.site.place))
            fixed = make(on_problem="record", fix=fix)
            await run(fixed)
        if fixed.moved:  # moved before a wait that began a segment: issued before that segment's yield instead
            ops = list(fixed.moved)
            moved += ops
            fixed = make(on_problem="record")
            fixed._preissue = ops
            await run(fixed)
        assert fixed.report is not None
        costs[lo.key] = rep.makespan_s - fixed.report.makespan_s
        fixes += fix
    rep.lost_overlaps = [replace(lo, cost_s=costs[lo.key]) for lo in rep.lost_overlaps]
    if len(costs) > 1:  # findings of one cause each measure part of it: all fixed at once, the run without them
        fixed = make(on_problem="record", fix=fixes)
        fixed._preissue = moved
        await run(fixed)
        assert fixed.report is not None
        rep.lost_overlap_s = rep.makespan_s - fixed.report.makespan_s
    elif costs:
        rep.lost_overlap_s = next(iter(costs.values()))
    syncs = [lo.key for lo in rep.lost_overlaps if lo.kind == "host-sync"]
    if estimate is not None and syncs:
        base = make(on_problem="record", **estimate)
        await run(base)
        assert base.report is not None
        on = f"{base.device.name}, {base.host.name} launches"
        est: dict[tuple[str, str], float] = {}
        for key in dict.fromkeys(syncs):
            fixed = make(on_problem="record", fix=[key], **estimate)
            await run(fixed)
            assert fixed.report is not None
            est[key] = base.report.makespan_s - fixed.report.makespan_s
        rep.lost_overlaps = [replace(lo, estimate_s=est[lo.key], estimate_step_s=base.report.makespan_s, estimate_on=on)
                             if lo.key in est else lo for lo in rep.lost_overlaps]
    if raise_problems and rep.problems:
        raise SimCheckError(rep.problems)
    return rep, result
