"""Property tests over random batches: every policy, 1 to 8 ubatches, decode/prefill mixes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncdbo.plan import (
    AttentionMetadata,
    UBatchSlice,
    merge_outputs,
    plan_slices,
    slice_tokens,
    split_attn_metadata,
    split_requests,
)

# A request: (query tokens, prefix tokens already in the KV cache).  Decode steps have 1 query
# token; prefills up to 64; a few have 0 (the planner must still place them somewhere).
request = st.one_of(
    st.tuples(st.just(1), st.integers(0, 200)),
    st.tuples(st.integers(0, 64), st.integers(0, 50)),
)
batch = st.lists(request, min_size=0, max_size=12)
policies = st.sampled_from(["token", "request", "balanced"])
SETTINGS = settings(max_examples=200, deadline=None)


def qsl_of(reqs: list[tuple[int, int]]) -> list[int]:
    out = [0]
    for q, _ in reqs:
        out.append(out[-1] + q)
    return out


def meta_of(reqs: list[tuple[int, int]]) -> AttentionMetadata:
    num_reqs, num_tokens = len(reqs), sum(q for q, _ in reqs)
    block_table_RB = torch.arange(num_reqs * 3, dtype=torch.int32).reshape(num_reqs, 3)
    return AttentionMetadata.from_lengths(
        [q for q, _ in reqs], [q + p for q, p in reqs], block_table_RB,
        torch.arange(1000, 1000 + num_tokens, dtype=torch.int64),
    )


def check_partition(qsl: list[int], slices: list[UBatchSlice], padded: int) -> None:
    num_reqs, num_tokens = len(qsl) - 1, qsl[-1]
    # Real tokens and padded ranges tile [0, T) and [0, P) in order.
    assert slices[0].token_slice.start == 0 == slices[0].padded_token_slice.start
    assert slices[-1].token_slice.stop == num_tokens and slices[-1].padded_token_slice.stop == padded
    for a, b in zip(slices, slices[1:]):
        assert a.token_slice.stop == b.token_slice.start
        assert a.padded_token_slice.stop == b.padded_token_slice.start
    for s in slices:
        assert s.num_padding >= 0 and s.padded_token_slice.start >= s.token_slice.start or s.is_empty()
    # Each request's tokens are split between the ubatches listing it, never duplicated, and each
    # request (even with zero tokens) is listed by at least one ubatch.
    got = [0] * num_reqs
    listed = [0] * num_reqs
    for s in slices:
        t0, t1 = s.token_slice.start, s.token_slice.stop
        for r in range(s.request_slice.start, s.request_slice.stop):
            listed[r] += 1
            got[r] += max(0, min(qsl[r + 1], t1) - max(qsl[r], t0))
            assert qsl[r] <= t1 and qsl[r + 1] >= t0  # a listed request touches the ubatch
        assert s.first_is_continuation == (s.num_requests > 0 and qsl[s.request_slice.start] < t0)
        assert s.last_is_truncated == (s.num_requests > 0 and qsl[s.request_slice.stop] > t1)
    assert got == [qsl[r + 1] - qsl[r] for r in range(num_reqs)]
    assert all(n >= 1 for n in listed)
    for r in range(num_reqs):
        assert listed[r] == 1 or qsl[r + 1] > qsl[r]  # only a request with tokens straddles


@SETTINGS
@given(reqs=batch, n=st.integers(1, 8), policy=policies, extra_pad=st.integers(0, 40),
       min_share=st.floats(0.0, 0.5))
def test_every_token_lands_in_exactly_one_ubatch(reqs: list[tuple[int, int]], n: int, policy: str,
                                                 extra_pad: int, min_share: float) -> None:
    qsl = qsl_of(reqs)
    padded = qsl[-1] + extra_pad
    slices = plan_slices(qsl, n, policy, num_tokens_padded=padded, min_share=min_share)  # type: ignore[arg-type]
    assert len(slices) == n
    check_partition(qsl, slices, padded)
    if policy == "token":
        assert [s.num_tokens_padded for s in slices[:-1]] == [padded // n] * (n - 1)
    if policy == "request" or (policy == "balanced" and min_share == 0.0):
        assert not any(s.first_is_continuation or s.last_is_truncated for s in slices)
    if policy == "balanced" and min_share == 0.0:
        assert slices == split_requests(qsl, n, padded)


@SETTINGS
@given(reqs=batch, n=st.integers(2, 8), policy=policies, extra_pad=st.integers(0, 40))
def test_split_metadata_is_self_consistent_and_merge_restores_the_input(
    reqs: list[tuple[int, int]], n: int, policy: str, extra_pad: int
) -> None:
    meta = meta_of(reqs)
    qsl = qsl_of(reqs)
    slices = plan_slices(qsl, n, policy, num_tokens_padded=qsl[-1] + extra_pad)  # type: ignore[arg-type]
    parts = split_attn_metadata(meta, slices)  # each part re-runs the constructor's validation
    seq = [q + p for q, p in reqs]
    for s, m in zip(slices, parts):
        q = m.query_start_loc_cpu.tolist()
        assert q[0] == 0 and q[-1] == m.num_actual_tokens == s.num_tokens
        assert all(a <= b for a, b in zip(q, q[1:]))
        assert m.query_start_loc.tolist() == q and m.seq_lens.tolist() == m.seq_lens_cpu.tolist()
        assert m.block_table.shape[0] == m.num_reqs == s.num_requests
        assert m.slot_mapping.shape[0] == s.num_tokens
        lens = m.seq_lens_cpu.tolist()
        for i, r in enumerate(range(s.request_slice.start, s.request_slice.stop)):
            assert lens[i] >= q[i + 1] - q[i]
            # A request sees its prefix plus its tokens up to the end of this ubatch.
            assert lens[i] == seq[r] - max(0, qsl[r + 1] - s.token_slice.stop)
            assert m.block_table[i].tolist() == meta.block_table[r].tolist()
    assert torch.cat([m.slot_mapping for m in parts]).tolist() == meta.slot_mapping.tolist()
    # Identity "model": each ubatch returns its padded input; merging gives back the real tokens.
    x_PD = torch.randn(qsl[-1] + extra_pad, 4)
    assert torch.equal(merge_outputs(slice_tokens(x_PD, slices), slices, qsl[-1]), x_PD[: qsl[-1]])


@SETTINGS
@given(reqs=batch, min_share=st.floats(0.0, 0.5))
def test_balanced_two_way_keeps_a_fair_boundary_or_cuts_at_the_middle(
    reqs: list[tuple[int, int]], min_share: float
) -> None:
    qsl = qsl_of(reqs)
    num_tokens = qsl[-1]
    by_request = split_requests(qsl, 2)
    smaller = min(s.num_tokens for s in by_request)
    got = plan_slices(qsl, 2, "balanced", min_share=min_share)
    if smaller >= min_share * num_tokens:  # SGLang's rule: the smaller side holds >= min_share
        assert got == by_request
    else:
        assert got[0].token_slice == slice(0, num_tokens // 2)
