"""Planning a step: whether to microbatch, how to split the batch, and why (issue 3).

Model-independent: a serving engine calls :func:`plan_step` once per step and gets back the
ubatch slices, the per-ubatch attention metadata, and a :class:`StepRecord` saying whether the
step microbatched and, if not, why.
"""

from __future__ import annotations

from .dp import (
    DPDecision as DPDecision,
)
from .dp import (
    LocalStepInfo as LocalStepInfo,
)
from .dp import (
    RecoveryVote as RecoveryVote,
)
from .dp import (
    ThresholdConfig as ThresholdConfig,
)
from .dp import (
    agree_across_dp as agree_across_dp,
)
from .dp import (
    decide_from_votes as decide_from_votes,
)
from .dp import (
    is_uniform_decode as is_uniform_decode,
)
from .dp import (
    should_microbatch as should_microbatch,
)
from .metadata import (
    AttentionMetadata as AttentionMetadata,
)
from .metadata import (
    SplitKind as SplitKind,
)
from .metadata import (
    merge_outputs as merge_outputs,
)
from .metadata import (
    slice_tokens as slice_tokens,
)
from .metadata import (
    split_attn_metadata as split_attn_metadata,
)
from .metadata import (
    split_extra as split_extra,
)
from .records import (
    PlanReason as PlanReason,
)
from .records import (
    PlanStats as PlanStats,
)
from .records import (
    RankVote as RankVote,
)
from .records import (
    StepRecord as StepRecord,
)
from .records import (
    log_record as log_record,
)
from .slices import (
    SplitPolicy as SplitPolicy,
)
from .slices import (
    UBatchSlice as UBatchSlice,
)
from .slices import (
    as_query_start_loc as as_query_start_loc,
)
from .slices import (
    plan_slices as plan_slices,
)
from .slices import (
    split_balanced as split_balanced,
)
from .slices import (
    split_requests as split_requests,
)
from .slices import (
    split_tokens as split_tokens,
)
from .slices import (
    whole_batch_slice as whole_batch_slice,
)
from .step import StepPlan as StepPlan
from .step import plan_step as plan_step

__all__ = (
    "AttentionMetadata",
    "DPDecision",
    "LocalStepInfo",
    "PlanReason",
    "PlanStats",
    "RankVote",
    "RecoveryVote",
    "SplitKind",
    "SplitPolicy",
    "StepPlan",
    "StepRecord",
    "ThresholdConfig",
    "UBatchSlice",
    "agree_across_dp",
    "as_query_start_loc",
    "decide_from_votes",
    "is_uniform_decode",
    "log_record",
    "merge_outputs",
    "plan_slices",
    "plan_step",
    "should_microbatch",
    "slice_tokens",
    "split_attn_metadata",
    "split_balanced",
    "split_extra",
    "split_requests",
    "split_tokens",
    "whole_batch_slice",
)
