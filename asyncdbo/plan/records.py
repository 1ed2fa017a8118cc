"""Why each step did or did not microbatch.

Silent fall-out is the most common complaint about every DBO implementation: a step quietly runs
unsplit and the overlap is gone.  So every planned step yields a :class:`StepRecord` with a
:class:`PlanReason`, and :class:`PlanStats` counts them.  Records are logged at DEBUG on the
``asyncdbo.plan`` logger; the library never prints.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["PlanReason", "PlanStats", "RankVote", "StepRecord", "StepTiming", "log_record"]

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
    AUTO_OFF = "auto_off"  # the "auto" policy measured (or, before measuring, its prior says) DBO loses on this shape


@dataclass(frozen=True, slots=True)
class RankVote:
    """One DP rank's contribution to the step decision, as every rank saw it after the vote."""

    rank: int
    vote: str  # "yes", "no" or "idle"
    reason: PlanReason  # its local reason (MICROBATCHED when it voted yes)
    num_tokens_unpadded: int
    num_tokens_padded: int
    #: Query tokens per request where its batch is uniform decode, else 0 (what the
    #: ``dp_rule="smallest_rank"`` decision reads; ThresholdConfig).
    uniform_len: int = 0


@dataclass(frozen=True, slots=True)
class StepTiming:
    """What one step cost, measured as it ran (seconds, on the runner's clock).

    ``step_s``: the step's wall time on this rank (plan, run, merge). The comm numbers come from
    the host backend's works (``source="host"``; None where the backend tracks none, e.g. an
    accelerator, ``source=""``):

    * ``comm_s``: time some comm work was in flight (the union of issue-to-ready intervals);
    * ``exposed_s``: time every ubatch was parked on it, the CPU idle: the comm on the step's
      critical path (``RunStats.time_asleep_s``, at most ``comm_s``);
    * ``hidden_by_others_s``: time a ubatch was parked on its comm while another ubatch computed:
      what the overlap bought;
    * ``hidden_own_s``: the rest of ``comm_s``: in flight while the issuing ubatch itself still
      computed, before it waited (what a serial step hides too).
    """

    step_s: float
    num_ubatches: int
    comm_s: float | None = None
    exposed_s: float | None = None
    hidden_by_others_s: float | None = None
    hidden_own_s: float | None = None
    source: str = ""

    def describe(self) -> str:
        """One line, e.g. ``'step 4.10 ms, comm 2.00 ms (0.30 exposed, 1.50 hidden by other ubatches,
        0.20 by its own)'``."""
        head = f"step {self.step_s * 1e3:.2f} ms"
        if self.comm_s is None:
            return head
        ms = [1e3 * (v or 0.0) for v in (self.exposed_s, self.hidden_by_others_s, self.hidden_own_s)]
        return (f"{head}, comm {self.comm_s * 1e3:.2f} ms ({ms[0]:.2f} exposed, {ms[1]:.2f} hidden by other "
                f"ubatches, {ms[2]:.2f} by its own)")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What planning decided for one step and why; after the step, what it cost.

    ``config`` names the configuration the step ran (e.g. ``'N=2 token auto'``, ``'off'``),
    ``timing`` its measured cost (None until the runner fills it in), ``evidence`` why the
    ``"auto"`` policy chose it (empty under a fixed configuration). ``evidence`` and ``detail`` may
    be given as an object whose ``str()`` is the text (a snapshot of what it says): the text is
    made on its first read, and read as a ``str`` (the runner leaves it to a reader, issue 46).
    """

    step: int
    microbatched: bool
    reason: PlanReason
    detail: str = ""
    ubatch_num_tokens: tuple[int, ...] = ()  # real tokens per ubatch (one entry if unsplit)
    ubatch_num_tokens_padded: tuple[int, ...] = ()
    num_tokens_padded: int = 0
    policy: str = ""
    ranks: tuple[RankVote, ...] = ()  # empty without a DP group
    config: str = ""
    timing: StepTiming | None = None
    evidence: str = ""


class _TextOnRead:
    """The descriptor of :attr:`StepRecord.evidence`: a ``str`` on every read, made by ``str()``
    of what was stored on the first read and kept (the slot's own descriptor does the storing;
    the record stays frozen to its users). ``raw`` reads what is stored, as :func:`with_fields`
    copies it to a new record without making the text."""

    def __init__(self, slot: Any) -> None:
        self.raw = slot

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = self.raw.__get__(obj, owner)
        if type(value) is not str:
            value = str(value)
            self.raw.__set__(obj, value)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        self.raw.__set__(obj, value)


def text_on_read(cls: type, name: str) -> None:
    """Make slot field ``name`` of the frozen dataclass ``cls`` a :class:`_TextOnRead` (a str on
    every read, made on the first), with ``_raw_NAME`` reading what is stored."""
    text = _TextOnRead(cls.__dict__[name])
    setattr(cls, name, text)
    setattr(cls, f"_raw_{name}", text.raw)


# A record's evidence, and the detail of an "auto" step off by the policy's choice, are that
# choice's evidence: a snapshot whose text is made only when someone reads it.
text_on_read(StepRecord, "evidence")
text_on_read(StepRecord, "detail")


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


_T = TypeVar("_T")
_GETTERS: dict[type, tuple[Callable[[Any], tuple[Any, ...]], dict[str, int]]] = {}


def with_fields(obj: _T, **changes: Any) -> _T:
    """``dataclasses.replace(obj, **changes)`` for a dataclass whose fields are all ``__init__``
    arguments in order (StepRecord, StepPlan): every field read at once and passed by position,
    a few times cheaper than ``replace``'s per-field loop, which the runner paid twice per step.
    A field the class also has as ``_raw_NAME`` is copied as stored (StepRecord's evidence: its
    text is not made for the copy)."""
    cls = type(obj)
    got = _GETTERS.get(cls)
    if got is None:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        assert all(f.init and not f.kw_only for f in dataclasses.fields(cls)), cls  # type: ignore[arg-type]
        reads = [f"_raw_{n}" if hasattr(cls, f"_raw_{n}") else n for n in names]
        got = _GETTERS[cls] = (operator.attrgetter(*reads), {n: i for i, n in enumerate(names)})
    getter, index = got
    args = list(getter(obj))
    for name, value in changes.items():
        args[index[name]] = value
    return cls(*args)
