"""Deciding whether a step microbatches: the local threshold test and the DP-wide agreement.

Every DP rank's MoE all-to-all must run the same number of collectives per step, so either every
rank microbatches or none does, and when they do, every rank pads to the same total so that the
token split gives the same per-ubatch sizes everywhere.  The decision takes ONE ``all_reduce``
(SUM) over an int64 tensor of shape [ROWS, W] in which each rank fills its own column.

Rules (differences from vLLM marked *):

* A busy rank votes *no* when it is below its threshold, disabled, or its policy refuses: then
  nobody splits (``RANK_DECLINED``, the detail names the ranks and their reasons). Where every
  busy rank voted no for the same reason, that reason is the step's (``BELOW_THRESHOLD`` when all
  are below their thresholds): no rank kept another from overlapping.
* * An idle rank (no real tokens, or a dummy batch the caller marks ``is_idle``) votes *idle*,
  not no: it follows the busy ranks and runs padding-only ubatches.  vLLM's dummy batch votes no
  and so kills DBO for the whole group whenever one rank has no work.
* * No "last ubatch would be empty" veto: a rank whose real tokens do not reach the last ubatch
  runs it with padding only.  **Every ubatch, even an empty one, must take part in every
  collective of the step** (dispatch/combine with zero rows), or the group deadlocks.
* * Imbalance: padding makes any imbalance *correct*; it only wastes the small rank's compute,
  which it would otherwise spend waiting in the all-to-all.  So the default allows any ratio.
  With ``max_imbalance=x``, the step falls out (``IMBALANCE``) when the largest busy rank has
  more than ``x`` times the real tokens of the smallest busy rank.
* If every rank is idle, nobody splits (``ALL_IDLE``).

The threshold test above is vLLM's V1 model runner's (each busy rank tests its own batch:
``dp_rule="each_rank"``, the default). vLLM's model runner V2 (``sync_cudagraph_and_dp_padding``)
tests the group instead, and ``ThresholdConfig(dp_rule="smallest_rank")`` gives its rule: the step
is uniform decode only where every busy rank runs uniform decode with the same query length, and
that kind's threshold applies to the smallest busy rank's real tokens (thresholds only grow with
the tokens, so the smallest rank passing means every rank passes). The two part where ranks mix
kinds: 300 decodes beside a 520-token prefill split under V1 (each rank passes its own
threshold) and not under V2 (the step is mixed, and 300 < 512). Idle ranks follow the busy ones
under both (where vLLM's V2 counts an idle rank's zero tokens as the smallest).

The same vote carries step recovery (:mod:`asyncdbo.dist.recovery`): a rank whose previous step
failed votes *recover* instead of a plan, and then every rank of the vote gets
:class:`RecoveryVote`, replaces its per-ubatch groups and votes again.
"""

# Shape legend: W = DP world size.

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Union

import torch

from .._core import AsyncDBOException
from ._checks import check_config, check_int
from .records import PlanReason, RankVote, text_on_read
from .slices import as_query_start_loc

__all__ = [
    "DP_RULES",
    "DPDecision",
    "LocalStepInfo",
    "RecoveryVote",
    "ThresholdConfig",
    "agree_across_dp",
    "decide_from_votes",
    "should_microbatch",
]

# Rows of the vote tensor: the plan, then how many of the MAX_EXTRA rows after it the caller uses
# (every rank sends all of them: an all_reduce of tensors of different sizes aborts the process in
# gloo, so a rank that votes with other extras than its peers must be told so, not crash them).
_VOTE, _UNPADDED, _PADDED, _IDLE, _REASON, _NUM_UBATCHES, _RECOVER, _UNIFORM, _RULE, _NUM_EXTRA = range(10)
_ROWS = 10
#: The most ``extra`` entries a vote carries (``agree_across_dp``).
MAX_EXTRA = 4
_REASON_CODES: tuple[PlanReason, ...] = tuple(PlanReason)


@dataclass(frozen=True, kw_only=True, slots=True)
class ThresholdConfig:
    """Minimum real tokens for a step to microbatch (vLLM's defaults).

    A uniform-decode step (every request has exactly ``1 + num_spec_tokens`` query tokens) is
    memory-bound: splitting it reads the expert weights twice, so it needs enough tokens to hide
    the all-to-all.  Mixed and prefill steps get a higher bar (vLLM runs them eagerly).
    """

    decode_threshold: int = 32
    prefill_threshold: int = 512
    num_spec_tokens: int = 0
    #: Under DP, who the thresholds test (module docstring): ``"each_rank"`` (vLLM's V1 runner:
    #: every busy rank its own batch) or ``"smallest_rank"`` (vLLM's model runner V2: the group's
    #: step kind, and the smallest busy rank's tokens).
    dp_rule: str = "each_rank"

    def __post_init__(self) -> None:
        if self.dp_rule not in DP_RULES:
            raise ValueError(f"ThresholdConfig.dp_rule must be one of {', '.join(map(repr, DP_RULES))} (got "
                             f"{self.dp_rule!r}); 'each_rank' is vLLM's V1 runner's rule, 'smallest_rank' its V2's")
        # A float, a bool or a str used to pass (or fail with "'<' not supported"): 32.5 compared as
        # a threshold, True as one token, and nan passed every check and made no step microbatch.
        for name in ("decode_threshold", "prefill_threshold", "num_spec_tokens"):
            check_int("ThresholdConfig.", name, getattr(self, name), _THRESHOLD_DEFAULTS[name])
        for name in ("decode_threshold", "prefill_threshold"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} ({value}) must be >= 0; use 0 to always microbatch")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens ({self.num_spec_tokens}) must be >= 0 (the draft tokens each decode "
                             "request carries); use 0 without speculative decoding")


#: The DP threshold rules (ThresholdConfig.dp_rule), in the vote's code order.
DP_RULES = ("each_rank", "smallest_rank")

#: Each field's default, the example a message about a field gives.
_THRESHOLD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ThresholdConfig)}


def check_thresholds(where: str, th: object) -> None:
    """TypeError unless ``th`` is a :class:`ThresholdConfig` (``where``: what it was given to, e.g.
    ``"RunnerConfig.thresholds"``): else a dict or an int fails at the first plan, with an
    AttributeError deep in it."""
    check_config(where, "thresholds", th, ThresholdConfig, "asyncdbo.plan.ThresholdConfig",
                 "ThresholdConfig(decode_threshold=32, prefill_threshold=512)")


def is_uniform_decode(qsl: Sequence[int], num_spec_tokens: int = 0) -> bool:
    """Every request has exactly ``1 + num_spec_tokens`` query tokens (and there is one)."""
    q = 1 + num_spec_tokens
    if isinstance(qsl, (list, tuple)):
        # Offsets of q-token requests are exactly first, first + q, ...: one comparison of two
        # lists at C speed (a few ns per request; the pairwise test below costs about 50).
        n = len(qsl) - 1
        if n < 1 or qsl[-1] - qsl[0] != q * n:
            return False
        seq = qsl if type(qsl) is list else list(qsl)
        return seq == list(range(qsl[0], qsl[-1] + 1, q))
    lengths = map(operator.sub, itertools.islice(qsl, 1, None), qsl)
    return len(qsl) > 1 and all(map(operator.eq, lengths, itertools.repeat(q)))


def should_microbatch(
    num_tokens_unpadded: int,
    query_start_loc: Sequence[int] | torch.Tensor,
    cfg: ThresholdConfig = ThresholdConfig(),
) -> tuple[bool, str]:
    """Is this rank's step big enough to microbatch?  Returns ``(ok, detail)``.

    ``num_tokens_unpadded`` must be the batch's token count, ``query_start_loc[-1]`` (the uniform
    decode test reads the per-request counts, the threshold the total: they must describe one
    batch)."""
    if num_tokens_unpadded < 0:
        raise ValueError(f"num_tokens_unpadded ({num_tokens_unpadded}) must be >= 0")
    qsl = as_query_start_loc(query_start_loc)
    if num_tokens_unpadded != qsl[-1]:
        raise ValueError(
            f"num_tokens_unpadded ({num_tokens_unpadded}) disagrees with query_start_loc, whose last entry says "
            f"the batch has {qsl[-1]} tokens; pass the real token count of the same batch"
        )
    return threshold_verdict(num_tokens_unpadded, is_uniform_decode(qsl, cfg.num_spec_tokens), cfg)


def threshold_verdict(num_tokens_unpadded: int, uniform_decode: bool, cfg: ThresholdConfig) -> tuple[bool, str]:
    """:func:`should_microbatch` of a checked batch whose uniform-decode test the caller already
    made (``plan_step`` makes it once per step and reuses it)."""
    if uniform_decode:
        kind, threshold = "uniform decode", cfg.decode_threshold
    else:
        kind, threshold = "mixed/prefill", cfg.prefill_threshold
    if num_tokens_unpadded >= threshold:
        return True, f"{kind}: {num_tokens_unpadded} tokens >= threshold {threshold}"
    return False, f"{kind}: {num_tokens_unpadded} tokens < threshold {threshold}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalStepInfo:
    """This rank's input to the DP vote.

    ``reason`` is why it does not want to microbatch (ignored when ``wants_ubatch``; DISABLED if
    left at MICROBATCHED for a "no").
    ``num_tokens_padded`` defaults to the unpadded count (e.g. a CUDA-graph size if padded).
    """

    num_tokens_unpadded: int
    wants_ubatch: bool
    num_tokens_padded: int | None = None
    reason: PlanReason = PlanReason.MICROBATCHED
    detail: str = ""
    is_idle: bool = False
    #: Query tokens per request where the batch is uniform decode, else 0 (``dp_rule="smallest_rank"``).
    uniform_len: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens_unpadded < 0:
            raise ValueError(f"num_tokens_unpadded ({self.num_tokens_unpadded}) must be >= 0")
        if self.num_tokens_padded is not None and self.num_tokens_padded < self.num_tokens_unpadded:
            raise ValueError(
                f"num_tokens_padded ({self.num_tokens_padded}) is below num_tokens_unpadded "
                f"({self.num_tokens_unpadded})"
            )

    @property
    def padded(self) -> int:
        return self.num_tokens_unpadded if self.num_tokens_padded is None else self.num_tokens_padded

    @property
    def vote(self) -> str:
        if self.is_idle or self.num_tokens_unpadded == 0:
            return "idle"
        return "yes" if self.wants_ubatch else "no"


@dataclass(frozen=True, slots=True)
class DPDecision:
    """The group's decision, identical on every rank.

    ``num_tokens_padded`` is the common padded total (max over ranks); when microbatching every
    rank must run exactly this many tokens.  ``num_tokens_across_dp`` has each rank's real count.
    """

    should_ubatch: bool
    reason: PlanReason
    detail: str
    num_tokens_padded: int
    num_tokens_across_dp: tuple[int, ...]
    ranks: tuple[RankVote, ...]
    rank: int
    world_size: int
    extra: tuple[tuple[int, ...], ...] = ()  # the ``extra`` rows of the vote, each with one entry per rank
    #: ``detail`` as stored (text_on_read below): a str, or a snapshot whose str() is the text
    _raw_detail: ClassVar[Any]


# an "auto" step off by the policy's choice carries the choice's evidence as its detail (StepRecord)
text_on_read(DPDecision, "detail")


def decide_from_votes(
    votes: Sequence[RankVote], *, rank: int = 0, max_imbalance: float | None = None,
    thresholds: ThresholdConfig | None = None,
) -> DPDecision:
    """Apply the module's rules to the gathered votes (pure; every rank computes the same).
    ``thresholds`` with ``dp_rule="smallest_rank"``: the group's threshold test (the votes then
    carry no threshold verdict of their own; module docstring)."""
    declined = [v for v in votes if v.vote == "no"]
    busy = [v for v in votes if v.vote != "idle"]
    padded = max((v.num_tokens_padded for v in votes), default=0)
    common: dict[str, Any] = dict(
        num_tokens_padded=padded,
        num_tokens_across_dp=tuple(v.num_tokens_unpadded for v in votes),
        ranks=tuple(votes),
        rank=rank,
        world_size=len(votes),
    )
    if declined:
        if len(votes) == 1:
            return DPDecision(False, declined[0].reason, "", **common)
        who = "; ".join(f"rank {v.rank}: {v.reason.value}" for v in declined)
        reasons = {v.reason for v in declined}
        if len(declined) == len(busy) and len(reasons) == 1:
            # every busy rank said no for the same reason: that is the step's reason (no rank kept
            # another from overlapping, which is what rank_declined reports)
            return DPDecision(False, reasons.pop(), who, **common)
        return DPDecision(False, PlanReason.RANK_DECLINED, who, **common)
    if not busy:
        return DPDecision(False, PlanReason.ALL_IDLE, "no rank has real tokens", **common)
    if thresholds is not None and thresholds.dp_rule == "smallest_rank":
        lens = {v.uniform_len for v in busy}
        uniform = len(lens) == 1 and 0 not in lens
        kind, threshold = (("uniform decode", thresholds.decode_threshold) if uniform
                           else ("mixed/prefill", thresholds.prefill_threshold))
        low = min(busy, key=lambda v: v.num_tokens_unpadded)
        if low.num_tokens_unpadded < threshold:
            detail = (f"{kind} step across the DP group: its smallest busy rank (rank {low.rank}) has "
                      f"{low.num_tokens_unpadded} tokens < threshold {threshold} (dp_rule='smallest_rank')")
            return DPDecision(False, PlanReason.BELOW_THRESHOLD, detail, **common)
    if max_imbalance is not None:
        hi = max(busy, key=lambda v: v.num_tokens_unpadded)
        lo = min(busy, key=lambda v: v.num_tokens_unpadded)
        if hi.num_tokens_unpadded > max_imbalance * lo.num_tokens_unpadded:
            detail = (
                f"rank {hi.rank} has {hi.num_tokens_unpadded} tokens, rank {lo.rank} has "
                f"{lo.num_tokens_unpadded}: ratio above max_imbalance {max_imbalance:g}"
            )
            return DPDecision(False, PlanReason.IMBALANCE, detail, **common)
    idle = [v.rank for v in votes if v.vote == "idle"]
    detail = f"idle rank(s) {idle} run padding-only ubatches" if idle else ""
    return DPDecision(True, PlanReason.MICROBATCHED, detail, **common)


Device = Union[torch.device, str, None]


class RecoveryVote(AsyncDBOException):
    """Raised on every rank of a DP vote in which some rank voted *recover* (``agree_across_dp(...,
    recover=True)``): its previous step failed, so every rank of the vote must replace the
    per-ubatch groups before the next step, and the ranks that voted a plan vote again.
    ``ranks``: the ranks that voted recover."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        super().__init__(f"rank(s) {list(ranks)} recover from a failed step; every rank renews its groups")


def agree_across_dp(
    local: LocalStepInfo,
    num_ubatches: int,
    group: Any = None,
    *,
    device: Device = None,
    max_imbalance: float | None = None,
    recover: bool = False,
    extra: Sequence[int] = (),
    thresholds: ThresholdConfig | None = None,
) -> DPDecision:
    """Vote with every rank of ``group`` (torch.distributed; None = the default group).

    One ``all_reduce`` (SUM) on an int64 tensor on ``device`` (CPU for gloo, the rank's GPU for
    NCCL), then one host read of the result.  Every rank must call this once per step with the
    same ``num_ubatches``; a mismatch raises ValueError on every rank, naming each rank's count.  Without an initialised
    process group the decision is local (a group of one).  ``recover=True`` votes *recover* (this
    rank's previous step failed): then every rank of the vote raises :class:`RecoveryVote`.
    ``thresholds``: where its ``dp_rule`` is ``"smallest_rank"`` the group applies them
    (:func:`decide_from_votes`); every rank must vote with the same rule, or a ValueError names
    each rank's.
    """
    import torch.distributed as dist

    if num_ubatches < 1:
        raise ValueError(f"num_ubatches ({num_ubatches}) must be at least 1")
    if max_imbalance is not None and max_imbalance < 1:
        raise ValueError(f"max_imbalance ({max_imbalance}) must be >= 1 (a max/min token ratio) or None")
    if len(extra) > MAX_EXTRA:
        raise ValueError(f"a vote carries at most {MAX_EXTRA} extra entries (got {len(extra)}: {list(extra)!r})")
    if not dist.is_available() or not dist.is_initialized():
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    reason = PlanReason.MICROBATCHED if local.wants_ubatch else local.reason
    if not local.wants_ubatch and reason is PlanReason.MICROBATCHED:
        reason = PlanReason.DISABLED  # a "no" without a reason: the caller turned it off
    col = [
        int(local.vote == "yes"),
        local.num_tokens_unpadded,
        local.padded,
        int(local.vote == "idle"),
        _REASON_CODES.index(reason),
        num_ubatches,
        int(recover),
        local.uniform_len,
        DP_RULES.index(thresholds.dp_rule) if thresholds is not None else 0,
        len(extra),
    ]
    col.extend(int(v) for v in extra)
    col.extend([0] * (MAX_EXTRA - len(extra)))
    votes_RW = torch.zeros(len(col), world, dtype=torch.int64)
    votes_RW[:, rank] = torch.tensor(col, dtype=torch.int64)
    if world > 1:
        votes_RW = votes_RW.to(device) if device is not None else votes_RW
        dist.all_reduce(votes_RW, op=dist.ReduceOp.SUM, group=group)
    table = votes_RW.cpu().tolist()
    recovering = tuple(r for r in range(world) if table[_RECOVER][r])
    if recovering:
        raise RecoveryVote(recovering)
    if len(set(table[_NUM_EXTRA])) != 1:
        by_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(table[_NUM_EXTRA]))
        raise ValueError(
            f"ranks vote with different extra entries ({by_rank}); every rank of the DP group must plan "
            "the same way: a DBORunner on every rank with the same RunnerConfig.tuning ('auto' votes 4 "
            "extra entries, 'fixed' none)"
        )
    if len(set(table[_RULE])) != 1:
        by_rank = ", ".join(f"rank {r}: {DP_RULES[n]!r}" for r, n in enumerate(table[_RULE]))
        raise ValueError(
            f"ranks vote with different ThresholdConfig.dp_rule ({by_rank}); every rank of the DP group must "
            "apply the same rule: pass one ThresholdConfig to all of them")
    if len(set(table[_NUM_UBATCHES])) != 1:
        by_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(table[_NUM_UBATCHES]))
        raise ValueError(
            f"ranks disagree on num_ubatches ({by_rank}); every rank of the DP group must plan the "
            f"same number of ubatches: pass one num_ubatches to all of them (a DBORunner: the same "
            f"RunnerConfig.num_ubatches, or under tuning='auto' the same AutoConfig.ubatch_counts)"
        )
    votes = [
        RankVote(
            rank=r,
            vote="idle" if table[_IDLE][r] else ("yes" if table[_VOTE][r] else "no"),
            reason=_REASON_CODES[table[_REASON][r]],
            num_tokens_unpadded=table[_UNPADDED][r],
            num_tokens_padded=table[_PADDED][r],
            uniform_len=table[_UNIFORM][r],
        )
        for r in range(world)
    ]
    decision = decide_from_votes(votes, rank=rank, max_imbalance=max_imbalance, thresholds=thresholds)
    if extra:
        decision = replace(decision, extra=tuple(tuple(row) for row in table[_ROWS:_ROWS + len(extra)]))
    return decision
