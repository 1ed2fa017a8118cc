"""What one run on the simulated device did: its makespan, busy times, spans and findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..observe.intervals import hidden_seconds, union_seconds
from .clock import Span
from .races import ALWAYS_FAIL, DeadWait, LostOverlap, Race

__all__ = ["SimReport", "chrome_trace"]


@dataclass
class SimReport:
    """What one run on the sim did. Times are virtual seconds from the start of the run."""

    device: str
    link: str
    policy: str
    num_ubatches: int
    makespan_s: float = 0.0
    compute_busy_s: float = 0.0
    comm_busy_s: float = 0.0  # sum of comm op durations (latency included)
    spans: list[Span] = field(default_factory=list)
    switches: int = 0
    parks: int = 0
    comm_bytes: int = 0
    host_blocked_s: float = 0.0  # time the modeled CPU waited in blocking syncs
    host_syncs: int = 0  # ops that made the modeled CPU wait (asyncdbo.syncs)
    host_sync_ops: dict[str, int] = field(default_factory=dict)  # those ops by name
    fail_on: tuple[str, ...] = ()  # findings besides races and dead waits that count as problems
    races: list[Race] = field(default_factory=list)
    lost_overlaps: list[LostOverlap] = field(default_factory=list)
    dead_waits: list[DeadWait] = field(default_factory=list)
    #: what the lost overlap cost together: this run's makespan minus a counterfactual run's with
    #: every finding fixed at once (:func:`asyncdbo.sim.counterfactual.measure_lost_overlap`);
    #: None where none was run or nothing was found
    lost_overlap_s: float | None = None

    def _intervals(self, kind: str) -> list[tuple[float, float]]:
        return [(s.start, s.end) for s in self.spans if s.kind == kind]

    @property
    def comm_s(self) -> float:
        """Time some comm was in flight (the union of comm spans)."""
        return union_seconds(self._intervals("comm"))

    @property
    def exposed_comm_s(self) -> float:
        """Time some comm was in flight while the compute engine was idle."""
        return self.comm_s - hidden_seconds(self._intervals("comm"), self._intervals("compute"))

    @property
    def hidden_comm_share(self) -> float:
        """Share of the time comm was in flight that compute covered (0 with no comm)."""
        total = self.comm_s
        return 0.0 if total <= 0 else 1.0 - self.exposed_comm_s / total

    @property
    def problems(self) -> list[object]:
        """Races and dead waits, plus lost overlap when the run was asked to fail on it (except a
        finding whose counterfactual run measured no cost at this size; a host sync between yields
        fails whatever it cost here: a GPU pays it at any size; so does a recv hook that received
        nothing: with a hook-based comm library, DeepEP's low-latency kernels, the hook is what
        launches the receive, and without it the data never lands)."""
        lost: list[object] = [lo for lo in self.lost_overlaps
                              if lo.kind in ALWAYS_FAIL or lo.cost_s is None or lo.cost_s > 0] \
            if "lost-overlap" in self.fail_on else []
        return [*self.races, *self.dead_waits, *lost]


def chrome_trace(report: SimReport, *, rank: int = 0, label: str = "") -> dict[str, Any]:
    """A Chrome trace (Perfetto, ``asyncdbo trace`` PNGs) of one sim run, in the layout of
    :meth:`asyncdbo.trace.Tracer.to_chrome` for device spans: pid = rank, one thread per (ubatch,
    stream role) with tid ``ub * 100 + 50`` (compute) or ``+ 60`` (comm) plus a lane when spans of
    one thread overlap; ``ts``/``dur`` in microseconds of the virtual clock; the run's numbers
    under ``otherData.asyncdbo.ranks[0].steps`` with the Tracer's field names."""
    name = f"rank {rank} (sim {report.device} + {report.link}{', ' + label if label else ''})"
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    lanes: dict[tuple[int, str], list[float]] = {}
    named: set[int] = set()
    for s in sorted(report.spans, key=lambda s: s.start):
        ub = s.ubatch or 0
        ends = lanes.setdefault((ub, s.kind), [])
        lane = next((k for k, e in enumerate(ends) if s.start >= e - 1e-12), len(ends))
        if lane == len(ends):
            ends.append(s.end)
        else:
            ends[lane] = s.end
        tid = ub * 100 + (50 if s.kind == "compute" else 60) + lane
        if tid not in named:
            named.add(tid)
            label_t = f"ub{ub} {s.kind} stream" + (f" {lane}" if lane else "")
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label_t}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
        args = {"ub": ub, "kind": s.kind, "role": s.kind, "device": True, "stream": s.stream, "tag": s.tag, "step": 0}
        events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": rank, "tid": tid, "ts": s.start * 1e6,
                       "dur": (s.end - s.start) * 1e6, "args": args})
    comm_s = report.comm_s
    step = {
        "step": 0, "rank": rank, "name": label or "sim", "backend": f"sim ({report.device}, {report.link})",
        "num_ubatches": report.num_ubatches, "wall_s": report.makespan_s, "switches": report.switches,
        "parks": report.parks, "yields_per_ubatch": [], "parked_s": 0.0,
        "idle_s": max(0.0, report.makespan_s - report.compute_busy_s), "compute_s": report.compute_busy_s,
        "comm_s": comm_s, "comm_hidden_s": comm_s - report.exposed_comm_s,
        "comm_hidden_share": report.hidden_comm_share, "num_comm_works": sum(1 for s in report.spans if s.kind == "comm"),
        "comm_bytes": report.comm_bytes, "microbatched": report.num_ubatches > 1,
        "reason": None if report.num_ubatches > 1 else "serial baseline",
    }
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"asyncdbo": {"ranks": [{"rank": rank, "steps": [step]}], "clock": "sim"}},
    }
