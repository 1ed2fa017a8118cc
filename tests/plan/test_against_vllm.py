"""asyncdbo's planning against vLLM's own functions, on random batches.

Runs only where ``vllm`` is importable (it is no part of asyncdbo's install, default or dev:
CI skips this module); docs/porting_from_vllm.md names what it checks. Written against vLLM
0.32's ``vllm/v1/worker/ubatch_utils.py``: ``check_ubatch_thresholds(config, num_tokens,
uniform_decode)`` and ``maybe_create_ubatch_slices(should_ubatch, num_scheduled_tokens,
num_tokens_padded, num_reqs_padded, num_ubatches, split_point=None)``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

ubatch_utils = pytest.importorskip("vllm.v1.worker.ubatch_utils", reason="vllm is not installed (not in asyncdbo's extras)")
np = pytest.importorskip("numpy")

from asyncdbo.plan import ThresholdConfig, UBatchSlice, should_microbatch, split_tokens  # noqa: E402

SEEDS = range(200)


def batch(rng: random.Random) -> list[int]:
    """Per-request new-token counts: uniform decode, or a mix with prefills."""
    n = rng.randint(1, 64)
    if rng.random() < 0.4:
        return [1] * n
    return [rng.choice([1, 1, rng.randint(2, 600)]) for _ in range(n)]


def qsl_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_the_threshold_decision_is_vllms(seed: int) -> None:
    rng = random.Random(seed)
    lengths = batch(rng)
    cfg = ThresholdConfig(decode_threshold=rng.choice([1, 32, 64]), prefill_threshold=rng.choice([1, 128, 512]))
    config = SimpleNamespace(use_ubatching=True, enable_dbo=True, dbo_decode_token_threshold=cfg.decode_threshold,
                             dbo_prefill_token_threshold=cfg.prefill_threshold)
    uniform = all(n == 1 for n in lengths)
    ours, _ = should_microbatch(sum(lengths), qsl_of(lengths), cfg)
    assert ours == ubatch_utils.check_ubatch_thresholds(config, sum(lengths), uniform), lengths


@pytest.mark.parametrize("seed", SEEDS)
def test_the_token_split_is_vllms_and_its_slices_are_accepted(seed: int) -> None:
    rng = random.Random(seed)
    lengths = batch(rng)
    total = sum(lengths)
    if total < 2:
        pytest.skip("one token: nothing to split")
    theirs, _ = ubatch_utils.maybe_create_ubatch_slices(True, np.array(lengths), total, len(lengths), 2)
    ours = split_tokens(qsl_of(lengths), 2, total)
    for t, o in zip(theirs, ours, strict=True):
        taken = UBatchSlice(t.request_slice, t.token_slice, t.token_slice)  # numpy bounds included
        assert (taken.token_slice, taken.request_slice) == (o.token_slice, o.request_slice), lengths


@pytest.mark.parametrize("seed", range(100))
def test_the_smallest_rank_rule_is_vllm_v2s_dp_decision(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ThresholdConfig(dp_rule="smallest_rank")`` against vLLM's model runner V2 deciding for each
    rank with its own ``sync_cudagraph_and_dp_padding`` (eager, no CUDA graphs): its all-reduce is
    replaced by the table every rank's column fills, nothing else. Busy ranks only: V2 counts an
    idle rank's zero tokens as the smallest (docs/porting_from_vllm.md)."""
    import torch

    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import dp_utils
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    from asyncdbo.plan import PlanReason, RankVote, decide_from_votes

    rng = random.Random(seed)
    ranks = [batch(rng) for _ in range(rng.randint(2, 4))]
    cfg = ThresholdConfig(decode_threshold=rng.choice([1, 32, 64]), prefill_threshold=rng.choice([1, 128, 512]),
                          dp_rule="smallest_rank")
    config = SimpleNamespace(use_ubatching=True, enable_dbo=True, num_ubatches=2,
                             dbo_decode_token_threshold=cfg.decode_threshold,
                             dbo_prefill_token_threshold=cfg.prefill_threshold)
    uniform = [all(n == 1 for n in lengths) for lengths in ranks]
    table = torch.zeros(6, len(ranks), dtype=torch.int32)
    for r, lengths in enumerate(ranks):
        table[:, r] = torch.tensor([sum(lengths), CUDAGraphMode.NONE.value, 1 if uniform[r] else 0, max(lengths), 1,
                                    len(lengths)])
    monkeypatch.setattr(dp_utils, "get_dp_group", lambda: SimpleNamespace(cpu_group=None))
    monkeypatch.setattr(dp_utils, "should_skip_dp_coordination", lambda: False)
    monkeypatch.setattr(dp_utils.dist, "all_reduce", lambda tensor, group=None: tensor.copy_(table))
    for r, lengths in enumerate(ranks):
        desc, _ = dp_utils.sync_cudagraph_and_dp_padding(
            None, BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=sum(lengths), num_reqs=len(lengths)),
            sum(lengths), len(lengths), 1 if uniform[r] else None, len(ranks), r, max_query_len=max(lengths),
            parallel_config=config, allow_ubatching=True, uniform_decode=uniform[r])
        theirs = desc.num_ubatches > 1
        votes = [RankVote(k, "yes", PlanReason.MICROBATCHED, sum(ls), sum(ls), uniform_len=1 if uniform[k] else 0)
                 for k, ls in enumerate(ranks)]
        ours = decide_from_votes(votes, rank=r, thresholds=cfg).should_ubatch
        assert ours == theirs, (ranks, cfg)
        OUTCOMES.add(ours)


OUTCOMES: set[bool] = set()


def test_the_random_groups_above_reach_both_outcomes() -> None:
    """Runs after them (pytest keeps a module's order): the seeds split some groups and not others."""
    if not OUTCOMES:
        pytest.skip("run with the V2 cases above (-k selected this one alone)")
    assert OUTCOMES == {True, False}
