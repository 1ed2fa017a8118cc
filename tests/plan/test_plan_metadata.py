"""Attention-metadata validation, split and output merge, as specifications."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from asyncdbo.plan import (
    AttentionMetadata,
    SplitKind,
    ThresholdConfig,
    UBatchSlice,
    merge_outputs,
    slice_tokens,
    split_attn_metadata,
    split_extra,
    split_tokens,
)
from asyncdbo.plan.validate import check_slices

# Requests with query lengths 3, 7, 1, 9 (20 tokens) over prefixes of 2, 0, 3, 11 tokens.
QUERY_LENS = [3, 7, 1, 9]
SEQ_LENS = [5, 7, 4, 20]


def make_meta(cls: type[AttentionMetadata] = AttentionMetadata, **extra: object) -> AttentionMetadata:
    block_table_RB = torch.arange(8, dtype=torch.int32).reshape(4, 2)
    slot_mapping_T = torch.arange(100, 120, dtype=torch.int64)
    return cls.from_lengths(QUERY_LENS, SEQ_LENS, block_table_RB, slot_mapping_T, **extra)


def test_from_lengths_builds_consistent_metadata() -> None:
    meta = make_meta()
    assert meta.query_start_loc_cpu.tolist() == [0, 3, 10, 11, 20]
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (4, 20, 9, 20)


def test_split_with_a_straddling_request_rebases_and_adjusts_seq_lens() -> None:
    # Padded to 24, the token split cuts at 12, inside request 3 (tokens 11..20, prefix 11).
    first, second = split_attn_metadata(make_meta(), split_tokens([0, 3, 10, 11, 20], 2, 24))

    # Truncated head: request 3 has 1 of its 9 tokens here and sees only 11 + 1 = 12 positions.
    assert first.query_start_loc_cpu.tolist() == [0, 3, 10, 11, 12]
    assert first.query_start_loc.tolist() == [0, 3, 10, 11, 12]
    assert first.seq_lens_cpu.tolist() == [5, 7, 4, 12] == first.seq_lens.tolist()
    assert first.block_table.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert first.slot_mapping.tolist() == list(range(100, 112))
    assert (first.num_reqs, first.num_actual_tokens, first.max_query_len, first.max_seq_len) == (4, 12, 7, 12)

    # Continuation: the other 8 tokens of request 3 keep the full seq_len (attend over the prefix).
    assert second.query_start_loc_cpu.tolist() == [0, 8]
    assert second.seq_lens_cpu.tolist() == [20]
    assert second.block_table.tolist() == [[6, 7]]
    assert second.slot_mapping.tolist() == list(range(112, 120))
    assert (second.num_reqs, second.num_actual_tokens, second.max_query_len, second.max_seq_len) == (1, 8, 8, 20)


def test_split_does_not_modify_the_original() -> None:
    meta = make_meta()
    split_attn_metadata(meta, split_tokens([0, 3, 10, 11, 20], 2, 24))
    assert meta.seq_lens.tolist() == SEQ_LENS and meta.query_start_loc.tolist() == [0, 3, 10, 11, 20]


def test_an_empty_ubatch_gets_empty_metadata() -> None:
    meta = AttentionMetadata.from_lengths([5], [5], torch.zeros(1, 2, dtype=torch.int32), torch.arange(5))
    first, second = split_attn_metadata(meta, split_tokens([0, 5], 2, 100))
    assert first.num_actual_tokens == 5
    assert second.query_start_loc_cpu.tolist() == [0]
    assert (second.num_reqs, second.num_actual_tokens, second.max_query_len, second.max_seq_len) == (0, 0, 0, 0)
    assert tuple(second.block_table.shape) == (0, 2) and tuple(second.slot_mapping.shape) == (0,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithPositions(AttentionMetadata):
    positions: torch.Tensor
    temperature: torch.Tensor
    scale: float
    split_rules: ClassVar = {"positions": SplitKind.PER_TOKEN, "temperature": SplitKind.PER_REQUEST,
                             "scale": SplitKind.SHARED}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithUndeclared(AttentionMetadata):
    positions: torch.Tensor


def test_a_subclass_splits_its_declared_fields() -> None:
    meta = make_meta(WithPositions, positions=torch.arange(20), temperature=torch.tensor([1.0, 2.0, 3.0, 4.0]),
                     scale=0.5)
    first, second = split_attn_metadata(meta, split_tokens([0, 3, 10, 11, 20], 2, 24))
    assert isinstance(second, WithPositions)
    assert second.positions.tolist() == list(range(12, 20))
    assert first.temperature.tolist() == [1.0, 2.0, 3.0, 4.0] and second.temperature.tolist() == [4.0]
    assert first.scale == second.scale == 0.5


def test_a_field_without_a_split_rule_is_an_error_never_copied() -> None:
    meta = make_meta(WithUndeclared, positions=torch.arange(20))
    with pytest.raises(ValueError, match=r"WithUndeclared has field\(s\) \['positions'\] with no split rule; "
                                         r"declare one per field, e\.g\. split_rules = \{'positions': SplitKind"):
        split_attn_metadata(meta, split_tokens([0, 3, 10, 11, 20], 2))


def test_split_extra_needs_a_kind_for_every_field() -> None:
    slices = split_tokens([0, 3, 10, 11, 20], 2, 24)
    parts = split_extra({"positions": torch.arange(20), "temp": torch.arange(4)},
                        {"positions": "token", "temp": SplitKind.PER_REQUEST}, slices)
    assert parts[1]["positions"].tolist() == list(range(12, 20)) and parts[1]["temp"].tolist() == [3]
    with pytest.raises(ValueError, match=r"extra field\(s\) \['mrope'\] have no declared split kind; pass kinds="):
        split_extra({"mrope": torch.arange(20)}, {}, slices)
    with pytest.raises(ValueError, match=r"split kind 'tokens' of extra field 'p' is unknown; use 'token', 'request' or 'shared'"):
        split_extra({"p": torch.arange(20)}, {"p": "tokens"}, slices)


def test_two_field_slices_get_their_flags_from_query_start_loc() -> None:
    # vLLM's UBatchSlice has a request range and a token range only. Requests of 32 and 40 new
    # tokens cut at 68: ubatch 0 holds 36 of request 1's tokens and must see a context of 36, not
    # 40 (which would read KV slots the ubatch after it has not written yet).
    meta = AttentionMetadata.from_lengths([32, 40], [32, 40], torch.arange(4, dtype=torch.int32).reshape(2, 2),
                                          torch.arange(72))
    first, second = split_attn_metadata(meta, [UBatchSlice(slice(0, 2), slice(0, 68), slice(0, 68)),
                                               UBatchSlice(slice(1, 2), slice(68, 72), slice(68, 72))])
    assert first.seq_lens_cpu.tolist() == [32, 36] == first.seq_lens.tolist()
    assert second.seq_lens_cpu.tolist() == [40] and second.query_start_loc_cpu.tolist() == [0, 4]
    with pytest.raises(ValueError, match=r"^ubatch 0 \(tokens 0:68, requests 0:2\) has last_is_truncated=False, but "
                                         r"query_start_loc says True; leave the flags None to derive them$"):
        split_attn_metadata(meta, [UBatchSlice(slice(0, 2), slice(0, 68), slice(0, 68), False, False),
                                   UBatchSlice(slice(1, 2), slice(68, 72), slice(68, 72))])


def _slices(*spec: tuple[tuple[int, int], tuple[int, int]]) -> list[UBatchSlice]:
    return [UBatchSlice(slice(*reqs), slice(*toks), slice(*toks)) for reqs, toks in spec]


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        # tokens 4:12 in both ubatches
        (_slices(((0, 4), (0, 12)), ((1, 4), (4, 20))),
         r"^ubatch 1 \(tokens 4:20, requests 1:4\) overlaps ubatch 0 \(tokens 0:12, requests 0:4\): tokens 4:12 would be "
         r"computed twice; slices may leave tokens out, but no token may be in two$"),
        # the same overlap, given in the other order
        (_slices(((1, 4), (4, 20)), ((0, 4), (0, 12))),
         r"^ubatch 1 \(tokens 0:12, requests 0:4\) overlaps ubatch 0 \(tokens 4:20, requests 1:4\): tokens 4:12 would be "
         r"computed twice; slices may leave tokens out, but no token may be in two$"),
        # request 1 (tokens 3:10) listed by ubatch 1 (tokens 10:20)
        (_slices(((0, 2), (0, 10)), ((1, 4), (10, 20))),
         r"^ubatch 1 \(tokens 10:20, requests 1:4\) lists request 1 \(tokens 3:10\), which has no token in it; a "
         r"ubatch's requests are exactly those with tokens in its token range \(use slices_from_split_points to "
         r"build slices\)$"),
        # a request range that does not match the tokens (it used to fail as "query_start_loc must start at 0")
        (_slices(((1, 4), (0, 20)),),
         r"^ubatch 0 \(tokens 0:20, requests 1:4\) omits request 0 \(tokens 0:3\), which has tokens 0:3 in it"),
        ([], r"^no ubatch slices given; pass at least one \(the whole batch is one slice\)$"),
    ],
)
def test_slices_that_overlap_or_disagree_with_the_batch_are_named(slices: list[UBatchSlice], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_attn_metadata(make_meta(), slices)


GAPS = [
    # tokens 10:12 in neither
    (_slices(((0, 2), (0, 10)), ((3, 4), (12, 20))),
     "ubatch 1 (tokens 12:20, requests 3:4) leaves tokens 10:12 after ubatch 0 (tokens 0:10) in no ubatch; "
     "each ubatch must start where the previous one stops, the first at token 0"),
    (_slices(((0, 4), (2, 20)),),
     "ubatch 0 (tokens 2:20, requests 0:4) leaves tokens 0:2 before it in no ubatch; each ubatch must start where "
     "the previous one stops, the first at token 0"),
    (_slices(((0, 2), (0, 10)), ((2, 4), (10, 16))),
     "the ubatches stop at token 16 but the batch has 20 tokens: tokens 16:20 are in no ubatch"),
    (_slices(((0, 4), (0, 12)), ((1, 4), (4, 20))),
     "ubatch 1 (tokens 4:20, requests 1:4) overlaps ubatch 0 (tokens 0:12): tokens 4:12 would be computed twice; "
     "each ubatch must start where the previous one stops"),
]


@pytest.mark.parametrize(("slices", "message"), GAPS, ids=["gap", "head", "tail", "overlap"])
def test_a_steps_slices_must_tile_the_batch(slices: list[UBatchSlice], message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_slices(make_meta().query_start_loc_cpu.tolist(), slices, tile=True)
    assert str(info.value) == message


@pytest.mark.parametrize(("slices", "_"), GAPS[:3], ids=["gap", "head", "tail"])
def test_split_attn_metadata_takes_slices_with_gaps(slices: list[UBatchSlice], _: str) -> None:
    """As vLLM's split_attn_metadata does: each slice is split on its own; the tokens between
    them are simply in none."""
    meta = make_meta()
    for s, part in zip(slices, split_attn_metadata(meta, slices)):
        assert part.num_actual_tokens == s.num_tokens
        assert torch.equal(part.slot_mapping, meta.slot_mapping[s.token_slice])


def test_plan_step_refuses_slices_of_its_own_planner_that_do_not_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncdbo.plan import step

    def gapped(qsl: list[int], *args: object, **kwargs: object) -> list[UBatchSlice]:
        return _slices(((0, 2), (0, 10)), ((3, 4), (12, 20)))  # a planner that dropped tokens 10:12

    monkeypatch.setattr(step, "plan_slices", gapped)
    with pytest.raises(ValueError) as info:
        step.plan_step(make_meta().query_start_loc_cpu, attn_metadata=make_meta(),
                       thresholds=step.ThresholdConfig(decode_threshold=1, prefill_threshold=1))
    assert str(info.value) == GAPS[0][1]


def test_slices_that_do_not_fit_the_batch_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"ubatch 1 \(tokens 15:30, requests 1:2\) exceeds the batch \(20 tokens, 4 requests\)"):
        split_attn_metadata(make_meta(), split_tokens([0, 15, 30], 2))


def test_merge_strips_padding_and_restores_token_order() -> None:
    slices = split_tokens([0, 3, 10, 11, 20], 2, 24)
    x_PD = torch.arange(24 * 2).reshape(24, 2)
    out = merge_outputs(slice_tokens(x_PD, slices), slices, 20)
    assert torch.equal(out, x_PD[:20])
    pair = merge_outputs([(o, o + 1) for o in slice_tokens(x_PD, slices)], slices, 20)
    assert isinstance(pair, tuple) and torch.equal(pair[1], x_PD[:20] + 1)


def test_merge_rejects_mismatches() -> None:
    slices = split_tokens([0, 3, 10, 11, 20], 2)
    with pytest.raises(ValueError, match=r"^got 1 outputs for 2 ubatches; pass one per ubatch$"):
        merge_outputs([torch.zeros(20)], slices, 20)
    with pytest.raises(ValueError, match=r"the slices hold 20 real tokens but num_tokens_unpadded is 24"):
        merge_outputs([torch.zeros(10), torch.zeros(10)], slices, 24)
    with pytest.raises(ValueError, match=r"output of ubatch 1 has 4 rows but the ubatch has 10 real tokens"):
        merge_outputs([torch.zeros(10), torch.zeros(4)], slices, 20)


def _meta(**changes: object) -> AttentionMetadata:
    return dataclasses.replace(make_meta(), **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"query_start_loc_cpu": torch.tensor([0, 3, 2, 11, 20], dtype=torch.int32)},
         r"query_start_loc must be non-decreasing, but request 1 has a negative query length \(2 - 3 = -1\)"),
        ({"seq_lens_cpu": torch.tensor([2, 7, 4, 20], dtype=torch.int32)},
         r"seq_len of request 0 \(2\) is below its query length \(3\)"),
        ({"block_table": torch.zeros(3, 2, dtype=torch.int32)},
         r"block_table has 3 rows but there are 4 requests"),
        ({"slot_mapping": torch.zeros(19, dtype=torch.int64)},
         r"slot_mapping has 19 entries but there are 20 tokens"),
        ({"num_actual_tokens": 21}, r"num_actual_tokens \(21\) must equal query_start_loc\[-1\] \(20\)"),
        ({"max_query_len": 8}, r"max_query_len \(8\) is below the longest query \(9\)"),
        ({"seq_lens": torch.zeros(4)}, r"seq_lens must be a 1-D integer tensor \(got shape \(4,\), dtype torch.float32\)"),
    ],
)
def test_invalid_metadata_is_rejected_with_the_bad_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _meta(**changes)


def test_negative_query_length_in_from_lengths() -> None:
    with pytest.raises(ValueError, match=r"query length of request 1 \(-2\) is negative"):
        AttentionMetadata.from_lengths([3, -2], [3, 3], torch.zeros(2, 1, dtype=torch.int32), torch.arange(1))


def test_a_decode_shape_planned_again_cuts_this_steps_metadata() -> None:
    # plan_step keeps the cut of a uniform decode shape; the metadata is cut from each step's own tensors
    from asyncdbo.plan import ThresholdConfig, plan_step

    def decode(first_slot: int, seq: int) -> AttentionMetadata:
        return AttentionMetadata.from_lengths([1] * 6, [seq + r for r in range(6)], torch.arange(12).reshape(6, 2),
                                              torch.arange(first_slot, first_slot + 6))

    low = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
    a, b = decode(100, 3), decode(200, 9)
    plan_a = plan_step(a.query_start_loc_cpu, attn_metadata=a, thresholds=low, step=0)
    plan_b = plan_step(b.query_start_loc_cpu, attn_metadata=b, thresholds=low, step=1)
    assert plan_b.slices == plan_a.slices and plan_b.record == dataclasses.replace(plan_a.record, step=1)
    for plan, meta in ((plan_a, a), (plan_b, b)):
        for s, part in zip(plan.slices, plan.attn_metadata):
            assert torch.equal(part.slot_mapping, meta.slot_mapping[s.token_slice])
            assert torch.equal(part.seq_lens_cpu, meta.seq_lens_cpu[s.request_slice])
            assert part.max_seq_len == int(meta.seq_lens_cpu[s.request_slice].max())
    padded = plan_step(b.query_start_loc_cpu, attn_metadata=b, thresholds=low, num_tokens_padded=8)
    assert padded.record.ubatch_num_tokens_padded == (4, 4) and plan_b.record.ubatch_num_tokens_padded == (3, 3)


def test_each_ubatch_keeps_its_own_max_seq_len_or_with_max_seq_len_batch_the_steps() -> None:
    """The default is each ubatch's own longest request; ``"batch"`` is vLLM's rule (the whole
    batch's in every ubatch, so an attention kernel chosen at graph capture stays the one replayed),
    through split_attn_metadata and plan_step alike; everything else about the split is the same."""
    from asyncdbo.plan import plan_step
    from asyncdbo.plan.metadata import MAX_SEQ_LEN_RULES

    meta = make_meta()
    slices = split_tokens(meta.query_start_loc_cpu.tolist(), 2, 20)
    own = split_attn_metadata(meta, slices)
    batch = split_attn_metadata(meta, slices, max_seq_len="batch")
    assert [m.max_seq_len for m in own] == [7, 20] and [m.max_seq_len for m in batch] == [20, 20]
    for a, b in zip(own, batch):
        assert torch.equal(a.seq_lens_cpu, b.seq_lens_cpu) and a.max_query_len == b.max_query_len
    plan = plan_step(meta.query_start_loc_cpu.tolist(), thresholds=ThresholdConfig(prefill_threshold=1),
                     attn_metadata=meta, max_seq_len="batch")
    assert [m.max_seq_len for m in plan.attn_metadata] == [20, 20]
    assert MAX_SEQ_LEN_RULES == ("ubatch", "batch")
    for call in (lambda: split_attn_metadata(meta, slices, max_seq_len="vllm"),
                 lambda: plan_step([0, 4], max_seq_len="vllm")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value).endswith(
            " max_seq_len='vllm': use 'ubatch' (each ubatch's own longest request, the default) or 'batch' (the "
            "whole batch's in every ubatch, vLLM's rule, for graphs captured per batch)")
