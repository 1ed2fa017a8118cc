"""``ShapePlanner``: a runner's :func:`~asyncdbo.plan.plan_step`, with what a step's offsets decide
kept per offsets.

A serving loop repeats its shapes: a decode step keeps its request count, and the checks of the
offsets, the threshold test, the cut and the split's template (:class:`~asyncdbo.plan.split.
SplitTemplate`) depend on the offsets and the configuration alone. A step whose
``query_start_loc_cpu`` holds offsets planned before reads them once, as a key, and cuts only its
own tensors; every plan equals ``plan_step``'s (tests/plan/test_shape_planner.py). Only a plan
without a DP group's vote is kept this way: a vote is a collective every step, and its outcome is
the caller's ``decision`` here (the ``"auto"`` runner's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ._checks import check_bool
from .dp import DPDecision, ThresholdConfig, check_thresholds, is_uniform_decode
from .metadata import AttentionMetadata, check_max_seq_len
from .slices import _INT_DTYPES, CheckedOffsets, SplitPolicy, as_query_start_loc
from .split import SplitTemplate
from .step import StepPlan, _Cut, _record, _vote_and_cut, check_cut_settings

__all__ = ["Offsets", "ShapePlanner", "remember"]


@dataclass(frozen=True, slots=True)
class _Shape:
    cut: _Cut
    template: SplitTemplate[Any] | None  # None: not split


@dataclass(frozen=True, slots=True)
class Offsets:
    """A step's offsets as :meth:`ShapePlanner.offsets` read them: ``key`` (their values and
    dtype, None where they are no key: not an integer CPU tensor), ``checked`` (the values,
    checked) and ``uniform`` (a uniform decode with the thresholds' ``num_spec_tokens``)."""

    key: tuple[Any, ...] | None
    checked: CheckedOffsets
    uniform: bool
    #: what is derived from these offsets alone, kept with them by its user's key: the planners'
    #: cuts (by planner, flag and the caller's decision), an "auto" runner's split mask and own vote
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


class ShapePlanner:
    """:func:`~asyncdbo.plan.plan_step` of one rank without a DP group, for one configuration, with
    what it decides from a step's offsets kept per offsets (see the module docstring).

    The arguments are ``plan_step``'s and checked as it checks them, once. ``capacity``: shapes
    kept: offsets (each with its cuts; the older half is dropped when it is reached)."""

    def __init__(self, *, num_ubatches: int = 2, policy: SplitPolicy = "token",
                 thresholds: ThresholdConfig = ThresholdConfig(), min_share: float = 0.48,
                 max_seq_len: str = "ubatch", max_ubatches: int | None = None, capacity: int = 256) -> None:
        check_thresholds("ShapePlanner thresholds", thresholds)
        check_max_seq_len("ShapePlanner", max_seq_len)
        check_cut_settings(num_ubatches, policy, min_share, max_ubatches)
        if capacity < 1:
            raise ValueError(f"capacity ({capacity}) must be at least 1")
        self.num_ubatches, self.policy, self.thresholds = num_ubatches, policy, thresholds
        self.min_share, self.max_seq_len, self.capacity = min_share, max_seq_len, capacity
        self._offsets: dict[tuple[Any, ...], Offsets] = {}
        # this planner's part of an Offsets.memo key (not the planner itself: no reference cycle)
        self._memo_key = object()

    def offsets(self, attn_metadata: AttentionMetadata) -> Offsets:
        """The metadata's ``query_start_loc_cpu`` as :class:`Offsets`: checked (as
        :func:`~asyncdbo.plan.as_query_start_loc` checks them) the first time these values come."""
        qsl_t = attn_metadata.query_start_loc_cpu
        # Only an integer CPU tensor's values are a key: floats equal to ints hash alike.
        if type(qsl_t) is torch.Tensor and qsl_t.dtype in _INT_DTYPES and qsl_t.is_cpu and qsl_t.dim() == 1:
            key = (tuple(qsl_t.tolist()), qsl_t.dtype)
            got = self._offsets.get(key)
            if got is not None:
                return got
        else:
            key = None
        checked = CheckedOffsets(as_query_start_loc(qsl_t))
        got = Offsets(key, checked, is_uniform_decode(checked, self.thresholds.num_spec_tokens))
        if key is not None:
            _keep(self._offsets, key, got, self.capacity)
        return got

    def plan(self, attn_metadata: AttentionMetadata, *, enabled: bool = True, step: int = 0, config: str = "",
             decision: DPDecision | None = None, evidence: str | object = "",
             offsets: Offsets | None = None) -> tuple[StepPlan, bool]:
        """The plan of a step with this metadata, as ``plan_step(attn_metadata.query_start_loc_cpu,
        attn_metadata=attn_metadata, ...)`` with these arguments plans it, and whether its offsets
        are a uniform decode. ``offsets``: :meth:`offsets` of this metadata, where the caller read
        them already."""
        if enabled is not True and enabled is not False:
            check_bool("ShapePlanner.plan() ", "enabled", enabled)
        if offsets is None:
            offsets = self.offsets(attn_metadata)
        qsl = offsets.checked
        if attn_metadata.num_actual_tokens != qsl[-1]:
            raise ValueError(
                f"attn_metadata has {attn_metadata.num_actual_tokens} tokens but query_start_loc has "
                f"{qsl[-1]}; plan with the metadata's query_start_loc_cpu"
            )
        # What goes into the cut besides the offsets: the flag, or the caller's decision (its reason
        # and detail go into the record only, below).
        given = None if decision is None else (decision.should_ubatch and self.num_ubatches > 1,
                                               decision.num_tokens_padded)
        key = (self._memo_key, bool(enabled), given)  # (offsets may be shared by planners of other configurations)
        shape = offsets.memo.get(key)
        if shape is None:
            cut = _vote_and_cut(qsl, offsets.uniform and (bool(enabled) or decision is not None), self.num_ubatches,
                                self.policy, self.thresholds, bool(enabled), qsl[-1] == 0, None, self.min_share,
                                None, None, None, decision)
            microbatched, _, _, _, slices, flags, *_ = cut
            template = SplitTemplate.make(attn_metadata.query_start_loc_cpu, slices, flags) if microbatched else None
            shape = _Shape(cut, template)
            remember(offsets, key, shape)
        cut = shape.cut
        if decision is not None:
            cut = (cut[0], decision.reason, decision._raw_detail, *cut[3:])  # (its text when read)
        microbatched, _, _, padded, slices, *_ = cut
        metas = (tuple(shape.template.apply(attn_metadata, self.max_seq_len)) if shape.template is not None
                 else (attn_metadata,))
        record = _record(cut, step, self.policy, decision, config, evidence)
        return StepPlan(microbatched, slices, padded, metas, record, decision), offsets.uniform


def remember(offsets: Offsets, key: Any, value: Any) -> None:
    """Keep ``value`` with ``offsets`` under ``key`` (what follows from them alone), unless they are
    no key (planned anew every step). At most 16 things are kept per offsets: a DP decision's
    padded total, part of a planner's key, may vary from step to step."""
    if offsets.key is not None:
        if len(offsets.memo) >= 16:
            offsets.memo.clear()
        offsets.memo[key] = value


def _keep(cache: dict[Any, Any], key: Any, value: Any, capacity: int) -> None:
    """Keep ``value`` under ``key``, first dropping the older half of ``cache`` if it is full."""
    if len(cache) >= capacity:
        for old in list(cache)[: max(1, capacity // 2)]:
            del cache[old]
    cache[key] = value
