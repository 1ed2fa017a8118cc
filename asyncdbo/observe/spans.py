"""What a traced step yields: its spans and its numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunNumbers", "Span"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """One interval of a step. ``kind``: ``compute`` (a CPU step or compute-stream device span),
    ``wait`` (parked), ``comm`` (a comm work or a comm-stream device span)."""

    ub: int
    kind: str
    role: str
    name: str
    t0: float
    t1: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunNumbers:
    """The numbers of one step (one DBO run).

    wall_s: first resume to run end. switches: ``SWITCH`` yields. parks: times a ubatch parked.
    yields_per_ubatch: ``SWITCH`` yields of each ubatch. parked_s: total time ubatches spent
    parked (summed over ubatches). idle_s: time every ubatch was parked (the CPU had nothing to do).
    compute_s: total CPU (or compute-stream) time of ubatch steps. comm_s: measure of the union of
    comm intervals. comm_hidden_s / comm_hidden_share: see :mod:`asyncdbo.observe.tracer`.
    comm_hidden_by_other_s: the part of comm_hidden_s during which a *different* ubatch computed
    than the one whose comm was in flight: the overlap DBO adds. The rest of comm_hidden_s ran
    under the same ubatch's own compute between issuing a transfer and waiting for it (the MoE
    layer's shared expert while its combine is in flight), which happens without DBO too; a
    one-ubatch (serial) run has comm_hidden_by_other_s == 0.
    microbatched / reason: from :meth:`Tracer.mark_step` (None when the step was not marked).
    blocking_s: CPU time blocked in the steps debug mode reported (0 outside debug mode); those
    steps are not counted in compute_s.
    """

    step: int
    rank: int
    name: str
    backend: str
    num_ubatches: int
    wall_s: float
    switches: int
    parks: int
    yields_per_ubatch: tuple[int, ...]
    parked_s: float
    idle_s: float
    compute_s: float
    comm_s: float
    comm_hidden_s: float
    comm_hidden_share: float
    num_comm_works: int
    comm_bytes: int
    microbatched: bool | None = None
    reason: str | None = None
    blocking_s: float = 0.0
    comm_hidden_by_other_s: float = 0.0

    @property
    def comm_hidden_by_other_share(self) -> float:
        """comm_hidden_by_other_s / comm_s (0 when there is no comm)."""
        return self.comm_hidden_by_other_s / self.comm_s if self.comm_s > 0 else 0.0

    def summary(self) -> str:
        """One line for logs, the demo and the PNG title. It ends saying whether the step was
        microbatched (from :meth:`Tracer.mark_step`'s record, else from its ubatch count), since
        its overlap shares mean nothing for a step that ran as one batch."""
        text = (
            f"wall {self.wall_s * 1e3:.2f} ms, compute {self.compute_s * 1e3:.2f} ms, "
            f"comm {self.comm_s * 1e3:.2f} ms ({self.comm_hidden_share:.0%} hidden, "
            f"{self.comm_hidden_by_other_share:.0%} by another ubatch), "
            f"parked {self.parked_s * 1e3:.2f} ms, {self.switches} switches, yields/ub {list(self.yields_per_ubatch)}"
        )
        if self.microbatched is not None:
            text += ", microbatched" if self.microbatched else f", not microbatched ({self.reason})"
        elif self.num_ubatches == 1:  # no planner record: the run itself says whether it was split
            text += ", 1 ubatch (not microbatched)"
        else:
            text += f", microbatched into {self.num_ubatches} ubatches"
        return text
