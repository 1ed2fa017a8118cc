"""The MoE layer, the runner and the HF models on the real AcceleratorBackend under the fake device:
no stream rule broken (asyncdbo.testing.fake_device), and the same numbers as the serial run.

Both stream policies, both MoE schedules, 2 to 4 ubatches, one run and two concurrent runs
(asyncio tasks on one thread sharing its current stream). EP size 1: collectives are not placed
on fake streams (the sim backend checks multi-rank device order).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from _moe_ranks import DEEPSEEK_LIKE

import asyncdbo
from asyncdbo.backends.accelerator import AcceleratorBackend
from asyncdbo.moe import MoEConfig, MoELayer
from asyncdbo.testing.fake_device import FakeDevice

pytestmark = pytest.mark.timeout(300)

POLICIES = ("role", "ubatch")


def _split(x_TD: torch.Tensor, n: int) -> list[tuple[torch.Tensor]]:
    cuts = [len(x_TD) * k // n for k in range(n + 1)]
    return [(x_TD[a:b],) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
def test_moe_layer_keeps_cuda_rules_and_equals_the_plain_call(schedule: str, policy: str) -> None:
    """N = 2, 3, 4 one run at a time, then two runs of 3 ubatches concurrently (two tasks)."""
    layer = MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule=schedule), seed=3)
    xs = [torch.randn(24, 32, generator=torch.Generator().manual_seed(k)) for k in range(2)]

    async def main() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        refs = [await layer(x) for x in xs]  # plain calls
        be = AcceleratorBackend("cuda")
        alone = [await asyncdbo.run_ubatches(layer, _split(xs[0], n), backend=be, stream_policy=policy) for n in (2, 3, 4)]
        two = await asyncio.gather(*(asyncdbo.run_ubatches(layer, _split(x, 3), backend=be, stream_policy=policy)
                                     for x in xs))
        return refs, [*alone, *two]

    with FakeDevice():
        refs, runs = asyncdbo.run(main)
    for ref, outs in zip([refs[0]] * 3 + refs, runs):
        assert torch.equal(torch.cat(outs), ref)


@pytest.mark.parametrize(("policy", "n"), [("role", 4), ("ubatch", 3)])
def test_runner_steps_keep_cuda_rules_and_equal_the_serial_step(policy: str, n: int) -> None:
    from _model_ranks import ALWAYS, SMALL

    from asyncdbo.models import MiniModel
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    cfg = RunnerConfig(thresholds=ALWAYS, stream_policy=policy, num_ubatches=n)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(7)
    chunks = [(r, torch.randint(0, 128, (k,), generator=g).tolist()) for r, k in enumerate((9, 14, 5))]

    async def main() -> tuple[Any, Any]:
        serial, dbo = DBORunner(MiniModel(SMALL), cfg), DBORunner(MiniModel(SMALL), cfg)
        batch = BatchBuilder(SMALL.kv_cache_config).build(chunks)
        return await serial.step(batch, enabled=False), await dbo.step(batch)

    with FakeDevice():
        serial, dbo = asyncdbo.run(main)
    assert dbo.record.microbatched and not serial.record.microbatched
    assert torch.equal(serial.logits_TV, dbo.logits_TV)


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3"])  # ll on role streams; ht on ubatch streams, 3 ubatches
def test_hf_models_keep_cuda_rules_and_match_their_serial_run(name: str) -> None:
    pytest.importorskip("transformers")
    from _hf_model_ranks import VARIANTS, generate_serial_and_dbo, prompts_for

    from asyncdbo.models.hf import from_hf_model
    from asyncdbo.models.hf.reference import tiny_hf_model

    v = VARIANTS[name]
    model = from_hf_model(tiny_hf_model(name), schedule=v.schedule, max_ubatches=3, block_size=4, num_kv_blocks=64)
    with FakeDevice():
        runs = asyncdbo.run(generate_serial_and_dbo, model, v, prompts_for(0), None)
    assert runs["dbo"].greedy == runs["serial"].greedy
    assert all(rec.microbatched for rec in runs["dbo"].records)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("schedule", ["ht", "ll"])
def test_moe_layer_dbo_step_issues_no_host_sync_under_capturable_mode(schedule: str, policy: str) -> None:
    """Issue 28's bar for CUDA-graph capture: on the sync-free path (``sync_free=True``, what a
    device input gets by default) one DBO step of the MoE layer, N = 2 and 3 (one ubatch empty),
    makes the host wait for the device nowhere: the capturable fake fails on any host sync and on
    any stream rule; the numbers equal the plain call on the exact path."""
    exact = MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule=schedule), seed=3)
    free = MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule=schedule, sync_free=True), seed=3)
    x_TD = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))

    async def main() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        ref_TD = await exact(x_TD)  # outside the fake: the exact path syncs by design
        with FakeDevice(capturable=True) as fake:
            be = AcceleratorBackend("cuda")
            runs = [await asyncdbo.run_ubatches(free, args, backend=be, stream_policy=policy)
                    for args in (_split(x_TD, 2), [(x_TD[:17],), (x_TD[17:17],), (x_TD[17:],)])]
        assert fake.host_syncs == []
        return ref_TD, runs

    ref_TD, runs = asyncdbo.run(main)
    for outs in runs:
        assert torch.equal(torch.cat(outs), ref_TD)
