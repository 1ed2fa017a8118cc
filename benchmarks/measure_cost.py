"""What measuring every runner step costs the host (issue 26, item 1).

The per-yield path is unchanged (the host backend reads the clock once per wait on a comm work
still in flight, which parks the ubatch anyway); the new work is per step: after the run the
runner folds the step's comm records into a ``StepTiming`` (``host_timing``), puts it in the
record (``dataclasses.replace``) and counts it in the ledger (``OverlapLedger.add``). This times
exactly those three calls on comm records shaped like a real step's (per layer and ubatch a counts
message, a dispatch and a combine; two thirds of them waited for in flight), for 2, 15 and 61
layers at N = 2, interleaved rounds, medians; and, for scale, ``DBORunner.step`` of a 2-layer
MiniModel decode step of 64 tokens on one process in the same rounds.

    python benchmarks/measure_cost.py [--rounds 9] [--out benchmarks/results] [--base REV]

``--base REV`` times the three calls of the package at an earlier commit (exported with ``git
archive``, as ``compare_commits.py`` does) on the same inputs in the same rounds: a before/after
in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import publish_results, results_preamble  # noqa: E402

from asyncdbo.backends import CommRecord  # noqa: E402
from asyncdbo.dbo import RunStats  # noqa: E402
from asyncdbo.plan import PlanReason, StepRecord  # noqa: E402
from asyncdbo.serving.measure import OverlapLedger, host_timing, shape_bucket  # noqa: E402


def _stats(layers: int, n: int = 2) -> RunStats:
    comm = []
    t = 0.0
    for layer in range(layers):
        for ub in range(n):
            for k, what in enumerate(("counts", "dispatch", "combine")):
                t += 1e-4
                comm.append(CommRecord(ub=ub, what=what, nbytes=4096, t_issue=t, t_done=t + 3e-4,
                                       t_wait=t + 1e-4 if k else None))
    return RunStats(num_ubatches=n, num_switches=0, num_parks=0, time_asleep_s=1e-3, comm=tuple(comm))


def _measure_once(stats: RunStats, rec: StepRecord, ledger: OverlapLedger, reps: int, measure: Any = None) -> float:
    """Seconds per step of the three calls; ``measure``: another ``asyncdbo.serving.measure``
    module (``--base``) whose functions run on the same inputs."""
    timing_of, bucket_of = (host_timing, shape_bucket) if measure is None else (measure.host_timing,
                                                                                  measure.shape_bucket)
    t0 = time.perf_counter()
    for _ in range(reps):
        timing = timing_of(stats, 1e-2)
        r = dataclasses.replace(rec, config="N=2 token auto", timing=timing)
        ledger.add(r, 64, bucket_of(64, True))
    return (time.perf_counter() - t0) / reps


def _runner_step_s(reps: int) -> float:
    from asyncdbo.models import MiniConfig, MiniModel
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    cfg = MiniConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2, head_dim=32, num_experts=4,
                     top_k=2, moe_intermediate_size=64, block_size=4, num_kv_blocks=64)
    runner = DBORunner(MiniModel(cfg), RunnerConfig(thresholds=ThresholdConfig(decode_threshold=1)))
    builder = BatchBuilder(cfg.kv_cache_config)

    async def steps() -> float:
        builder.reset()
        batch = builder.build([(rid, [1]) for rid in range(64)])
        await runner.step(batch)  # warm
        t0 = time.perf_counter()
        for _ in range(reps):
            builder.reset()
            await runner.step(builder.build([(rid, [1]) for rid in range(64)]))
        return (time.perf_counter() - t0) / reps

    return asyncio.run(steps())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="1 round, few repetitions, no runner step, print only")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--base", default=None, metavar="REV",
                        help="also time the measuring functions of asyncdbo at REV, on the same inputs in the same rounds")
    args = parser.parse_args()
    base = None
    if args.base:
        import importlib
        import tempfile

        from compare_commits import export_base

        export_base(args.base, Path(tempfile.mkdtemp(prefix="measure_cost_base_")), "asyncdbo_base")
        base = importlib.import_module("asyncdbo_base.serving.measure")
    rounds, reps = (1, 20) if args.quick else (args.rounds, 400)
    lines, info = results_preamble("Per-step cost of measuring every runner step",
                                   "python benchmarks/measure_cost.py " + " ".join(sys.argv[1:]))
    rec = StepRecord(step=0, microbatched=True, reason=PlanReason.MICROBATCHED)
    cases = {layers: _stats(layers) for layers in (2, 15, 61)}
    samples: dict[str, list[float]] = {f"{layers} layers ({len(s.comm)} comm works)": [] for layers, s in cases.items()}
    base_samples: dict[str, list[float]] = {key: [] for key in samples}
    runner_key = "DBORunner.step, 2-layer MiniModel, 64-token decode, 1 process"
    if not args.quick:
        samples[runner_key] = []
    for r in range(rounds):
        for (layers, stats), key in zip(cases.items(), samples):
            # with --base, both on the same inputs back to back, in alternating order: drift hits both alike
            order = [(samples, None)] + ([(base_samples, base)] if base is not None else [])
            for into, mod in order[::-1] if r % 2 else order:
                ledger = OverlapLedger() if mod is None else mod.OverlapLedger()
                into[key].append(_measure_once(stats, rec, ledger, reps, mod))
        if not args.quick:
            samples[runner_key].append(_runner_step_s(3))
    lines.append(f"\nMedians of {rounds} interleaved rounds [min..max], microseconds per step.\n\n")
    lines.append("| what | us per step |\n|---|---:|\n")
    for key, xs in samples.items():
        lines.append(f"| {key} | {statistics.median(xs) * 1e6:,.1f} [{min(xs) * 1e6:,.1f}..{max(xs) * 1e6:,.1f}] |\n")
    if base is not None:
        lines.append(f"\nThe same three calls of asyncdbo at {args.base} (its host_timing, OverlapLedger and "
                     "shape_bucket on the same inputs, beside this tree's in every round, in alternating order); ratio: the median "
                     "over rounds of this tree's time / the base's in the same round.\n\n")
        lines.append(f"| what | {args.base} us per step | this tree / {args.base} |\n|---|---:|---:|\n")
        for key, xs in base_samples.items():
            ratio = statistics.median(a / b for a, b in zip(samples[key], xs))
            lines.append(f"| {key} | {statistics.median(xs) * 1e6:,.1f} [{min(xs) * 1e6:,.1f}..{max(xs) * 1e6:,.1f}] "
                         f"| {ratio:.2f} |\n")
    publish_results("".join(lines), None if args.quick else args.out, "measure_cost", info)


if __name__ == "__main__":
    main()
