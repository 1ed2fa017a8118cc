"""Split policies, as specifications on small hand-computed batches."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from asyncdbo.plan import (
    UBatchSlice,
    plan_slices,
    slices_from_split_points,
    split_balanced,
    split_requests,
    split_tokens,
    whole_batch_slice,
)
from asyncdbo.plan.slices import CheckedOffsets, leaves_ubatch_empty

# Requests of 3, 7, 1 and 9 query tokens: 20 tokens.
QSL = [0, 3, 10, 11, 20]


def S(reqs: tuple[int, int], toks: tuple[int, int], padded: tuple[int, int] | None = None,
      cont: bool = False, trunc: bool = False) -> UBatchSlice:
    return UBatchSlice(slice(*reqs), slice(*toks), slice(*(padded or toks)), cont, trunc)


def test_token_split_cuts_at_padded_half_and_a_straddling_request_is_in_both() -> None:
    # 20 // 2 = 10 falls on a request boundary: no straddler.
    assert split_tokens(QSL, 2) == [S((0, 2), (0, 10)), S((2, 4), (10, 20))]
    # Padded to 24: the cut moves to 12, inside request 3 (tokens 11..20); all padding goes last.
    assert split_tokens(QSL, 2, 24) == [
        S((0, 4), (0, 12), trunc=True),
        S((3, 4), (12, 20), (12, 24), cont=True),
    ]


def test_token_split_accepts_a_tensor_and_gives_the_remainder_to_the_last_ubatch() -> None:
    got = split_tokens(torch.tensor(QSL, dtype=torch.int32), 3)
    assert got == [S((0, 2), (0, 6), trunc=True), S((1, 4), (6, 12), cont=True, trunc=True),
                   S((3, 4), (12, 20), cont=True)]
    assert [s.num_tokens for s in got] == [6, 6, 8]
    assert [s.num_requests for s in got] == [2, 3, 1]


def test_token_split_of_a_small_rank_pads_every_ubatch_to_the_group_size() -> None:
    # A rank with 5 real tokens in a group padded to 100: per-ubatch sizes must still be 50/50,
    # so its second ubatch is padding only (it still takes part in every collective).
    first, second = split_tokens([0, 5], 2, 100)
    assert first == S((0, 1), (0, 5), (0, 50))
    assert second == S((1, 1), (5, 5), (50, 100))
    assert second.is_empty() and second.num_padding == 50 and second.num_tokens_padded == 50


def test_an_idle_rank_gets_padding_only_ubatches() -> None:
    assert split_tokens([0], 2, 8) == [S((0, 0), (0, 0), (0, 4)), S((0, 0), (0, 0), (4, 8))]


def test_request_split_never_cuts_a_request() -> None:
    # Boundaries 0,3,10,11,20; the even cut is 10, itself a boundary.
    assert split_requests(QSL, 2) == [S((0, 2), (0, 10)), S((2, 4), (10, 20))]
    # Four parts of 5: boundaries nearest 5, 10, 15 are 3, 10, 11 (ties go left).
    assert [s.token_slice for s in split_requests(QSL, 4)] == [
        slice(0, 3), slice(3, 10), slice(10, 11), slice(11, 20)]
    assert not any(s.first_is_continuation or s.last_is_truncated for s in split_requests(QSL, 4))


def test_request_split_keeps_a_distinct_boundary_for_every_cut() -> None:
    # Even cuts of 1200 in three are 400 and 800; the nearest boundaries (200, 200) would leave the
    # last ubatch empty. Each cut keeps one boundary back for the cuts after it (ROCm's rule).
    assert [s.token_slice for s in split_requests([0, 100, 200, 1200], 3)] == [slice(0, 100), slice(100, 200), slice(200, 1200)]
    # 5 requests of 10 and 1 of 50 in four: cuts near 25, 50, 75 on distinct boundaries
    assert [s.token_slice.start for s in split_requests([0, 10, 20, 30, 40, 50, 100], 4)[1:]] == [20, 40, 50]
    # Too few boundaries: some ubatch is empty whatever the cuts (plan_step refuses it)
    assert [s.num_tokens for s in split_requests([0, 100, 1100], 3)] == [100, 1000, 0]


def test_split_points_give_slices_with_request_ranges_and_flags() -> None:
    # vLLM's split_point list: token offsets; SGLang's (split_seq_index, split_token_index) pairs.
    assert slices_from_split_points(QSL, [12]) == split_tokens(QSL, 2, 24)[:1] + [S((3, 4), (12, 20), cont=True)]
    assert slices_from_split_points(QSL, [(3, 12)]) == slices_from_split_points(QSL, [12])
    assert slices_from_split_points(QSL, [(2, 10)]) == split_requests(QSL, 2)  # a boundary split
    assert slices_from_split_points(QSL, [3, 11], 24) == [
        S((0, 1), (0, 3)), S((1, 3), (3, 11)), S((3, 4), (11, 20), (11, 24))]
    # SGLang's view of the second ubatch: (request_slice.start, token_slice.start)
    second = slices_from_split_points(QSL, [(3, 12)])[1]
    assert (second.request_slice.start, second.token_slice.start) == (3, 12)
    assert slices_from_split_points(QSL, []) == [whole_batch_slice(QSL)]


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ([25], r"^split point 0 \(25\) is outside the batch's tokens 0\.\.20; points are token offsets into query_start_loc$"),
        ([12, 5], r"^split points must be non-decreasing, but point 1 \(5\) is below point 0 \(12\)$"),
        ([(2, 12)], r"^split point 0 \(2, 12\): token 12 is not in request 2 \(tokens 10:11\); SGLang's "
                    r"\(split_seq_index, split_token_index\) names the request the second part starts in$"),
        ([(7, 12)], r"^split point 0 \(7, 12\): seq index 7 is not a request index of the batch \(0\.\.4, the last meaning the end\)$"),
        (["12"], r"^split point 0 must be a token offset \(int\) or a \(seq index, token index\) pair of ints \(got '12'\)$"),
    ],
)
def test_bad_split_points_are_named(points: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slices_from_split_points(QSL, points)


def test_a_malformed_slice_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"^UBatchSlice\.token_slice must be a slice\(start, stop\) with 0 <= start <= stop "
                                         r"and no step \(got slice\(3, 1, None\)\)$"):
        UBatchSlice(slice(0, 1), slice(3, 1), slice(0, 5))
    with pytest.raises(ValueError, match=r"^UBatchSlice\.padded_token_slice 0:3 is shorter than token_slice 0:5; it holds "
                                         r"the real tokens plus padding$"):
        UBatchSlice(slice(0, 1), slice(0, 5), slice(0, 3))


def test_request_split_puts_padding_at_the_end() -> None:
    assert split_requests(QSL, 2, 24)[1] == S((2, 4), (10, 20), (10, 24))


def test_balanced_keeps_a_good_request_boundary() -> None:
    # 10 | 10 is perfectly even: no request is cut.
    assert split_balanced(QSL, 2) == split_requests(QSL, 2)


def test_balanced_cuts_one_request_when_the_best_boundary_is_too_uneven() -> None:
    # Requests 2 and 18: the only inner boundary leaves 2/20 = 10% < 48% on one side,
    # so request 1 is cut at the balance point 10 (SGLang's two-chunk split).
    assert split_requests([0, 2, 20], 2) == [S((0, 1), (0, 2)), S((1, 2), (2, 20))]
    assert split_balanced([0, 2, 20], 2) == [S((0, 2), (0, 10), trunc=True), S((1, 2), (10, 20), cont=True)]
    # min_share=0 turns the cut off; 0.05 accepts the 10% side.
    assert split_balanced([0, 2, 20], 2, min_share=0.0) == split_requests([0, 2, 20], 2)
    assert split_balanced([0, 2, 20], 2, min_share=0.05) == split_requests([0, 2, 20], 2)


def test_balanced_for_four_parts_moves_only_the_cuts_next_to_a_small_part() -> None:
    # 40 tokens in requests 10,10,2,18: request cuts 10, 20, 22 leave part 2 with 2 tokens
    # (< 96% of an even 10), so the cuts around it move to their even points 20 and 30.
    got = split_balanced([0, 10, 20, 22, 40], 4)
    assert [s.token_slice for s in got] == [slice(0, 10), slice(10, 20), slice(20, 30), slice(30, 40)]
    assert got[2] == S((2, 4), (20, 30), trunc=True)
    assert got[3] == S((3, 4), (30, 40), cont=True)


def test_zero_length_requests_belong_to_exactly_one_ubatch() -> None:
    # Request 1 has no query tokens and sits on the cut at 2: it goes to the ubatch starting there.
    assert split_tokens([0, 2, 2, 4], 2) == [S((0, 1), (0, 2)), S((1, 3), (2, 4))]


def test_one_ubatch_is_the_whole_batch() -> None:
    for policy in ("token", "request", "balanced"):
        assert plan_slices(QSL, 1, policy, num_tokens_padded=24) == [S((0, 4), (0, 20), (0, 24))]
    assert whole_batch_slice(QSL) == S((0, 4), (0, 20))


@pytest.mark.parametrize(
    ("qsl", "message"),
    [
        ([], r"query_start_loc must start at 0 \(got \[\]\); it holds R\+1 token offsets"),
        ([1, 3], r"query_start_loc must start at 0 \(got \[1, 3\]\)"),
        ([0, 5, 3], r"entry 2 \(3\) is below entry 1 \(5\); request 1 would have a negative length \(-2\)"),
    ],
)
def test_bad_query_start_loc_is_named(qsl: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_tokens(qsl, 2)


def test_bad_arguments_are_named_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^num_ubatches \(0\) must be at least 1$"):
        split_tokens(QSL, 0)
    with pytest.raises(ValueError, match=r"num_tokens_padded \(19\) is below the real token count \(20\); pass None or a count >= 20"):
        split_requests(QSL, 2, 19)
    with pytest.raises(ValueError, match=r"min_share \(0\.7\) must lie in \[0, 0\.5\]"):
        split_balanced(QSL, 2, min_share=0.7)
    with pytest.raises(ValueError, match=r"unknown split policy 'sequence'; use one of \('token', 'request', 'balanced'\)"):
        plan_slices(QSL, 2, "sequence")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be a 1-D integer tensor \(got shape \(2, 2\), dtype torch.int64\)"):
        split_tokens(torch.zeros(2, 2, dtype=torch.int64), 2)


def test_integral_bounds_of_any_integer_type_become_ints() -> None:
    # vLLM 0.32's maybe_create_ubatch_slices returns slice(36, np.int32(72)); a 0-d torch integer
    # (what indexing a query_start_loc tensor gives) has __index__ too.
    np = pytest.importorskip("numpy")
    s = UBatchSlice(slice(0, np.int64(2)), slice(36, np.int32(72)), slice(torch.tensor(36), 72))
    assert s.token_slice == slice(36, 72) and type(s.token_slice.stop) is int
    assert type(s.request_slice.stop) is int and type(s.padded_token_slice.start) is int
    assert s.num_tokens == 36
    with pytest.raises(ValueError, match=r"^UBatchSlice\.token_slice must be a slice\(start, stop\) "):
        UBatchSlice(slice(0, 1), slice(0, 1.0), slice(0, 1))


def test_leaves_ubatch_empty_says_what_the_request_aligned_cut_leaves_empty() -> None:
    # from the cuts alone, what plan_slices' slices say: every (batch, N, policy, min_share) of small ragged batches
    rng = random.Random(7)
    for _ in range(3000):
        lens = [rng.choice([0, 1, 1, 2, 3, 5, 8, 100]) for _ in range(rng.randint(1, 10))]
        qsl = [0, *itertools.accumulate(lens)]
        n, policy, share = rng.randint(1, 5), rng.choice(["request", "balanced"]), rng.choice([0.0, 0.3, 0.48, 0.5])
        sizes = [s.num_tokens for s in plan_slices(qsl, n, policy, min_share=share)]
        assert leaves_ubatch_empty(CheckedOffsets(qsl), n, policy, share) == (0 in sizes), (qsl, n, policy, share)
    assert leaves_ubatch_empty(CheckedOffsets([0, 1, 2]), 3, "request")  # two requests, three ubatches
    assert not leaves_ubatch_empty(CheckedOffsets([0, 1, 2, 3]), 3, "request")
