"""Planning a step: whether to microbatch, how to split the batch, and why (issue 3).

Model-independent: a serving engine calls :func:`plan_step` once per step and gets back the
ubatch slices, the per-ubatch attention metadata, and a :class:`StepRecord` saying whether the
step microbatched and, if not, why.
"""

from __future__ import annotations

from .dp import (
    DPDecision as DPDecision,
    LocalStepInfo as LocalStepInfo,
    RecoveryVote as RecoveryVote,
    ThresholdConfig as ThresholdConfig,
    agree_across_dp as agree_across_dp,
    decide_from_votes as decide_from_votes,
    is_uniform_decode as is_uniform_decode,
    should_microbatch as should_microbatch,
)
from .metadata import (
    AttentionMetadata as AttentionMetadata,
    SplitKind as SplitKind,
    merge_outputs as merge_outputs,
    slice_tokens as slice_tokens,
)
from .records import (
    PlanReason as PlanReason,
    PlanStats as PlanStats,
    RankVote as RankVote,
    StepRecord as StepRecord,
    StepTiming as StepTiming,
    log_record as log_record,
)
from .slices import (
    SplitPolicy as SplitPolicy,
    UBatchSlice as UBatchSlice,
    as_query_start_loc as as_query_start_loc,
    plan_slices as plan_slices,
    slices_from_split_points as slices_from_split_points,
    split_balanced as split_balanced,
    split_requests as split_requests,
    split_tokens as split_tokens,
    whole_batch_slice as whole_batch_slice,
)
from .split import split_attn_metadata as split_attn_metadata, split_extra as split_extra
from .planner import ShapePlanner as ShapePlanner
from .step import StepPlan as StepPlan, check_max_ubatches as check_max_ubatches, plan_step as plan_step

__all__ = (
    "AttentionMetadata",
    "DPDecision",
    "LocalStepInfo",
    "PlanReason",
    "PlanStats",
    "RankVote",
    "RecoveryVote",
    "ShapePlanner",
    "SplitKind",
    "SplitPolicy",
    "StepPlan",
    "StepRecord",
    "StepTiming",
    "ThresholdConfig",
    "UBatchSlice",
    "agree_across_dp",
    "as_query_start_loc",
    "check_max_ubatches",
    "decide_from_votes",
    "is_uniform_decode",
    "log_record",
    "merge_outputs",
    "plan_slices",
    "plan_step",
    "should_microbatch",
    "slice_tokens",
    "slices_from_split_points",
    "split_attn_metadata",
    "split_balanced",
    "split_extra",
    "split_requests",
    "split_tokens",
    "whole_batch_slice",
)
