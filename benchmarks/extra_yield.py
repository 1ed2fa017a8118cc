"""Does one more yield point bring a DBO step closer to its schedule bound? ``moe_step.py``'s
replay says the gap above the bound is the one CPU: a ubatch whose message arrived waits for the
other ubatch's step in progress. Shorter steps might shorten that wait, so this runs
``moe_step``'s model and numbers with an extra ``await dbo_yield("attn_done")`` after every
attention (``MiniModel._attention`` wrapped in the rank processes: attention and the MoE routing
then run as two steps) and without it, four fresh pools of 2 gloo ranks per case, in the order
without, with, without, with. The serial baseline runs in the same processes, so it carries the
extra yield too (one ubatch: the yield hands the CPU back to itself).

    python benchmarks/extra_yield.py          # ~2 min, writes benchmarks/results/extra_yield_<hw>_<date>.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import moe_step
from moe_step import Case

RESULTS = Path(__file__).resolve().parent / "results"
DESIGNS = ("serial", "asyncdbo ht", "asyncdbo ll")
CASES = [
    Case(name="prefill 1024 tok/rank, 2 layers, ib400 x1000", shape="prefill", tokens=1024, layers=2, link="ib400",
         designs=DESIGNS),
    Case(name="decode 64 tok/rank, 8 layers, ib400 x1000", shape="decode", tokens=64, layers=8, link="ib400",
         designs=DESIGNS),
]


def bench_rank(rank: int, world: int, case: Case, steps: int, warmup: int, extra_yield: bool) -> dict[str, Any]:
    """``moe_step.bench_rank``, with a yield after every attention when ``extra_yield`` (this
    rank process only: the pool is fresh for every variant)."""
    if extra_yield:
        import asyncdbo
        from asyncdbo.models import mini

        attention = mini.MiniModel._attention

        async def attention_then_yield(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = await attention(self, *args, **kwargs)
            await asyncdbo.dbo_yield("attn_done")
            return out

        mini.MiniModel._attention = attention_then_yield  # type: ignore[method-assign]
    return moe_step.bench_rank(rank, world, case, steps, warmup)


def main(argv: list[str] | None = None) -> int:
    import _progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    _progress.start(args.quiet, "runs (case x round x extra yield, each in a fresh pool of 2 ranks)", 4 * len(CASES))
    from _results import publish_results, results_preamble

    from asyncdbo.testing import RankPool

    lines, info = results_preamble("One more yield point: the schedule bound with and without a yield after attention",
                                   "python benchmarks/extra_yield.py")
    lines += [
        f"moe_step's model and numbers ({args.steps} steps after 2 warm-up, medians of the slower rank; see moe_step.py), "
        "N = 2; the variants alternate, each in a fresh pool of 2 ranks.",
        "",
        "| case | round | yield after attention | design | step ms | speedup vs serial (paired) | step / bound | "
        "replay / bound | step / replay |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for case in CASES:
        for rnd, extra in ((1, False), (1, True), (2, False), (2, True)):
            _progress.step(f"{case.name}: round {rnd}, extra yield {'yes' if extra else 'no'}")
            with RankPool(2, timeout_s=600) as pool:
                per_rank = pool.run(bench_rank, case, args.steps, 2, extra)
            s = moe_step.summarize(case, per_rank)
            for d in DESIGNS[1:]:
                x = s[d]
                lines.append(
                    f"| {case.name} | {rnd} | {'yes' if extra else 'no'} | {d} | {x['step_s'] * 1e3:.1f} | "
                    f"{1 / s['paired'][(d, 'serial')]:.2f}x | {x['step_per_bound']:.2f} | {x['replay_per_bound']:.2f} | "
                    f"{x['step_per_replay']:.2f} |"
                )
    _progress.done()
    publish_results("\n".join(lines) + "\n", args.out, "extra_yield", info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
