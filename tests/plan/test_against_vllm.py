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
