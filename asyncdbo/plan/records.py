"""Why each step did or did not microbatch.

Silent fall-out is the most common complaint about every DBO implementation: a step quietly runs
unsplit and the overlap is gone.  So every planned step yields a :class:`StepRecord` with a
:class:`PlanReason`, and :class:`PlanStats` counts them.  Records are logged at DEBUG on the
``asyncdbo.plan`` logger; the library never prints.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["PlanReason", "PlanStats", "RankVote", "StepRecord", "log_record"]

logger = logging.getLogger("asyncdbo.plan")


class PlanReason(enum.Enum):
    """The outcome of planning a step: microbatched, or the reason it was not."""

    MICROBATCHED = "microbatched"
    DISABLED = "disabled"  # the caller turned microbatching off for this step
    SINGLE_UBATCH = "single_ubatch"  # num_ubatches == 1: nothing to split
    BELOW_THRESHOLD = "below_threshold"  # too few tokens for overlap to pay off
    POLICY_REFUSED = "policy_refused"  # the split policy cannot give every ubatch real tokens
    RANK_DECLINED = "rank_declined"  # another busy DP rank voted no
    IMBALANCE = "imbalance"  # busy DP ranks differ more than the allowed ratio
    ALL_IDLE = "all_idle"  # no rank has real tokens


@dataclass(frozen=True, slots=True)
class RankVote:
    """One DP rank's contribution to the step decision, as every rank saw it after the vote."""

    rank: int
    vote: str  # "yes", "no" or "idle"
    reason: PlanReason  # its local reason (MICROBATCHED when it voted yes)
    num_tokens_unpadded: int
    num_tokens_padded: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What planning decided for one step and why."""

    step: int
    microbatched: bool
    reason: PlanReason
    detail: str = ""
    ubatch_num_tokens: tuple[int, ...] = ()  # real tokens per ubatch (one entry if unsplit)
    ubatch_num_tokens_padded: tuple[int, ...] = ()
    num_tokens_padded: int = 0
    policy: str = ""
    ranks: tuple[RankVote, ...] = ()  # empty without a DP group


def log_record(rec: StepRecord) -> None:
    """Log one record at DEBUG on ``asyncdbo.plan`` (``plan_step`` does this for every step)."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "step %d: %s%s ubatches=%s padded=%d",
            rec.step,
            rec.reason.value,
            f" ({rec.detail})" if rec.detail else "",
            list(rec.ubatch_num_tokens),
            rec.num_tokens_padded,
        )


@dataclass
class PlanStats:
    """Counters over many steps; pass one to :func:`asyncdbo.plan.plan_step` as ``stats``."""

    num_steps: int = 0
    counts: Counter[PlanReason] = field(default_factory=Counter)
    last: StepRecord | None = None

    def record(self, rec: StepRecord) -> None:
        self.num_steps += 1
        self.counts[rec.reason] += 1
        self.last = rec

    @property
    def microbatched_share(self) -> float:
        """Fraction of steps that microbatched (0.0 before the first step)."""
        return self.counts[PlanReason.MICROBATCHED] / self.num_steps if self.num_steps else 0.0

    def summary(self) -> str:
        """One line, e.g. ``'10 steps, 70% microbatched; below_threshold=3'``."""
        others = "; ".join(
            f"{r.value}={n}" for r, n in sorted(self.counts.items(), key=lambda kv: kv[0].value)
            if r is not PlanReason.MICROBATCHED
        )
        head = f"{self.num_steps} steps, {self.microbatched_share:.0%} microbatched"
        return f"{head}; {others}" if others else head
