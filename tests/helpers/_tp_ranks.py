"""Functions the dense tensor-parallel tests run on RankPool ranks (module level: pickled by name).

Every rank of a TP group runs the same requests.  :func:`tp_generate` builds the tiny Llama or
Qwen3 (the same seeded transformers model on every rank, each keeping its blocks), or loads the
checkpoint the test saved, and generates greedily twice, serially and with DBO, each run on its own
KV cache; the parent compares rank 0's logits with transformers'.  :func:`tp_exact` runs three steps
(a prefill whose long request the token split cuts, a chunked prefill mixed with decode tokens, a
decode step) serially and with DBO in exact mode and reports whether logits and KV caches are
``torch.equal``.

Legend (shape suffixes): T tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import asyncdbo
from asyncdbo.models.hf.generate import greedy_generate
from asyncdbo.models.hf.reference import tiny_hf_model
from asyncdbo.models.tp import load_tp_checkpoint, tp_from_hf_model
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
VOCAB = 96  # the tiny configs' vocab_size
PROMPTS = {0: [5, 17, 33, 2, 90, 41, 8, 66, 12], 1: [int(t) for t in torch.arange(23) * 7 % VOCAB], 2: [3, 1, 4, 1]}


@dataclass(frozen=True, kw_only=True)
class Case:
    model: str = "llama"
    dtype: str = "float32"
    stream_policy: str = "role"
    num_ubatches: int = 2
    sequence_parallel: bool = False
    overrides: tuple[tuple[str, Any], ...] = ()

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(thresholds=ALWAYS, stream_policy=self.stream_policy,  # type: ignore[arg-type]
                            num_ubatches=self.num_ubatches)

    def hf_model(self) -> Any:
        return tiny_hf_model(self.model, dtype=getattr(torch, self.dtype), **dict(self.overrides))


def _group() -> Any:
    return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None


async def _generate(case: Case, ckpt: str | None, deterministic: bool) -> dict[str, Any]:
    group, dtype = _group(), getattr(torch, case.dtype)
    kw: dict[str, Any] = dict(tp_group=group, max_ubatches=max(case.num_ubatches, 2), block_size=4, num_kv_blocks=64,
                              dtype=dtype, deterministic=deterministic, sequence_parallel=case.sequence_parallel)
    model = load_tp_checkpoint(ckpt, model=case.model, **kw)[0] if ckpt else tp_from_hf_model(case.hf_model(), **kw)
    out: dict[str, Any] = {}
    for mode, net in (("serial", model), ("dbo", model.with_fresh_cache())):
        runner = DBORunner(net, case.runner_config(), dp_group=group)
        (gen,) = await greedy_generate([(runner, mode == "dbo")], BatchBuilder(net.kv_cache_config), PROMPTS,
                                       decode_steps=2)
        out[mode] = {"fed": gen.fed, "logits": gen.logits, "microbatched": [r.microbatched for r in gen.records]}
    return out


def tp_generate(rank: int, world_size: int, case: Case, ckpt: str | None = None,
                deterministic: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    return asyncdbo.run(_generate, case, ckpt, deterministic)  # type: ignore[arg-type]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


STEPS = [
    [(0, _tokens(9, 1)), (1, _tokens(61, 2)), (2, _tokens(5, 3))],
    [(0, _tokens(1, 4)), (1, _tokens(30, 5)), (2, _tokens(1, 6)), (3, _tokens(13, 7))],
    [(r, _tokens(1, 10 + r)) for r in range(4)],
]


async def _exact(case: Case, deterministic: bool) -> dict[str, Any]:
    group = _group()
    model = tp_from_hf_model(case.hf_model(), tp_group=group, max_ubatches=case.num_ubatches, block_size=4,
                             num_kv_blocks=128, dtype=getattr(torch, case.dtype), deterministic=deterministic,
                             sequence_parallel=case.sequence_parallel)
    twin = model.with_fresh_cache()
    cfg = case.runner_config()
    serial, dbo = DBORunner(model, cfg, dp_group=group), DBORunner(twin, cfg, dp_group=group)
    builder = BatchBuilder(model.kv_cache_config)
    out: dict[str, Any] = {"equal": [], "microbatched": [], "max_abs_diff": 0.0, "cuts": []}
    for chunks in STEPS:
        batch = builder.build(chunks)
        s = await serial.step(batch, enabled=False)
        d = await dbo.step(batch)
        out["equal"].append(torch.equal(s.logits_TV, d.logits_TV))
        out["max_abs_diff"] = max(out["max_abs_diff"], (s.logits_TV.float() - d.logits_TV.float()).abs().max().item())
        out["microbatched"].append(d.record.microbatched and not s.record.microbatched)
        out["cuts"].append(d.record.ubatch_num_tokens)
    caches = (model.kv_cache, twin.kv_cache)
    out["kv_equal"] = all(torch.equal(a, b) for a, b in zip(*(c.k_cache_LNZHK + c.v_cache_LNZHK for c in caches)))
    out["logits"] = d.logits_TV
    return out


def tp_exact(rank: int, world_size: int, cases: list[Case], deterministic: bool = True) -> dict[Case, Any]:
    torch.set_num_threads(1)
    return {c: asyncdbo.run(_exact, c, deterministic) for c in cases}  # type: ignore[arg-type]


def tp_loaded(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """What this rank's load of ``ckpt`` kept: each slot's shape and the tensors it read."""
    model, report = load_tp_checkpoint(ckpt, tp_group=_group())
    return {"shapes": {name: tuple(model.slots[name].shape) for name in model.slots.names()},
            "read": report.tensors_read, "vocab_start": model.vocab_start}


async def _serving(case: Case) -> dict[str, Any]:
    """The runner's ``tuning="auto"``, :func:`~asyncdbo.serving.exact_check` and the Engine on a TP
    model, unchanged: every rank of the group votes in the runner's DP group (the TP group)."""
    from asyncdbo.serving import Engine, Request, SamplingParams, exact_check

    group = _group()
    model = tp_from_hf_model(case.hf_model(), tp_group=group, max_ubatches=4, block_size=4, num_kv_blocks=256,
                             deterministic=True)
    out: dict[str, Any] = {}
    try:  # without the TP group in its vote, each rank would choose its own ubatch count
        DBORunner(model, RunnerConfig(tuning="auto", thresholds=ALWAYS))
    except ValueError as e:
        out["refusal"] = str(e)
    auto = DBORunner(model.with_fresh_cache(), RunnerConfig(tuning="auto", thresholds=ALWAYS), dp_group=group)
    builder = BatchBuilder(model.kv_cache_config)
    out["auto_arms"] = []
    for i in range(6):  # prefill, then decode steps: the policy explores its arms
        chunks = [(r, _tokens(40 if i == 0 else 1, 50 + 10 * i + r)) for r in range(3)]
        res = await auto.step(builder.build(chunks))
        out["auto_arms"].append(res.record.ubatch_num_tokens)
    out["auto_logits"] = res.logits_TV
    check_builder = BatchBuilder(model.kv_cache_config)
    runner = DBORunner(model.with_fresh_cache(), case.runner_config(), dp_group=group)
    out["exact"] = str(await exact_check(runner, check_builder.build(STEPS[0])))
    outputs = {}
    for enabled in (False, True):
        net = model.with_fresh_cache()
        eng = Engine(DBORunner(net, case.runner_config(), dp_group=group), BatchBuilder(net.kv_cache_config, vocab_size=VOCAB),
                     enabled=enabled, max_num_seqs=3, seed=5)
        reqs = [Request(request_id=i, prompt=tuple(_tokens(3 + 5 * i, 70 + i)), params=SamplingParams(max_tokens=4))
                for i in range(5)]
        report = await eng.run(reqs)
        outputs[enabled] = {rid: o.output_ids for rid, o in report.outputs.items()}
    out["engine"] = outputs
    return out


def tp_serving(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    torch.set_num_threads(1)
    return asyncdbo.run(_serving, case)  # type: ignore[arg-type]


async def _hidden(case: Case) -> list[Any]:
    """Prefill steps with DBO on the modeled ib400 link: each step's measured timing."""
    from asyncdbo.backends.links import link_spec

    group = _group()
    model = tp_from_hf_model(case.hf_model(), tp_group=group, max_ubatches=2, block_size=4, num_kv_blocks=256)
    cfg = RunnerConfig(thresholds=ALWAYS, backend="host", link=link_spec("ib400", latency_s=2e-4, bandwidth_Bps=50e6))
    runner = DBORunner(model, cfg, dp_group=group)
    builder = BatchBuilder(model.kv_cache_config)
    timings = []
    for i in range(3):
        res = await runner.step(builder.build([(10 * i + r, _tokens(128, 90 + 10 * i + r)) for r in range(2)]))
        timings.append(res.record.timing)
    return timings


def tp_hidden(rank: int, world_size: int, case: Case) -> list[Any]:
    torch.set_num_threads(1)
    return asyncdbo.run(_hidden, case)  # type: ignore[arg-type]
