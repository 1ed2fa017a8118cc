"""What one run on the simulated device did: its makespan, busy times, spans and findings."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..observe.intervals import hidden_seconds, union_seconds
from .clock import Span
from .races import DeadWait, LostOverlap, Race

__all__ = ["SimReport"]


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
    races: list[Race] = field(default_factory=list)
    lost_overlaps: list[LostOverlap] = field(default_factory=list)
    dead_waits: list[DeadWait] = field(default_factory=list)

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
        return [*self.races, *self.dead_waits]
