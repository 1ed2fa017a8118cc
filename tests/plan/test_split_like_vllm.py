"""Cases of vLLM's own tests of ``split_attn_metadata`` / ``_make_metadata_with_slice``, transcribed.

Source: vllm-project/vllm, tests/v1/attention/test_attention_splitting.py (commit 037a0752),
with its batches from tests/v1/attention/test_attention_backends.py ``BATCH_SPECS``
(``small_decode``: seq_lens [32, 40], query_lens [1, 1]; ``mixed_small``: seq_lens
[32, 40, 48, 56], query_lens [1, 1, 5, 5]; ``large_decode``: 32 requests of seq_len 2048, one
query token each). vLLM builds metadata for any in-range slice, also one that leaves the rest
of the batch out; so does asyncdbo's split (a step's own slices tile the batch: plan_step checks
that). The expected values are vLLM's; the block tables here are placeholders (vLLM's tests do
not check them).
"""

from __future__ import annotations

import torch

from asyncdbo.plan import AttentionMetadata, UBatchSlice, split_attn_metadata


def batch(seq_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    tokens = sum(query_lens)
    return AttentionMetadata.from_lengths(query_lens, seq_lens, torch.zeros(len(seq_lens), 4, dtype=torch.int32),
                                          torch.arange(tokens))


def vllm_slice(requests: slice, tokens: slice) -> UBatchSlice:
    """vLLM's two-field UBatchSlice(request_slice, token_slice)."""
    return UBatchSlice(requests, tokens, tokens)


def test_make_metadata_with_slice_decode_batch() -> None:
    (result,) = split_attn_metadata(batch([32, 40], [1, 1]), [vllm_slice(slice(0, 1), slice(0, 1))])
    assert result.num_reqs == 1
    assert result.num_actual_tokens == 1
    assert result.max_query_len == 1
    assert result.query_start_loc.tolist() == [0, 1]
    assert result.seq_lens.tolist() == [32]


def test_make_metadata_with_slice_mixed_batch() -> None:
    (result,) = split_attn_metadata(batch([32, 40, 48, 56], [1, 1, 5, 5]), [vllm_slice(slice(1, 3), slice(1, 7))])
    assert result.num_reqs == 2
    assert result.num_actual_tokens == 6
    assert result.max_query_len == 5
    assert result.query_start_loc.tolist() == [0, 1, 6]
    assert result.seq_lens.tolist() == [40, 48]


def test_split_attn_metadata_decode_batch() -> None:
    meta = batch([2048] * 32, [1] * 32)
    mid = 16
    first, second = split_attn_metadata(meta, [vllm_slice(slice(0, mid), slice(0, mid)),
                                               vllm_slice(slice(mid, 32), slice(mid, 32))])
    for part in (first, second):
        assert part.num_reqs == mid and part.num_actual_tokens == mid
        assert part.seq_lens.tolist() == [2048] * mid


def test_prefill_split_across_ubatches() -> None:
    """vLLM's parametrized case: seq_lens [32, 40], query_lens [8, 8], split at token 12 (inside
    request 1: 2 and 1 requests) and at token 4 (inside request 0: 1 and 2 requests). The
    split request's first chunk sees its context plus that chunk; the second sees it whole."""
    seq_lens, query_lens = [32, 40], [8, 8]
    meta = batch(seq_lens, query_lens)
    for split, (reqs0, reqs1), req in ((12, (slice(0, 2), slice(1, 2)), 1), (4, (slice(0, 1), slice(0, 2)), 0)):
        first, second = split_attn_metadata(meta, [vllm_slice(reqs0, slice(0, split)),
                                                   vllm_slice(reqs1, slice(split, 16))])
        assert (first.num_actual_tokens, second.num_actual_tokens) == (split, 16 - split)
        assert (first.num_reqs, second.num_reqs) == (reqs0.stop - reqs0.start, reqs1.stop - reqs1.start)
        in_first = split - 8 * req
        qlen_first_last = int(first.query_start_loc_cpu[-1] - first.query_start_loc_cpu[-2])
        qlen_second_first = int(second.query_start_loc_cpu[1] - second.query_start_loc_cpu[0])
        assert qlen_first_last == in_first and qlen_first_last + qlen_second_first == query_lens[req]
        context = seq_lens[req] - query_lens[req]
        assert int(first.seq_lens[-1]) == context + in_first
        assert [int(v) for v in first.seq_lens[:-1]] == seq_lens[: first.num_reqs - 1]
        assert int(second.seq_lens[0]) == seq_lens[req]
        assert [int(v) for v in second.seq_lens[1:]] == seq_lens[req + 1:]
