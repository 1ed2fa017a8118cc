"""exact_check runs one step serially and with DBO and names the first tensor where they differ.

The model is transformers' tiny Qwen3-MoE in bfloat16 through ``asyncdbo.models.hf`` on one rank
(its DBO step equals the serial step bit for bit, ``tests/models/test_hf_bf16_parity.py``), which
taps four tensors per layer (``attn``, ``attn_residual``, ``moe``/``mlp``, ``residual``).  A
prefill of requests of 7, 11 and 4 tokens is cut into two ubatches of 11 tokens (request 1 is
split).  The unmodified model reports no difference; a model that moves one element of one
tensor of one layer of one ubatch by one ulp (``torch.nextafter``) is named exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import asyncdbo  # noqa: E402
from asyncdbo.dbo import dbo_current_ubatch_id, dbo_num_ubatches  # noqa: E402
from asyncdbo.models.hf import from_hf_model  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402
from asyncdbo.plan import ThresholdConfig  # noqa: E402
from asyncdbo.serving import (  # noqa: E402
    BatchBuilder,
    DBORunner,
    ExactDifference,
    ExactReport,
    RunnerConfig,
    exact_check,
    exact_tap,
)

PROMPTS = {0: [5, 17, 3, 88, 41, 9, 60], 1: [2, 71, 33, 14, 90, 8, 26, 51, 47, 12, 3], 2: [64, 1, 29, 77]}
ALWAYS = RunnerConfig(thresholds=ThresholdConfig(decode_threshold=1, prefill_threshold=1), num_ubatches=2)


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model("qwen3-moe", dtype=torch.bfloat16)


async def _check(model: Any, cfg: RunnerConfig = ALWAYS) -> ExactReport:
    runner = DBORunner(model, cfg)
    batch = BatchBuilder(model.kv_cache_config).build(list(PROMPTS.items()))
    return await exact_check(runner, batch)


def _model(hf: Any) -> Any:
    return from_hf_model(hf, schedule="ht", max_ubatches=2, block_size=4, num_kv_blocks=64, dtype=torch.bfloat16)


@pytest.mark.timeout(120)
def test_the_unmodified_model_reports_no_difference(hf: Any) -> None:
    report = asyncdbo.run(_check, _model(hf))
    assert report.equal and report.first is None
    # 2 layers x 4 taps, in each of 2 ubatches, then the logits of each ubatch
    assert report.compared == 2 * 4 * 2 + 2
    assert str(report) == "exact: the DBO step (2 ubatches) equals the serial step bit for bit (18 tensors)"
    assert [s.token_slice for s in report.dbo.plan.slices] == [slice(0, 11), slice(11, 22)]
    assert not report.serial.plan.microbatched and torch.equal(report.serial.logits_TV, report.dbo.logits_TV)


@pytest.mark.timeout(120)
def test_a_one_ulp_difference_is_named_by_layer_ubatch_tensor_and_index(hf: Any) -> None:
    model = _model(hf)
    planted: dict[str, float] = {}
    calls: dict[int, int] = {}
    residual_norm = model.segments.residual_norm

    def planting(x_TD: torch.Tensor, delta_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> Any:
        x_TD, h_TD = residual_norm(x_TD, delta_TD, w_D, eps)
        if dbo_num_ubatches() == 2:  # the DBO run only
            ub = dbo_current_ubatch_id()
            call = calls[ub] = calls.get(ub, -1) + 1
            if ub == 1 and call == 2:  # layer 1, the residual after attention
                x_TD = x_TD.clone()
                planted["serial"] = float(x_TD[2, 5])
                x_TD[2, 5] = torch.nextafter(x_TD[2, 5], torch.tensor(float("inf"), dtype=x_TD.dtype))
                planted["dbo"] = float(x_TD[2, 5])
        return x_TD, h_TD

    model.segments = dataclasses.replace(model.segments, residual_norm=planting)
    report = asyncdbo.run(_check, model)
    assert calls == {0: 3, 1: 3}  # two per layer (indices 0..3)
    assert planted["dbo"] > planted["serial"]
    assert report.first == ExactDifference(layer=1, ubatch=1, tensor="attn_residual", index=(2, 5), token=13,
                                           serial=planted["serial"], dbo=planted["dbo"], count=1)
    assert not report.equal
    assert str(report) == (
        "exact check: the DBO step (2 ubatches) first differs from the serial step at layer 1, ubatch 1, tensor "
        f"'attn_residual' at index [2, 5] (token 13 of the batch): serial {planted['serial']!r} "
        f"({planted['serial'].hex()}), DBO {planted['dbo']!r} ({planted['dbo'].hex()}); 1 element(s) of this "
        "tensor differ"
    )


@pytest.mark.timeout(120)
def test_a_tap_the_serial_run_did_not_make_is_a_structural_difference(hf: Any) -> None:
    model = _model(hf)
    forward = model.forward

    async def extra_tap(ids: torch.Tensor, pos: torch.Tensor, attn: Any) -> torch.Tensor:
        if dbo_num_ubatches() == 2 and dbo_current_ubatch_id() == 0:
            exact_tap("debug", ids[:, None].float(), layer=0)
        return await forward(ids, pos, attn)

    model.forward = extra_tap
    first = asyncdbo.run(_check, model).first
    assert first is not None and first.structure == (
        "tap 0 is 'attn' (layer 0, (22, 32) torch.bfloat16) in the serial run but 'debug' (layer 0, (11, 1) "
        "torch.float32) in the DBO run"
    )
    assert (first.layer, first.ubatch, first.tensor, first.index) == (0, 0, "debug", ())


@pytest.mark.timeout(120)
def test_a_step_that_does_not_microbatch_is_refused(hf: Any) -> None:
    with pytest.raises(ValueError, match=r"^exact_check: the DBO step was not microbatched \(.+\), so there is "
                                         r"nothing to compare; give the runner thresholds"):
        asyncdbo.run(_check, _model(hf), RunnerConfig())


def test_a_tap_outside_a_check_returns_its_tensor_and_records_nothing() -> None:
    x_TD = torch.ones(3, 4)
    assert exact_tap("x", x_TD, layer=0) is x_TD


@pytest.mark.timeout(120)
def test_a_tap_whose_first_dimension_is_not_the_tokens_is_refused(hf: Any) -> None:
    model = _model(hf)
    forward = model.forward

    async def first_row_only(ids: torch.Tensor, pos: torch.Tensor, attn: Any) -> torch.Tensor:
        exact_tap("first", ids[:1, None])
        return await forward(ids, pos, attn)

    model.forward = first_row_only
    with pytest.raises(ValueError, match=r"^exact_tap\('first', layer=None\) got 1 rows in the serial step, which ran "
                                         r"22 tokens: a tapped tensor's first dimension must be the tokens of the "
                                         r"call \(padding included\)$"):
        asyncdbo.run(_check, model)


@pytest.mark.timeout(120)
def test_exact_mode_in_float32_reports_no_difference() -> None:
    """fp32 needs the HF models' exact mode (HFMoEModel(deterministic=True)) for DBO == serial."""
    model = from_hf_model(tiny_hf_model("deepseek-v3"), schedule="ll", max_ubatches=2, block_size=4, num_kv_blocks=64,
                          deterministic=True)
    report = asyncdbo.run(_check, model)
    assert report.equal, str(report)
    assert report.compared == 2 * 4 * 2 + 2
