"""Compiled segments: a synchronous piece between two yields, compiled with inductor on the CPU,
runs inside a DBO run and gives eager's logits; compiling the ``async def`` forward itself compiles
nothing.

Kept to one tiny segment (the residual add + RMSNorm that runs twice per layer): a cold inductor
compile costs seconds per graph on a 2-core CPU.  Compiling every segment of a model
(``HFMoEModel.compile_segments``) is measured in ``benchmarks/compiled_segments.py`` (its
``--quick`` smoke run traces with Dynamo's ``eager`` backend only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_model_ranks import prompts_for  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import asyncdbo  # noqa: E402
from asyncdbo.models.hf import from_hf_model  # noqa: E402
from asyncdbo.models.hf.common import residual_norm  # noqa: E402
from asyncdbo.models.hf.reference import tiny_hf_model  # noqa: E402
from asyncdbo.plan import ThresholdConfig  # noqa: E402
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig  # noqa: E402

ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)


async def _prefill(model: Any, enabled: bool) -> Any:
    runner = DBORunner(model, RunnerConfig(thresholds=ALWAYS))
    batch = BatchBuilder(model.kv_cache_config).build(list(prompts_for(0).items()))
    return await runner.step(batch, enabled=enabled)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compiled_segment_between_yields_gives_eagers_logits_with_one_graph_for_every_call() -> None:
    hf = tiny_hf_model("qwen3-moe")
    eager = from_hf_model(hf, block_size=4, num_kv_blocks=64)
    compiled = from_hf_model(hf, block_size=4, num_kv_blocks=64)
    compiled.segments = dataclasses.replace(
        compiled.segments, residual_norm=torch.compile(residual_norm, backend="inductor", dynamic=True))
    torch._dynamo.reset()
    counters.clear()
    for enabled in (False, True):  # one batch of 22 tokens, then two ubatches of 11 that interleave
        want, got = asyncdbo.run(_prefill, eager.with_fresh_cache(), enabled), asyncdbo.run(_prefill, compiled.with_fresh_cache(), enabled)
        assert got.record.microbatched is enabled
        assert (got.logits_TV - want.logits_TV).abs().max().item() <= 1e-5  # fused kernels round differently
        assert torch.equal(got.logits_TV.argmax(-1), want.logits_TV.argmax(-1))
    # Weights are inputs, sizes are symbolic: one graph serves both layers, the whole batch and
    # both ubatches (4 calls per forward, 3 forwards).
    assert counters["stats"]["unique_graphs"] == 1


def test_compiling_the_async_forward_itself_compiles_nothing() -> None:
    """``torch.compile`` on an ``async def`` wraps the call that only creates the coroutine; the
    body runs later, at ``send``, outside Dynamo: eager numbers, no graph.  Compile the
    synchronous pieces instead."""
    hf = tiny_hf_model("mixtral")
    model = from_hf_model(hf, block_size=4, num_kv_blocks=64)
    batch = BatchBuilder(model.kv_cache_config).build([(0, [1, 2, 3, 4, 5])])
    want = asyncdbo.run(model.with_fresh_cache().forward, batch.input_ids_T, batch.positions_T, batch.attn)
    torch._dynamo.reset()
    counters.clear()
    got = asyncdbo.run(torch.compile(model.forward), batch.input_ids_T, batch.positions_T, batch.attn)
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 0 and counters["stats"]["calls_captured"] == 0
