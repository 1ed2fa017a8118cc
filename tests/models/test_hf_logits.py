"""``HFMoEModel(logits="last")``: the LM head runs on each request's last new token only (what a
sampler reads); those rows are the default model's rows, the others zeros, for every
architecture, in the fast path (within float rounding: the GEMM sees 3 rows instead of 34) and
in exact mode (bit for bit: the LM head runs in fixed row tiles); and a DBO step whose token split
cuts a request computes the serial step's rows."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("transformers")

from asyncdbo.models.hf import from_hf_model  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402
from asyncdbo.plan import ThresholdConfig  # noqa: E402
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig  # noqa: E402

CHUNKS = [(0, list(range(1, 14))), (1, list(range(2, 22))), (2, [5])]  # 13 + 20 + 1 tokens
LAST = [12, 32, 33]  # each request's last token


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("exact", [False, True])
def test_last_token_logits_are_the_default_models_rows(name: str, exact: bool) -> None:
    hf = tiny_hf_model(name)
    logits = {}
    for which in ("all", "last"):
        model = from_hf_model(hf, deterministic=exact or None, logits=which)
        batch = BatchBuilder(model.kv_cache_config).build(CHUNKS)
        logits[which] = asyncio.run(model.forward(batch.input_ids_T, batch.positions_T, batch.attn))
    full, last = logits["all"], logits["last"]
    if exact:
        assert torch.equal(last[LAST], full[LAST])
    else:
        torch.testing.assert_close(last[LAST], full[LAST], rtol=1e-5, atol=1e-5)
    others = [t for t in range(full.shape[0]) if t not in LAST]
    assert torch.equal(last[others], torch.zeros(len(others), full.shape[1]))


def test_a_token_split_that_cuts_a_request_computes_the_serial_rows() -> None:
    hf = tiny_hf_model("mixtral")
    runner = DBORunner(from_hf_model(hf, deterministic=True, logits="last"),
                       RunnerConfig(thresholds=ThresholdConfig(prefill_threshold=1, decode_threshold=1)))
    serial_model = from_hf_model(hf, deterministic=True, logits="last")
    batch = BatchBuilder(serial_model.kv_cache_config).build(CHUNKS)
    serial = asyncio.run(serial_model.forward(batch.input_ids_T, batch.positions_T, batch.attn))
    split = asyncio.run(runner.step(batch))
    assert split.record.microbatched and split.plan.slices[0].last_is_truncated
    assert torch.equal(split.logits_TV, serial)


def test_an_unknown_logits_choice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^HFMoEModel\(logits='first'\): use one of \('all', 'last'\)$"):
        from_hf_model(tiny_hf_model("mixtral"), logits="first")


def test_greedy_generate_refuses_a_non_finite_row_instead_of_taking_token_0() -> None:
    from asyncdbo.models.hf import from_hf_model
    from asyncdbo.models.hf.generate import greedy_generate
    from asyncdbo.models.hf.reference import tiny_hf_model
    from asyncdbo.serving import BatchBuilder, DBORunner, NonFiniteLogitsError

    model = from_hf_model(tiny_hf_model("qwen3-moe"), block_size=4, num_kv_blocks=16, max_ubatches=2)
    runner = DBORunner(model)
    step = runner.step

    async def nan_step(batch: object, **kw: object) -> object:
        res = await step(batch, **kw)  # type: ignore[arg-type]
        res.logits_TV[-1, 3] = float("nan")  # request 8's last row
        return res
    runner.step = nan_step  # type: ignore[method-assign,assignment]
    with pytest.raises(NonFiniteLogitsError, match=r"step 0 \(serial\): the last logits rows of requests \[8\] hold NaN"):
        asyncio.run(greedy_generate([(runner, False)], BatchBuilder(model.kv_cache_config), {7: [1, 2], 8: [3]},
                                    decode_steps=1))
