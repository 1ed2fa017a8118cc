"""Engine runs with one failure injected (in the model, in sampling, at admission; at a prefill or
a decode step; on one rank of one or two), each against a clean run of the same trace.

Every request arrives at 0 and ``max_num_seqs`` admits three at a time, so requests join as others
leave and the schedule does not depend on the clock; a run that fails is called again until the
trace is served. Greedy requests, seeded ones and ones the engine seeds itself (its generator
drawn at admission) are mixed, so a retried step must restore every generator to draw the clean
run's tokens. The watchdog is off: a peer learns of a failure from the engine's agreements and the
failure notice alone, and a hang would end the test by its timeout.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

import asyncdbo.serving.engine as engine_module
from asyncdbo.models.hf import from_hf_model
from asyncdbo.models.hf.reference import tiny_hf_model
from asyncdbo.plan import ThresholdConfig
from asyncdbo.serving import BatchBuilder, DBORunner, Engine, Request, RunnerConfig, SamplingParams, StepClock

ALWAYS = ThresholdConfig(decode_threshold=1, prefill_threshold=1)
VOCAB = 96


@dataclass(frozen=True)
class Fault:
    """Raise ``where`` ("model", "sampling", "admission", or "none") at engine step ``step`` on
    ``rank``, once."""

    where: str
    step: int
    rank: int = 0


def trace(rank: int, n: int = 7) -> list[Request]:
    g = torch.Generator().manual_seed(10 + rank)
    reqs = []
    for i in range(n):
        prompt = tuple(torch.randint(0, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist())
        kind = i % 3
        params = (SamplingParams(max_tokens=3 + i % 4) if kind == 0
                  else SamplingParams(max_tokens=4, temperature=0.9, seed=100 + i) if kind == 1
                  else SamplingParams(max_tokens=5, temperature=1.1, top_p=0.8))  # seeded by the engine
        reqs.append(Request(request_id=100 * rank + i, prompt=prompt, params=params))
    return reqs


def _inject(eng: Engine, net: Any, fault: Fault, rank: int) -> None:
    if fault.where == "none":
        return
    if fault.rank != rank:  # the peer starts the failing step late: the failure is posted before it starts
        cycle, late = eng._cycle, [True]

        async def late_cycle(now: float) -> Any:
            if late[0] and eng.num_steps == fault.step:
                late[0] = False
                await asyncio.sleep(0.3)
            return await cycle(now)
        eng._cycle = late_cycle  # type: ignore[method-assign]
        return
    fired = [False]

    def due() -> bool:
        if not fired[0] and eng.num_steps == fault.step:
            fired[0] = True
            return True
        return False

    if fault.where == "cancel-in-step":  # the run's task cancelled from inside the model: it lands in the run
        forward = net.forward

        async def cancelling_forward(*args: Any) -> Any:
            if due():
                task = asyncio.current_task()
                assert task is not None
                eng._test_run_task.cancel()  # type: ignore[attr-defined]
            return await forward(*args)
        net.forward = cancelling_forward
    elif fault.where == "model":
        forward = net.forward

        async def failing_forward(*args: Any) -> Any:
            if due():
                raise RuntimeError(f"injected model failure at step {fault.step}")
            return await forward(*args)
        net.forward = failing_forward
    elif fault.where == "cancel-between":
        pass  # serve() cancels the run's task between steps
    elif fault.where == "admission":
        build = eng.builder.build

        def failing_build(chunks: Any) -> Any:
            if chunks and due():
                raise RuntimeError(f"injected admission failure at step {fault.step}")
            return build(chunks)
        eng.builder.build = failing_build  # type: ignore[method-assign]
    elif fault.where == "sampling":
        sample = engine_module.sample_finite

        def failing_sample(*args: Any) -> Any:
            tokens = sample(*args)  # the draws happen: the retry must undo them
            if due():
                raise RuntimeError(f"injected sampling failure at step {fault.step}")
            return tokens
        engine_module.sample_finite = failing_sample  # type: ignore[assignment]
    else:
        raise ValueError(fault.where)


async def serve(model: Any, rank: int, group: Any, fault: Fault) -> dict[str, Any]:
    net = model.with_fresh_cache()
    runner = DBORunner(net, RunnerConfig(num_ubatches=2, thresholds=ALWAYS, watchdog_s=None), dp_group=group)
    builder = BatchBuilder(net.kv_cache_config, vocab_size=VOCAB)
    clock = StepClock(step_s=1.0)  # every step lasts exactly 1 s of the engine's clock
    eng = Engine(runner, builder, enabled=True, max_num_seqs=3, clock=clock, sleep=clock.sleep, seed=5)
    original = engine_module.sample_finite
    _inject(eng, net, fault, rank)
    outcomes: list[str] = []
    outputs: dict[int, tuple[int, ...]] = {}
    pending = trace(rank)
    try:
        for _ in range(4):
            try:
                task = eng._test_run_task = asyncio.ensure_future(eng.run(pending))  # type: ignore[attr-defined]
                if fault.where == "cancel-between" and fault.rank == rank and not outcomes:
                    while not task.done() and eng.num_steps < fault.step:
                        await asyncio.sleep(0)  # run() yields between steps
                    task.cancel()
                report = await task
            except (Exception, asyncio.CancelledError) as exc:
                pending = []
                outcomes.append(f"{type(exc).__name__}: {exc}")
                if rank == fault.rank and group is not None:
                    # Its peer waits in the retry's first agreement meanwhile, reading this rank's
                    # failure notice: a failure already handled must not abort the retry too.
                    await asyncio.sleep(0.3)
                continue
            outputs.update((rid, o.output_ids) for rid, o in report.outputs.items())
            break
    finally:
        engine_module.sample_finite = original  # type: ignore[assignment]
    return {"outcomes": outcomes, "outputs": outputs, "steps": eng.num_steps,
            "free": builder.num_free_blocks == net.kv_cache_config.num_blocks,
            "statuses": sorted({eng.status(r.request_id).value for r in trace(rank)})}


def build_model(group: Any) -> Any:
    return from_hf_model(tiny_hf_model("qwen3-moe"), ep_group=group, max_ubatches=2, block_size=4, num_kv_blocks=64)


async def clean_and_faulty(group: Any, rank: int, fault: Fault) -> dict[str, Any]:
    model = build_model(group)
    clean = await serve(model, rank, group, Fault("none", 0))
    faulty = await serve(model, rank, group, fault)
    return {"clean": clean, "faulty": faulty}


def on_ranks(rank: int, world_size: int, fault: Fault) -> dict[str, Any]:
    return asyncio.run(clean_and_faulty(torch.distributed.group.WORLD, rank, fault))
