"""An engine's model runner adopting asyncdbo (docs/integration.md), on a Qwen3-MoE checkpoint.

    python examples/05_engine_integration.py
    torchrun --nproc-per-node 2 examples/05_engine_integration.py   # or across nodes: --nnodes 2 ...

Two local ranks (DP = EP = 2) each hold a ``ModelRunner`` the way a vLLM or SGLang worker holds
one: built once from a checkpoint directory (each rank reads its own experts), then called
synchronously once per engine step with the requests the scheduler picked.  Inside, the only async
call is ``DBORunner.step``: it votes with the other rank (microbatch or not), splits the batch,
runs the ubatches interleaved on this thread, and merges the logits.  Everything around it stays
synchronous: input preparation, the sampler, the engine loop.  Rank 1's requests finish earlier;
it keeps stepping with an empty batch, because every rank must join every step's collectives.

Then the same two ranks let :class:`asyncdbo.serving.Engine` run the whole loop over a replayed
arrival trace (continuous batching: requests join and finish between steps, greedy and seeded
top-p sampling, EOS/stop tokens, KV blocks freed on finish), once serially and once with DBO, each
on a ``StepClock`` (arrivals counted in engine steps, not wall time) so that both runs take the
same steps with the same tokens, and compare their measured step times with
``compare_modes`` (the second of two rounds; the first warms both paths up). The numbers are this
machine's, on a tiny model, one run of each: the point is the measurement, which an integrator
repeats on their own model and trace.

Thresholds: the defaults (``decode_threshold=32``, ``prefill_threshold=512`` tokens per rank) are
vLLM's, sized for real batches; at this example's 1-4 running requests per rank no step would
split and both runs would be the serial one. So the example lowers them to 2 and 16: every step
with at least two requests' tokens microbatches, and each step's record says when and why one fell
back (printed below: ``below_threshold`` with the count, or ``rank_declined`` when the other rank
was below it).

The checkpoint is a tiny random Qwen3-MoE saved here with ``save_pretrained`` (nothing is
downloaded); at the end the tokens each rank generated are checked against transformers' greedy
choice over the same tokens, and each greedy request of the trace against transformers'
``generate()``.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import torch

from asyncdbo.cli.reasons import REASON_WORDS
from asyncdbo.models.hf.checkpoint import load_checkpoint
from asyncdbo.models.hf.reference import hf_logits, tiny_hf_model
from asyncdbo.plan import StepRecord, ThresholdConfig
from asyncdbo.serving import (BatchBuilder, DBORunner, Engine, RunnerConfig, SamplingParams, StepClock, compare_modes,
                              trace_requests)
from asyncdbo.testing import run_ranks

STEPS = 4
#: Tiny model, tiny steps: every step with two requests' tokens splits (module docstring).
THRESHOLDS = ThresholdConfig(prefill_threshold=16, decode_threshold=2)


class ModelRunner:
    """One rank's worker: synchronous to the engine, ``async def`` only below ``execute_model``."""

    def __init__(self, checkpoint: str, group: Any) -> None:
        # Building is collective (the MoE layers make one process group per ubatch slot): every
        # rank constructs its runner at the same time, at start-up, outside any step.
        self.model, _ = load_checkpoint(checkpoint, model="qwen3-moe", ep_group=group, max_ubatches=2,
                                        block_size=16, num_kv_blocks=32)
        self.dbo = DBORunner(self.model, RunnerConfig(num_ubatches=2, thresholds=THRESHOLDS), dp_group=group)
        self.inputs = BatchBuilder(self.model.kv_cache_config)  # block tables, slot mapping, positions
        self.loop = asyncio.Runner()  # one event loop for the worker's lifetime
        self.records: list[StepRecord] = []

    def execute_model(self, scheduled: list[tuple[int, list[int]]]) -> dict[int, int]:
        """One engine step: the scheduler's ``(request id, new tokens)`` -> one sampled token each."""
        batch = self.inputs.build(scheduled)  # sync input prep (an idle rank builds an empty batch)
        result = self.loop.run(self.dbo.step(batch))  # the one async call: plan, ubatches, merge
        self.records.append(result.record)
        last, out = 0, {}
        for rid, tokens in scheduled:  # a greedy sampler over each request's last row
            last += len(tokens)
            out[rid] = int(result.logits_TV[last - 1].argmax())
        return out

    def close(self) -> None:
        self.loop.close()


def describe(records: list[StepRecord], *, serial: bool = False) -> list[str]:
    """A line per step: the rank's tokens and their ubatches, or why the step ran unsplit (left out
    for a serial run, where every step is unsplit by choice); a rank with no requests says so."""
    lines = []
    for rec in records:
        n = sum(rec.ubatch_num_tokens)
        if n == 0:
            lines.append("no requests on this rank (it still joins the step's vote and collectives)")
            continue
        line = f"{n} token{'s' if n != 1 else ''} -> ubatches {list(rec.ubatch_num_tokens)}"
        if not rec.microbatched and not serial:
            line += f", unsplit: {REASON_WORDS.get(rec.reason.value, rec.reason.value)}"
        lines.append(line)
    return lines


def serve_trace(model: Any, rank: int, group: Any) -> dict[str, Any]:
    """The trace on this rank through :class:`Engine`, serially then with DBO, each on a fresh KV
    cache over the same weights. Rank 0 gets six requests, rank 1 three that come later."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 6 if rank == 0 else 3
    prompts = [torch.randint(0, 96, (int(k),), generator=g).tolist() for k in torch.randint(3, 24, (n,), generator=g)]
    arrivals = [0.02 * i + 0.05 * rank for i in range(n)]  # seconds of the StepClock: 2 steps apart, rank 1 5 later
    params = [SamplingParams(max_tokens=4 + 2 * (i % 3), stop_token_ids=(95,)) for i in range(n)]
    params[-1] = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7)  # one sampled request
    trace = trace_requests(prompts, arrivals, params)
    out: dict[str, Any] = {}
    for _ in range(2):  # the first round warms both paths up (first calls allocate); the second is reported
        for mode, enabled in (("serial", False), ("dbo", True)):
            net = model.with_fresh_cache()
            runner = DBORunner(net, RunnerConfig(num_ubatches=2, thresholds=THRESHOLDS), dp_group=group)
            builder = BatchBuilder(net.kv_cache_config, vocab_size=96)
            clock = StepClock(step_s=0.01)  # each arrival lands on the same step in both runs
            report = asyncio.run(Engine(runner, builder, enabled=enabled, clock=clock, sleep=clock.sleep).run(trace))
            assert builder.num_free_blocks == net.kv_cache_config.num_blocks  # every block came back
            out[mode] = {"report": report, "steps": describe(list(report.records), serial=not enabled),
                         "outputs": {i: list(o.output_ids) for i, o in report.outputs.items()}}
    out["compared"] = compare_modes(out["serial"].pop("report"), out["dbo"].pop("report")).summary()
    out["trace"] = [(list(r.prompt), r.params) for r in trace]
    return out


def worker(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """The engine loop of one rank: prefill, then decode until each request has its tokens; then
    the replayed trace through :class:`Engine`."""
    runner = ModelRunner(checkpoint, torch.distributed.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    prompts = {r: torch.randint(0, 96, (n,), generator=g).tolist() for r, n in enumerate([9, 14, 5][: 3 - rank])}
    wanted = {r: STEPS if rank == 0 else 2 for r in prompts}  # rank 1 is done after 2 tokens
    fed = {r: list(p) for r, p in prompts.items()}
    out: dict[int, list[int]] = {r: [] for r in prompts}
    scheduled = [(r, list(p)) for r, p in prompts.items()]
    for _ in range(STEPS):
        for rid, token in runner.execute_model(scheduled).items():
            out[rid].append(token)
        scheduled = [(r, [out[r][-1]]) for r in prompts if len(out[r]) < wanted[r]]
        for rid, tokens in scheduled:
            fed[rid].extend(tokens)
    runner.close()
    served = serve_trace(runner.model, rank, torch.distributed.group.WORLD)
    return {"fed": fed, "out": out, "steps": describe(runner.records), "stats": runner.dbo.stats.summary(),
            "served": served}


def report(hf_model: Any, results: list[dict[str, Any]]) -> None:
    """Print every rank's steps and check its tokens against transformers (on the first rank)."""
    for rank, res in enumerate(results):
        print(f"rank {rank}: {res['stats']}")
        for i, line in enumerate(res["steps"]):
            print(f"  step {i}: {line}")
        for rid, tokens in res["out"].items():
            ref = hf_logits(hf_model, res["fed"][rid]).argmax(-1).tolist()
            same = ref[len(res["fed"][rid]) - len(tokens):] == tokens
            print(f"  request {rid}: generated {tokens}, transformers' greedy tokens {'identical' if same else 'DIFFER'}")
            assert same, (rank, rid)
    for rank, res in enumerate(results):
        served = res["served"]
        print(f"rank {rank}, replayed trace, with DBO:")
        for i, line in enumerate(served["dbo"]["steps"]):
            print(f"  step {i}: {line}")
        print(f"  {served['compared']}")
        assert served["serial"]["outputs"] == served["dbo"]["outputs"], rank
        for i, (prompt, params) in enumerate(served["trace"]):
            if params.temperature:
                continue  # sampled: equal serial and DBO (above), not a greedy reference
            ids = torch.tensor([prompt])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                    do_sample=False, eos_token_id=list(params.stop_token_ids), pad_token_id=0)
            assert ref[0, len(prompt):].tolist() == served["dbo"]["outputs"][i], (rank, i)
        print(f"rank {rank}: every greedy request of the trace equals transformers' generate()")


def torchrun_main(hf_model: Any) -> None:
    """One rank of a ``torchrun`` job (any number of nodes): each rank writes the same seeded
    checkpoint to its own directory (on a cluster a node has no other's disk), runs
    :func:`worker`, and rank 0 gathers every rank's result and checks it."""
    from datetime import timedelta

    import torch.distributed as dist

    from asyncdbo.dist import destroy_process_groups

    with tempfile.TemporaryDirectory() as ckpt:
        # before the process group: transformers' save_pretrained writes config.json only on
        # torch.distributed's rank 0 once a group exists
        hf_model.save_pretrained(ckpt)
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = worker(rank, world, ckpt)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        report(hf_model, gathered)
        print(f"torchrun: {world} ranks on {os.environ.get('GROUP_WORLD_SIZE', '1')} node(s) agree with transformers")
    destroy_process_groups()  # leave together: every gloo thread joined before the interpreter exits


if __name__ == "__main__":
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_model = tiny_hf_model("qwen3-moe")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        torchrun_main(hf_model)
    else:
        with tempfile.TemporaryDirectory() as ckpt:
            hf_model.save_pretrained(ckpt)
            results = run_ranks(worker, 2, ckpt, timeout_s=120)
        report(hf_model, results)
