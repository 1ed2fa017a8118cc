"""The engine under faults, for a long time: ``--steps`` engine steps on 2 gloo ranks (DP + EP, the
tiny random Qwen3-MoE), requests joining and leaving, and a failure injected every ``--every``
steps, cycling through the model (a ubatch raises), sampling (after the draws) and admission
(building the batch), on rank 0 and rank 1 in turn. The same trace is first served clean.

It reports, per rank: requests finished in each run and their tokens compared request by request
(a CRC of each request's output ids, kept in a preallocated array, so the check itself does not
grow memory), requests lost (added but never ended), failures injected and seen, and the RSS every
``--every`` steps from the end of warm-up (the first ``--warmup`` steps) with its spread.

Each rank keeps about 6 requests unfinished: every step it adds what the previous ones left
(prompts of 2-24 tokens, 2-12 new tokens; a third greedy, a third seeded, a third seeded by the
engine's own generator), all arriving at once, so the schedule does not depend on the clock and a
retried step must draw the clean run's tokens.

Usage::

    python benchmarks/engine_soak.py                      # 10,000 steps, a failure every 500
    python benchmarks/engine_soak.py --steps 2000 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import zlib
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import publish_results, results_preamble  # noqa: E402

KINDS = ("model", "sampling", "admission")
UNFINISHED = 6
VOCAB = 96


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Faults:
    """Injects one failure at each step ``k * every`` (k >= 1) on rank ``k % 2``, kind ``KINDS[k % 3]``."""

    def __init__(self, rank: int, every: int) -> None:
        self.rank, self.every = rank, every
        self.fired: set[int] = set()
        self.injected = 0

    def due(self, step: int, kind: str) -> bool:
        k = step // self.every
        if step == 0 or step % self.every or k in self.fired or k % 2 != self.rank or KINDS[k % 3] != kind:
            return False
        self.fired.add(k)
        self.injected += 1
        return True


async def _serve(model: Any, group: Any, rank: int, steps: int, every: int, warmup: int,
                 faulty: bool) -> dict[str, Any]:
    import torch

    import asyncdbo.serving.engine as engine_module
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, Engine, Request, RunnerConfig, SamplingParams

    net = model.with_fresh_cache()
    runner = DBORunner(net, RunnerConfig(num_ubatches=2, watchdog_s=None, thresholds=ThresholdConfig(decode_threshold=1,
                                                                                     prefill_threshold=1)),
                       dp_group=group)
    builder = BatchBuilder(net.kv_cache_config, vocab_size=VOCAB)
    t = [0.0]

    def clock() -> float:
        t[0] += 0.5
        return t[0]

    eng = Engine(runner, builder, max_num_seqs=4, clock=clock, seed=3)
    faults = _Faults(rank, every) if faulty else None
    original_sample, original_build, original_forward = engine_module.sample_finite, builder.build, net.forward
    if faults is not None:
        async def forward(*args: Any) -> Any:
            if faults.due(eng.num_steps, "model"):
                raise RuntimeError("injected model failure")
            return await original_forward(*args)

        def sample(*args: Any) -> Any:
            tokens = original_sample(*args)
            if faults.due(eng.num_steps, "sampling"):
                raise RuntimeError("injected sampling failure")
            return tokens

        def build(chunks: Any) -> Any:
            if chunks and faults.due(eng.num_steps, "admission"):
                raise RuntimeError("injected admission failure")
            return original_build(chunks)
        net.forward, builder.build, engine_module.sample_finite = forward, build, sample  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1000 + rank)
    max_requests = steps + UNFINISHED + 1
    crc = array("Q", bytes(8 * max_requests))  # request i's CRC of its output ids, +1 (0: not ended)
    added = ended = failed_steps = 0
    errors: list[str] = []
    rss: list[float] = []
    try:
        while eng.num_steps < steps:
            while eng.num_unfinished < UNFINISHED and added < max_requests:
                n_prompt = int(torch.randint(2, 25, (1,), generator=g))
                prompt = torch.randint(0, VOCAB, (n_prompt,), generator=g).tolist()
                kind, n_new = added % 3, int(torch.randint(2, 13, (1,), generator=g))
                params = (SamplingParams(max_tokens=n_new) if kind == 0
                          else SamplingParams(max_tokens=n_new, temperature=0.8, seed=added) if kind == 1
                          else SamplingParams(max_tokens=n_new, temperature=1.2, top_p=0.9))
                eng.add_request(Request(request_id=added, prompt=tuple(prompt), params=params))
                added += 1
            before = eng.num_steps
            try:
                for out in await eng.step():
                    crc[out.request_id] = zlib.crc32(repr(out.output_ids).encode()) + 1
                    ended += 1
            except Exception as exc:
                failed_steps += 1
                errors.append(f"step {eng.num_steps}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            if eng.num_steps != before and eng.num_steps >= warmup and eng.num_steps % every == 0:
                rss.append(_rss_mb())
    finally:
        net.forward, builder.build, engine_module.sample_finite = original_forward, original_build, original_sample
    return {"crc": crc, "added": added, "ended": ended, "unfinished": eng.num_unfinished, "rss_mb": rss,
            "failed_steps": failed_steps, "errors": errors, "injected": 0 if faults is None else faults.injected}


def _rank(rank: int, world: int, steps: int, every: int, warmup: int) -> dict[str, Any]:
    import torch

    from asyncdbo.models.hf import from_hf_model
    from asyncdbo.models.hf.reference import tiny_hf_model

    group = torch.distributed.group.WORLD
    model = from_hf_model(tiny_hf_model("qwen3-moe"), ep_group=group, max_ubatches=2, block_size=4, num_kv_blocks=64)
    clean = asyncio.run(_serve(model, group, rank, steps, every, warmup, faulty=False))
    faulty = asyncio.run(_serve(model, group, rank, steps, every, warmup, faulty=True))
    n = min(clean["added"], faulty["added"])
    both = [i for i in range(n) if clean["crc"][i] and faulty["crc"][i]]
    differ = [i for i in both if clean["crc"][i] != faulty["crc"][i]]
    for run in (clean, faulty):
        run["lost"] = run["added"] - run["ended"] - run["unfinished"]
        del run["crc"]
    return {"clean": clean, "faulty": faulty, "compared": len(both), "differ": differ}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--every", type=int, default=500, help="a failure every this many steps")
    p.add_argument("--warmup", type=int, default=1000, help="steps before RSS is read")
    p.add_argument("--out", type=Path, default=None, help="write the report to the next free results file here")
    p.add_argument("--errors", action="store_true", help="print each failed step's error per rank")
    args = p.parse_args()
    from asyncdbo.testing import run_ranks

    command = "python benchmarks/engine_soak.py " + " ".join(sys.argv[1:])
    head, info = results_preamble("Engine soak: failures injected, tokens and memory", command)
    results = run_ranks(_rank, 2, args.steps, args.every, args.warmup, timeout_s=7200.0)
    if args.errors:
        for rank, r in enumerate(results):
            print(f"rank {rank}:", *r["faulty"]["errors"], sep="\n  ")
    lines = [*head, f"\n{args.steps} steps per run, a failure every {args.every} (model, sampling, admission in "
                    f"turn; rank 0 and 1 in turn), RSS read every {args.every} steps from step {args.warmup}.\n\n",
             "| rank | run | requests added | ended | unfinished | lost | failures injected here | steps that "
             "raised | RSS MB (min-max, n) | spread MB |\n", "|---|---|---|---|---|---|---|---|---|---|\n"]
    for rank, r in enumerate(results):
        for name in ("clean", "faulty"):
            run = r[name]
            rss = run["rss_mb"]
            spread = max(rss) - min(rss) if rss else float("nan")
            lines.append(f"| {rank} | {name} | {run['added']} | {run['ended']} | {run['unfinished']} | {run['lost']} | "
                         f"{run['injected']} | {run['failed_steps']} | {min(rss):.1f}-{max(rss):.1f} ({len(rss)}) | "
                         f"{spread:.2f} |\n" if rss else "| - |\n")
        lines.append(f"\nRank {rank}: {r['compared']} requests ended in both runs, compared token for token: "
                     f"{len(r['differ'])} differ{(' ' + str(r['differ'][:10])) if r['differ'] else ''}.\n")
        if rss := r["faulty"]["rss_mb"]:
            lines.append(f"Rank {rank} faulty run RSS median {statistics.median(rss):.1f} MB.\n")
    publish_results("".join(lines), args.out, "engine_soak", info)


if __name__ == "__main__":
    main()
