"""``plan_step``: everything a runner needs to know before it runs one step.

threshold test -> DP vote (optional) -> slices -> per-ubatch attention metadata -> a record.
"""

# Shape legend: R = requests, T = tokens (real), P = tokens (padded).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_bool
from .dp import (
    DPDecision,
    LocalStepInfo,
    ThresholdConfig,
    agree_across_dp,
    check_thresholds,
    decide_from_votes,
    is_uniform_decode,
    threshold_verdict,
)
from .metadata import AttentionMetadata, check_max_seq_len
from .split import split_checked
from .validate import check_slices
from .records import PlanReason, PlanStats, RankVote, StepRecord, log_record
from .slices import (
    SPLIT_POLICIES,
    CheckedOffsets,
    SplitPolicy,
    UBatchSlice,
    as_query_start_loc,
    plan_slices,
    whole_batch_slice,
)

__all__ = ["StepPlan", "check_max_ubatches", "plan_step"]


def check_max_ubatches(num_ubatches: int, max_ubatches: int | None) -> None:
    """Refuse more ubatches than the model's MoE layers were built for (each ubatch slot needs its
    own clone of the EP process group, made when the layer is built: see :mod:`asyncdbo.dist.ep`).
    Checked at plan time, on every rank alike, before any collective of the step."""
    if max_ubatches is not None and num_ubatches > max_ubatches:
        raise ValueError(
            f"num_ubatches ({num_ubatches}) exceeds max_ubatches ({max_ubatches}), the ubatches the model's MoE "
            f"layers were built for (one process-group clone per ubatch); build them with max_ubatches >= "
            f"{num_ubatches} or plan fewer ubatches"
        )


def check_cut_settings(num_ubatches: int, policy: str, min_share: float, max_ubatches: int | None) -> None:
    """ValueError naming the bad value unless the cut's settings can cut a batch: at least one
    ubatch and no more than the model's layers were built for, a known split policy, ``min_share``
    in [0, 0.5]."""
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches ({num_ubatches}) must be at least 1")
    check_max_ubatches(num_ubatches, max_ubatches)
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"unknown split policy {policy!r}; use one of {SPLIT_POLICIES}")
    if not 0.0 <= min_share <= 0.5:
        raise ValueError(f"min_share ({min_share}) must lie in [0, 0.5]")


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The plan for one step.

    ``slices`` has one entry per ubatch, or a single whole-batch slice when the step does not
    microbatch.  ``num_tokens_padded`` is the length of the padded input the step runs (the DP
    group's common total when microbatching).  ``attn_metadata`` holds one metadata per slice
    (empty if none was given).  ``decision`` is the DP vote, None without a DP group.
    """

    microbatched: bool
    slices: tuple[UBatchSlice, ...]
    num_tokens_padded: int
    attn_metadata: tuple[AttentionMetadata, ...]
    record: StepRecord
    decision: DPDecision | None = None


def _local_vote(
    qsl: Sequence[int],
    uniform: bool,
    num_ubatches: int,
    policy: SplitPolicy,
    thresholds: ThresholdConfig,
    enabled: bool,
    is_idle: bool,
    num_tokens_padded: int | None,
    min_share: float,
    grouped: bool = False,
) -> LocalStepInfo:
    num_tokens = qsl[-1]
    common: dict[str, Any] = dict(num_tokens_unpadded=num_tokens, num_tokens_padded=num_tokens_padded, is_idle=is_idle,
                                  uniform_len=1 + thresholds.num_spec_tokens if uniform else 0)
    if not enabled:
        return LocalStepInfo(wants_ubatch=False, reason=PlanReason.DISABLED, detail="disabled by the caller", **common)
    if grouped and thresholds.dp_rule == "smallest_rank":  # the group tests the thresholds (decide_from_votes)
        detail = "thresholds tested across the DP group (dp_rule='smallest_rank')"
    else:
        ok, detail = threshold_verdict(num_tokens, uniform, thresholds)
        if not ok:
            return LocalStepInfo(wants_ubatch=False, reason=PlanReason.BELOW_THRESHOLD, detail=detail, **common)
    if policy != "token":
        sizes = [s.num_tokens for s in plan_slices(qsl, num_ubatches, policy, min_share=min_share)]
        if 0 in sizes:
            detail = f"{policy} split leaves a ubatch without real tokens (sizes {sizes})"
            return LocalStepInfo(wants_ubatch=False, reason=PlanReason.POLICY_REFUSED, detail=detail, **common)
    return LocalStepInfo(wants_ubatch=True, detail=detail, **common)


# (microbatched, reason, detail, padded total, slices, their flags, the DP decision, the slices' real
# and padded sizes): what plan_step decides before it cuts the metadata
_Cut = tuple[bool, PlanReason, str, int, tuple[UBatchSlice, ...], tuple[tuple[bool, bool], ...], "DPDecision | None",
             tuple[int, ...], tuple[int, ...]]
_DECODE_CUTS: dict[tuple[Any, ...], _Cut] = {}


def _vote_and_cut(
    offsets: CheckedOffsets,
    uniform: bool,
    num_ubatches: int,
    policy: SplitPolicy,
    thresholds: ThresholdConfig,
    enabled: bool,
    is_idle: bool,
    num_tokens_padded: int | None,
    min_share: float,
    dp_group: Any,
    device: torch.device | str | None,
    max_imbalance: float | None,
    decision: DPDecision | None,
) -> _Cut:
    """plan_step's decision (given, voted, or this rank's) and the slices it cuts, checked."""
    qsl = offsets
    if decision is not None:  # the caller voted: no threshold test, no second vote (LocalStepInfo's check)
        if num_tokens_padded is not None and num_tokens_padded < qsl[-1]:
            raise ValueError(f"num_tokens_padded ({num_tokens_padded}) is below num_tokens_unpadded ({qsl[-1]})")
        microbatched, reason, detail = decision.should_ubatch and num_ubatches > 1, decision.reason, decision._raw_detail
        padded = decision.num_tokens_padded if microbatched else (
            qsl[-1] if num_tokens_padded is None else num_tokens_padded)
    else:
        local = _local_vote(offsets, uniform, num_ubatches, policy, thresholds, enabled, is_idle, num_tokens_padded,
                            min_share, dp_group is not None)
        if dp_group is not None:
            # The vote runs even with num_ubatches == 1: a rank cannot know that its peers plan the
            # same number, and a 1-vs-2 mismatch skipped here would leave the others waiting in
            # their first collective until a timeout. The vote names the mismatch on every rank.
            decision = agree_across_dp(local, num_ubatches, dp_group, device=device, max_imbalance=max_imbalance,
                                       thresholds=thresholds)
            if num_ubatches == 1:
                microbatched, reason, detail, padded = False, PlanReason.SINGLE_UBATCH, "num_ubatches is 1", local.padded
            else:
                microbatched, reason = decision.should_ubatch, decision.reason
                detail = decision.detail or local.detail
                padded = decision.num_tokens_padded if microbatched else local.padded
        elif num_ubatches == 1:
            microbatched, reason, detail, padded = False, PlanReason.SINGLE_UBATCH, "num_ubatches is 1", local.padded
        else:
            vote = RankVote(0, local.vote, local.reason, local.num_tokens_unpadded, local.padded)
            d = decide_from_votes([vote])
            microbatched, reason, detail, padded = d.should_ubatch, d.reason, d.detail or local.detail, local.padded

    if microbatched:
        slices = tuple(plan_slices(offsets, num_ubatches, policy, num_tokens_padded=padded, min_share=min_share))
    else:
        slices = (whole_batch_slice(offsets, padded),)
    # The planners' slices must tile the batch (split_attn_metadata alone accepts any disjoint set).
    flags = check_slices(qsl, slices, tile=True) if microbatched else ()
    return (microbatched, reason, detail, padded, slices, tuple(flags), decision,
            tuple(s.num_tokens for s in slices), tuple(s.num_tokens_padded for s in slices))


def plan_step(
    query_start_loc: Sequence[int] | torch.Tensor,
    *,
    num_ubatches: int = 2,
    policy: SplitPolicy = "token",
    thresholds: ThresholdConfig = ThresholdConfig(),
    enabled: bool = True,
    num_tokens_padded: int | None = None,
    is_idle: bool = False,
    attn_metadata: AttentionMetadata | None = None,
    dp_group: Any = None,
    device: torch.device | str | None = None,
    max_imbalance: float | None = None,
    min_share: float = 0.48,
    stats: PlanStats | None = None,
    step: int | None = None,
    max_ubatches: int | None = None,
    decision: DPDecision | None = None,
    config: str = "",
    evidence: str | object = "",
    max_seq_len: str = "ubatch",
    uniform_decode: bool | None = None,
) -> StepPlan:
    """Plan one step: decide whether to microbatch, and if so how.

    ``query_start_loc``: this rank's R+1 token offsets (CPU list or tensor).
    ``num_tokens_padded``: this rank's padded count (e.g. a CUDA-graph size); default unpadded.
    ``is_idle``: this rank runs a dummy batch; it follows the group with padding-only ubatches.
    ``dp_group``: a torch.distributed group to agree with (``torch.distributed.group.WORLD`` for
    the default group); None plans locally.  With a group, EVERY rank must call ``plan_step``
    every step (it runs one all-reduce on ``device``), and every ubatch of the resulting plan,
    even an empty one, must take part in every collective of the step.
    ``enabled=False`` votes no for this step (e.g. a vetoed prefix-cache case); ``enabled`` and
    ``is_idle`` must be True or False (numpy's bools too), and ``thresholds`` a
    :class:`ThresholdConfig`, or a TypeError names the value.
    ``stats``: if given, the step's record is counted there.  Every record is logged at DEBUG
    on the ``asyncdbo.plan`` logger.
    ``max_ubatches``: the most ubatches the model's MoE layers were built for
    (``MoELayer(max_ubatches=...)``); more is a ValueError here, not a failure mid-step.
    ``decision``: a DP decision the caller already took this step (the ``"auto"`` runner votes
    once with its measurements and decides the configuration from that vote): used as it is, no
    threshold test and no second vote. ``config`` and ``evidence`` go into the record (``evidence``
    a str, or an object whose ``str()`` the record makes its text on the first read).
    ``max_seq_len``: each ubatch's metadata carries its own longest request (``"ubatch"``) or the
    whole step's (``"batch"``, vLLM's rule: :func:`~asyncdbo.plan.split_attn_metadata`).
    ``uniform_decode``: :func:`~asyncdbo.plan.is_uniform_decode` of these offsets with the
    thresholds' ``num_spec_tokens``, where the caller made it already (a runner needs it for its
    ledger too); None makes it here.
    """
    # Any truthy value would pass for a flag (enabled="no" voted yes); checked before the vote, like the rest.
    check_bool("plan_step() ", "enabled", enabled)
    check_bool("plan_step() ", "is_idle", is_idle)
    check_thresholds("plan_step() thresholds", thresholds)
    if max_seq_len != "ubatch":
        check_max_seq_len("plan_step()", max_seq_len)
    if type(query_start_loc) is CheckedOffsets:  # the runner's, checked this step: no copy
        offsets = query_start_loc
    else:  # checked once: the planners below take it unchecked
        offsets = CheckedOffsets(as_query_start_loc(query_start_loc))
    qsl = offsets
    check_cut_settings(num_ubatches, policy, min_share, max_ubatches)
    if attn_metadata is not None and attn_metadata.num_actual_tokens != qsl[-1]:
        raise ValueError(
            f"attn_metadata has {attn_metadata.num_actual_tokens} tokens but query_start_loc has "
            f"{qsl[-1]}; plan with the metadata's query_start_loc_cpu"
        )
    if step is None:
        step = stats.num_steps if stats is not None else 0

    # the uniform-decode test once per step: the threshold's, and whether the cut below can be kept
    uniform = (enabled or decision is not None) and (
        is_uniform_decode(offsets, thresholds.num_spec_tokens) if uniform_decode is None else uniform_decode)
    key: tuple[Any, ...] | None = None
    cut: _Cut | None = None
    if uniform and (dp_group is None if decision is None else decision.should_ubatch):
        # A uniform decode's offsets follow from its request count, and without a group (or with
        # the caller's decision) nothing else goes into the cut: the same inputs cut the same way,
        # so the cut is kept, not redone (the metadata below is cut from this step's tensors).
        given = None if decision is None else (decision.reason, decision.detail, decision.num_tokens_padded)
        key = (len(offsets), offsets[-1], num_ubatches, policy, thresholds, is_idle, num_tokens_padded, min_share,
               given)
        cut = _DECODE_CUTS.get(key)
    if cut is None:
        cut = _vote_and_cut(offsets, bool(uniform), num_ubatches, policy, thresholds, enabled, is_idle,
                            num_tokens_padded, min_share, dp_group, device, max_imbalance, decision)
        if key is not None:
            if len(_DECODE_CUTS) >= 256:
                _DECODE_CUTS.clear()
            _DECODE_CUTS[key] = cut
    microbatched, reason, detail, padded, slices, flags, voted, sizes, padded_sizes = cut
    decision = decision if decision is not None else voted  # a caller's decision is this step's own
    metas: tuple[AttentionMetadata, ...] = ()
    if attn_metadata is not None:
        metas = (tuple(split_checked(attn_metadata, slices, flags, max_seq_len=max_seq_len)) if microbatched
                 else (attn_metadata,))
    record = _record(cut, step, policy, decision, config, evidence)
    if stats is not None:
        stats.record(record)
    return StepPlan(microbatched, slices, padded, metas, record, decision)


def _record(cut: _Cut, step: int, policy: str, decision: DPDecision | None, config: str,
            evidence: str | object) -> StepRecord:
    """The step's record of its cut (logged at DEBUG)."""
    microbatched, reason, detail, padded, _, _, _, sizes, padded_sizes = cut
    record = StepRecord(step, microbatched, reason, detail, sizes, padded_sizes, padded, policy,
                        decision.ranks if decision is not None else (), config, None,
                        evidence)  # type: ignore[arg-type]  # a str when read (StepRecord.evidence)
    log_record(record)
    return record
